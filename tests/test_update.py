"""The policy update: exact Eq. 12 accumulation over micro-batches, token-budget splitting."""

import copy
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from dapo_train.algo import loss_normalizer
from dapo_train.config import load_config
from dapo_train.rollout import Completion
from dapo_train.update import (
    TrainSample,
    UpdateContext,
    accumulate_gradients,
    collate_micro_batch,
    policy_update,
    split_micro_batches,
)

from conftest import EOS2_ID, EOS_ID, make_random_model


def _samples(n: int, seed: int = 0) -> list[TrainSample]:
    """n completions of different prompt and completion lengths, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        body = torch.randint(3, 60, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        completion = torch.cat([body, torch.tensor([EOS_ID])]) if i % 3 else body  # some truncated (no EOS)
        out.append(TrainSample(prompt, completion, advantage=float(torch.randn(1, generator=g)), in_loss=True))
    return out


def _grads_after(model, samples, micro_size: int, *, lr: float = 1e-3):
    """Gradients and AdamW-updated weights after one step. (Adam's first step is about
    lr * g / (|g| + eps), so gradients near eps amplify float32 noise; lr 1e-3 keeps that
    well inside the 1e-5 tolerance while the gradients themselves are compared directly.)"""
    cfg = load_config(
        None, ["train.prompts_per_step=2", "rollout.group_size=6", f"train.micro_batch_size={micro_size}"]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    accelerator = Accelerator(cpu=True)
    ctx = UpdateContext(model, optimizer, accelerator, cfg, pad_id=EOS2_ID)
    micro = [collate_micro_batch(m, EOS2_ID, accelerator.device) for m in split_micro_batches(samples, micro_size)]
    normalizer = loss_normalizer([batch.completion_mask for batch, _ in micro], "token")
    metrics = accumulate_gradients(ctx, micro, normalizer, None)
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return grads, [p.detach().clone() for p in model.parameters()], metrics, len(micro)


@pytest.mark.parametrize("micro_size", [3, 4])
def test_micro_batches_give_the_gradient_and_update_of_one_batch(micro_size):
    samples = _samples(12)
    base = make_random_model(seed=3).train()
    other = copy.deepcopy(base)
    grads_1, params_1, metrics_1, n1 = _grads_after(base, samples, 12)
    grads_k, params_k, metrics_k, nk = _grads_after(other, samples, micro_size)
    assert (n1, nk) == (1, 12 // micro_size)
    for a, b in zip(grads_1, grads_k):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for a, b in zip(params_1, params_k):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert metrics_1["loss"] == pytest.approx(metrics_k["loss"], abs=1e-6)
    assert metrics_1["num_tokens"] == metrics_k["num_tokens"] == sum(s.completion_ids.numel() for s in samples)


def test_token_budget_bounds_padded_tokens_and_keeps_order():
    samples = _samples(10, seed=5)
    budget = 40
    batches = split_micro_batches(samples, max_count=8, max_tokens=budget)
    assert [s for b in batches for s in b] == samples  # nothing lost or reordered
    for batch in batches:
        widest = max(s.prompt_ids.numel() + s.completion_ids.numel() for s in batch)
        assert len(batch) == 1 or widest * len(batch) <= budget
        assert len(batch) <= 8


def test_normalizer_counts_the_whole_step_and_skips_filtered_samples():
    samples = _samples(4)
    samples[1].in_loss = False  # e.g. a truncated completion under overlong filtering
    expected_tokens = sum(s.completion_ids.numel() for i, s in enumerate(samples) if i != 1)
    masks = [collate_micro_batch(m, EOS2_ID, "cpu")[0].completion_mask for m in split_micro_batches(samples, 3)]
    assert [m.shape[0] for m in masks] == [3, 1]  # counted over both micro-batches
    assert loss_normalizer(masks, "token") == expected_tokens
    assert loss_normalizer(masks, "sample") == 3


def test_nonfinite_gradient_skips_the_update():
    model = make_random_model(seed=4).train()
    before = [p.detach().clone() for p in model.parameters()]
    model.model.embed_tokens.weight.data[5, 0] = float("nan")  # poisons every forward using token 5
    cfg = load_config(None, ["train.prompts_per_step=1", "rollout.group_size=2", "train.micro_batch_size=2"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx = UpdateContext(model, optimizer, Accelerator(cpu=True), cfg, pad_id=EOS2_ID)

    # A minimal group: two completions of a prompt containing token 5.
    group = SimpleNamespace(
        completions=[Completion(torch.tensor([5, 6]), torch.tensor([7, EOS_ID]), False, "") for _ in range(2)],
        advantages=torch.tensor([1.0, -1.0]),
    )
    metrics = policy_update(ctx, [group])
    assert metrics["skipped_nonfinite"] == 1
    for a, b in zip(before[1:], list(model.parameters())[1:]):
        assert torch.equal(a, b)  # no parameter moved
