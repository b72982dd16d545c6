"""The optimizer step under fp16's loss scaler (train/update/optim.py), driven through accelerate's own code:
an overflowing step is the scaler's to skip, and it lowers the scale so the next step applies."""

import pytest
import torch
from accelerate import Accelerator

from dapo_train.config.load import load_config
from dapo_train.train.update.optim import PolicyOptimizer

from conftest import fp16_on_cpu


def test_an_overflowing_fp16_step_is_skipped_by_the_scaler_and_the_next_one_applies():
    """Step 1's gradient (1e38 per weight) overflows once scaled by 2^16: the scaler skips it and halves its
    scale, the weights stay; step 2's gradient is ordinary and applies. Before, step 1 skipped
    optimizer.step() (the only caller of the scaler's update()), so step 2's unscale raised."""
    accelerator = fp16_on_cpu()
    weight = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Module()
    model.weight = weight
    cfg = load_config(None, ["train.learning_rate=0.1", "train.warmup_steps=0"])
    optimizer = PolicyOptimizer(accelerator.prepare_optimizer(torch.optim.AdamW([weight], lr=0.1)), cfg)
    loss = (weight * 1e38).sum()
    accelerator.backward(loss)
    first = optimizer.step(model, accelerator, float(loss.detach()))
    assert (first.applied, first.scaler_skipped) == (False, True)
    assert not torch.isfinite(torch.tensor(first.grad_norm))
    assert torch.equal(weight.detach(), torch.ones(3)) and optimizer.steps == 0
    assert accelerator.scaler.get_scale() == 2.0**15  # the scaler lowered its scale
    loss = (weight * 2.0).sum()
    accelerator.backward(loss)
    second = optimizer.step(model, accelerator, float(loss.detach()))
    assert (second.applied, second.scaler_skipped) == (True, False)
    assert second.grad_norm == torch.tensor(12.0).sqrt().item()  # the unscaled gradient: 2 per weight
    assert optimizer.steps == 1 and bool((weight.detach() < 1.0).all())  # AdamW moved every weight down


def test_without_a_scaler_a_non_finite_gradient_is_a_non_finite_step():
    """bf16 or no mixed precision: no scaler to skip the step, so the step is not applied and is not a
    scaler skip (the update ends its step: a non-finite step, train/health.py)."""
    accelerator = Accelerator(cpu=True)
    weight = torch.nn.Parameter(torch.ones(3))
    model = torch.nn.Module()
    model.weight = weight
    optimizer = PolicyOptimizer(accelerator.prepare_optimizer(torch.optim.AdamW([weight], lr=0.1)),
                                load_config(None, []))
    loss = (weight * float("inf")).sum()
    accelerator.backward(loss)
    step = optimizer.step(model, accelerator, float(loss.detach()))
    assert (step.applied, step.scaler_skipped) == (False, False) and torch.equal(weight.detach(), torch.ones(3))


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_state_made_before_the_first_step_changes_nothing_that_follows(fused):
    """allocate_state makes AdamW's moments (zeros) and step counts (0) before any step; the steps that follow
    are bit for bit those of an optimizer that made its state lazily, weight decay and all."""
    from dapo_train.train.update.optim import allocate_state

    def steps(allocate: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=fused)
        if allocate:
            assert allocate_state(optimizer) == 2 * (12 + 3) * 4 + 2 * 4  # two float32 moments + a step count each
            assert all(float(state["step"]) == 0 for state in optimizer.state.values())
            assert all(p.grad is None for p in model.parameters())
        for _ in range(3):
            model(torch.randn(2, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for lazy, early in zip(steps(False), steps(True)):
        assert torch.equal(lazy, early)


def test_a_warmup_longer_than_the_run_is_said_at_start_with_the_rates_the_schedule_gives(caplog):
    """Issue 59 item 13: train.warmup_steps=1000 over 8 optimizer steps trained at lr 8e-7 without a word.
    2 steps x 4 updates x 1 iteration = 8 optimizer steps; warmup gives step s (0-based) lr * (s + 1) / 1000:
    1e-4 * 1/1000 = 1e-7 at the first and 1e-4 * 8/1000 = 8e-7 at the last."""
    import logging

    from dapo_train.train.session import _warn_inert_settings
    from dapo_train.train.update.optim import learning_rate

    cfg = load_config(None, ["train.warmup_steps=1000", "train.max_steps=2", "train.updates_per_step=4",
                             "train.learning_rate=1e-4"])
    assert learning_rate(cfg, 0) == pytest.approx(1e-7) and learning_rate(cfg, 7) == pytest.approx(8e-7)
    with caplog.at_level(logging.WARNING):
        _warn_inert_settings(cfg)
    assert ("train.warmup_steps=1000 is longer than the run's 8 optimizer steps (train.max_steps=2 x "
            "train.updates_per_step=4 x dapo.num_iterations=1): the learning rate rises from 1e-07 to 8e-07 and "
            "never reaches train.learning_rate=0.0001; set train.warmup_steps to at most 8") in caplog.text
    caplog.clear()
    for warmup in (8, 0):  # the last step reaches the full rate, or there is no warmup: nothing to say
        with caplog.at_level(logging.WARNING):
            _warn_inert_settings(load_config(None, [f"train.warmup_steps={warmup}", "train.max_steps=2",
                                                    "train.updates_per_step=4"]))
        assert "warmup" not in caplog.text
