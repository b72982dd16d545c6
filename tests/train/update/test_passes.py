"""The policy update: exact Eq. 12 accumulation over micro-batches, token-budget splitting, the
mini-batch regime (several optimizer steps per rollout batch) and honest old log-probs."""

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from dapo_train.algo import loss_normalizer, objectives
from dapo_train.algo.correction import RolloutCorrection
from dapo_train.config.load import load_config
from dapo_train.config.schema import Config
from dapo_train.rollout import Completion
from dapo_train.task.prompts import Prompt
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.update import batching as batching
from dapo_train.train.update.batching import (
    MiniBatch,
    TrainSample,
    collate_micro_batch,
    flatten_groups,
    split_micro_batches,
    use_shared_prefix,
)
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.optim import learning_rate, total_optimizer_steps
from dapo_train.train.update.passes import Learner, _means, accumulate_gradients, update

from conftest import EOS2_ID, EOS_ID, fp16_on_cpu, make_random_model


def _learner(model, cfg: Config, lr: float = 1e-3) -> Learner:
    return Learner.build(cfg, model, torch.optim.AdamW(model.parameters(), lr=lr), Accelerator(cpu=True), EOS2_ID)


def _train(learner: Learner, groups: list, cfg: Config) -> dict:
    """The trainer's step 3 on these groups, in one process."""
    return update(learner, StepBatch(groups, [len(groups)], {}), cfg)


def _record(learner: Learner, groups: list) -> int:
    return record_old_logprobs(learner.model, groups, learner.batching, learner.scorer)


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


def _group_samples(groups: int, size: int, seed: int = 0) -> list[TrainSample]:
    """groups x size completions; the completions of a group share one prompt tensor, as collect makes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        prompt = torch.randint(3, 60, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g)
        for j in range(size):
            body = torch.randint(3, 60, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g)
            completion = torch.cat([body, torch.tensor([EOS_ID])]) if j % 3 else body
            out.append(TrainSample(prompt, completion, advantage=float(torch.randn(1, generator=g)), in_loss=j != 2))
    return out


def _grads_after(model, samples, micro_size: int, *, lr: float = 1e-3, share_prefix: bool = False):
    """Gradients and AdamW-updated weights after one step. (Adam's first step is about
    lr * g / (|g| + eps), so gradients near eps amplify float32 noise; lr 1e-3 keeps that
    well inside the 1e-5 tolerance while the gradients themselves are compared directly.)"""
    cfg = load_config(
        None, ["train.prompts_per_step=2", "rollout.group_size=6", f"train.micro_batch_size={micro_size}"]
    )
    learner = _learner(model, cfg, lr=lr)
    micro = [collate_micro_batch(m, EOS2_ID, share_prefix) for m in split_micro_batches(samples, micro_size)]
    normalizer = loss_normalizer([m.batch.completion_mask for m in micro], "token")
    metrics = _means(accumulate_gradients(learner, MiniBatch(micro, normalizer, len(micro), [])).sums)
    grads = [p.grad.clone() for p in model.parameters()]
    learner.optimizer.optimizer.step()
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


@pytest.mark.parametrize("micro_size,kernel", [(12, "sdpa"), (5, "sdpa"), (4, "sdpa"), (5, "eager")])
def test_a_shared_prompt_prefix_gives_the_same_gradient_and_update(micro_size, kernel):
    """Each group's prompt scored once for its completions (a 4-D mask) against one row per
    completion: same gradients and AdamW step within 1e-5, also when micro-batches of 5 cut through
    groups of 4, with sdpa's boolean mask and eager's additive one; the forward computes far fewer
    token positions."""
    samples = _group_samples(groups=3, size=4)
    base = make_random_model(seed=3).train()
    base.set_attn_implementation(kernel)
    grads_a, params_a, metrics_a, _ = _grads_after(copy.deepcopy(base), samples, 12)
    grads_b, params_b, metrics_b, n = _grads_after(copy.deepcopy(base), samples, micro_size, share_prefix=True)
    assert n == -(-12 // micro_size)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert metrics_a["loss"] == pytest.approx(metrics_b["loss"], abs=1e-6)
    assert metrics_a["entropy"] == pytest.approx(metrics_b["entropy"], abs=1e-5)
    plain = collate_micro_batch(samples, EOS2_ID).batch
    shared = collate_micro_batch(samples, EOS2_ID, share_prefix=True).batch
    assert shared.input_ids.shape[0] == 3 and shared.forward_tokens < plain.forward_tokens


def test_rows_no_wider_than_the_budget_allows_and_no_saving_keeps_one_row_per_completion():
    samples = _group_samples(groups=2, size=4)
    whole = collate_micro_batch(samples, EOS2_ID, share_prefix=True).batch
    assert whole.shared_prefix and whole.input_ids.shape[1] > 12
    narrow = collate_micro_batch(samples, EOS2_ID, share_prefix=True, max_tokens=24).batch  # rows <= 12
    longest = max(s.prompt_ids.numel() + s.completion_ids.numel() for s in samples)
    assert narrow.shared_prefix and narrow.input_ids.shape[1] == max(12, longest)
    assert narrow.input_ids.shape[0] > whole.input_ids.shape[0]
    one_each = [samples[0], samples[4]]  # two prompts, one completion each: nothing to share
    assert not collate_micro_batch(one_each, EOS2_ID, share_prefix=True).batch.shared_prefix


def test_shared_prefix_follows_the_attention_kernel():
    """auto is on for kernels that take a 4-D mask and off for the others; asking for `on` with
    flash-attention is refused when the config loads."""
    from dapo_train.errors import ConfigError

    def fake(kernel):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=kernel))

    auto = load_config(None, [])
    assert use_shared_prefix(auto, fake("sdpa")) and use_shared_prefix(auto, fake("eager"))
    assert not use_shared_prefix(auto, fake("flash_attention_2"))
    assert not use_shared_prefix(load_config(None, ["train.shared_prefix=off"]), fake("sdpa"))
    with pytest.raises(ConfigError, match="train.shared_prefix"):
        load_config(None, ["train.shared_prefix=on", "model.attn_implementation=flash_attention_2"])


def test_shared_prefix_setting_changes_the_work_not_the_update():
    """train.shared_prefix=off vs on in a whole policy update: the same weights, fewer forward tokens."""
    groups = _groups(2, seed=1, size=6)
    results = {}
    for setting in ("off", "on"):
        model = make_random_model(seed=3).train()
        cfg = load_config(None, ["train.prompts_per_step=2", "rollout.group_size=6", "train.micro_batch_size=4",
                                 "train.updates_per_step=1", f"train.shared_prefix={setting}"])
        learner = _learner(model, cfg)
        assert learner.batching.share_prefix == (setting == "on")
        metrics = _train(learner, copy.deepcopy(groups), cfg)
        results[setting] = (metrics, [p.detach().clone() for p in model.parameters()])
    assert results["on"][0]["update_forward_tokens"] < 0.8 * results["off"][0]["update_forward_tokens"]
    for a, b in zip(results["off"][1], results["on"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_token_budget_bounds_padded_tokens_and_keeps_order():
    """Without a shared prefix the budget counts padded rows; it wins over the count (more on the budget
    in test_packing.py)."""
    samples = _samples(10, seed=5)
    budget = 40
    batches = split_micro_batches(samples, max_count=1, max_tokens=budget)
    assert [s for b in batches for s in b] == samples  # nothing lost or reordered
    assert max(len(batch) for batch in batches) > 1
    for batch in batches:
        widest_prompt = max(s.prompt_ids.numel() for s in batch)
        widest_completion = max(s.completion_ids.numel() for s in batch)
        assert len(batch) == 1 or (widest_prompt + widest_completion) * len(batch) <= budget


def test_normalizer_counts_the_whole_step_and_skips_filtered_samples():
    samples = _samples(4)
    samples[1].in_loss = False  # e.g. a truncated completion under overlong filtering
    expected_tokens = sum(s.completion_ids.numel() for i, s in enumerate(samples) if i != 1)
    masks = [collate_micro_batch(m, EOS2_ID).batch.completion_mask for m in split_micro_batches(samples, 3)]
    assert [m.shape[0] for m in masks] == [3, 1]  # counted over both micro-batches
    assert loss_normalizer(masks, "token") == expected_tokens
    assert loss_normalizer(masks, "sample") == 3


def test_nonfinite_gradient_skips_the_update():
    model = make_random_model(seed=4).train()
    before = [p.detach().clone() for p in model.parameters()]
    model.model.embed_tokens.weight.data[5, 0] = float("nan")  # poisons every forward using token 5
    cfg = load_config(None, ["train.prompts_per_step=1", "rollout.group_size=2", "train.micro_batch_size=2"])
    learner = _learner(model, cfg, lr=1e-2)

    # A minimal group: two completions of a prompt containing token 5.
    group = SimpleNamespace(
        completions=[Completion(torch.tensor([5, 6]), torch.tensor([7, EOS_ID]), False, "") for _ in range(2)],
        advantages=torch.tensor([1.0, -1.0]), version=0, old_logprobs=None,
    )
    metrics = _train(learner, [group], cfg)
    assert metrics["skipped_nonfinite"] == 1
    for a, b in zip(before[1:], list(model.parameters())[1:]):
        assert torch.equal(a, b)  # no parameter moved


# --------------------------------------------------------------------------------------------
# Several optimizer steps per rollout batch, and the old log-probs of the policy that sampled.


def _groups(n: int, seed: int = 0, size: int = 4) -> list[Group]:
    """n groups of `size` random completions (some truncated), advantages of both signs."""
    samples = _samples(n * size, seed)
    return [
        Group(
            prompt=Prompt(f"train:{i}", "q", "1", "p", tuple(samples[i * size].prompt_ids.tolist())),
            completions=[
                Completion(samples[i * size].prompt_ids, s.completion_ids, False, "")
                for s in samples[i * size : (i + 1) * size]
            ],
            rewards=torch.zeros(size), correct=torch.zeros(size, dtype=torch.bool),
            advantages=torch.tensor([s.advantage for s in samples[i * size : (i + 1) * size]]),
        )
        for i in range(n)
    ]


def _setup(model, *overrides: str, lr: float = 1e-3) -> tuple[Learner, Config]:
    cfg = load_config(None, ["train.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=3",
                             "train.updates_per_step=1", f"train.learning_rate={lr}", *overrides])
    return _learner(model, cfg, lr=lr), cfg


def test_k_mini_batches_are_k_sequential_optimizer_steps():
    """updates_per_step=2 over four groups == two manual updates of two groups each, with the old
    log-probs recorded once before either (the policy that generated all four)."""
    base = make_random_model(seed=5).train()
    other = copy.deepcopy(base)
    groups = _groups(4)
    learner, cfg = _setup(base, "train.updates_per_step=2")
    assert _record(learner, groups) == 16
    metrics = _train(learner, groups, cfg)
    assert metrics["optimizer_steps"] == 2 and learner.optimizer.steps == 2
    manual, manual_cfg = _setup(other)  # one update per call
    manual_groups = copy.deepcopy(groups)
    for part in (manual_groups[:2], manual_groups[2:]):
        _train(manual, part, manual_cfg)
    assert manual.optimizer.steps == 2
    for a, b in zip(base.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert metrics["staleness_max"] == 1  # the second mini-batch was generated one update ago


@pytest.mark.parametrize("first, last", [(2.0, 1.1), (1.1, 2.0), (1.1, 0.5)])
def test_the_clip_fractions_are_the_shares_of_tokens_the_clip_acted_on(first, last):
    """Old log-probs lowered by log(r) so that every token of a mini-batch starts its optimizer step at the
    ratio pi / pi_old = r (times the first optimizer step's small drift, for the second one). Eq. 10's clip acts on the
    A > 0 tokens where r > 1 + eps_high = 1.28 and on the A < 0 ones where r < 1 - eps_low = 0.8, on none at
    r = 1.1: the clip fractions are those shares of each mini-batch's tokens, counted here from the groups;
    the `_last` ones are the second mini-batch's, the plain ones both optimizer steps' token-weighted mean."""
    groups = _groups(4)
    learner, cfg = _setup(make_random_model(seed=5).train(), "train.updates_per_step=2", lr=1e-4)
    _record(learner, groups)
    before = [torch.cat(group.old_logprobs) for group in groups[2:]]
    for group, ratio in zip(groups, (first, first, last, last)):
        group.old_logprobs = [old - math.log(ratio) for old in group.old_logprobs]
    metrics = _train(learner, groups, cfg)

    def shares(part: list[Group], ratio: float) -> tuple[float, float, int]:
        """(tokens clipped high, tokens clipped low, tokens) of a mini-batch starting at `ratio`."""
        lengths = [(c.completion_ids.numel(), float(a)) for g in part for c, a in zip(g.completions, g.advantages)]
        positive, negative = (sum(n for n, a in lengths if sign * a > 0) for sign in (1, -1))
        return positive * (ratio > 1.28), negative * (ratio < 0.8), sum(n for n, _ in lengths)

    (high_1, low_1, tokens_1), (high_2, low_2, tokens_2) = shares(groups[:2], first), shares(groups[2:], last)
    assert 0 < shares(groups[2:], 2.0)[0] < tokens_2 and 0 < shares(groups[2:], 0.5)[1] < tokens_2  # both signs
    assert metrics["clip_frac_high_last"] == pytest.approx(high_2 / tokens_2, abs=1e-6)
    assert metrics["clip_frac_low_last"] == pytest.approx(low_2 / tokens_2, abs=1e-6)
    assert metrics["clip_frac_high"] == pytest.approx((high_1 + high_2) / (tokens_1 + tokens_2), abs=1e-6)
    assert metrics["clip_frac_low"] == pytest.approx((low_1 + low_2) / (tokens_1 + tokens_2), abs=1e-6)
    # The premise: the optimizer steps at lr 1e-4 move these log-probs far less than the margins used
    # (log(1.28 / 1.1) = 0.15, log(2 / 1.28) = 0.45, log(0.8 / 0.5) = 0.47), after both steps as after the first.
    moved = [dataclasses.replace(group, old_logprobs=None) for group in groups[2:]]
    _record(learner, moved)
    assert max((torch.cat(group.old_logprobs) - old).abs().max().item() for group, old in zip(moved, before)) < 0.05


def test_the_lr_schedule_counts_optimizer_steps(monkeypatch):
    """Warmup of 4 optimizer steps, 2 updates per step: after one step the LR is 2/4 of its peak."""
    from dapo_train.train.update import optim as optim

    model = make_random_model(seed=6).train()
    learner, cfg = _setup(model, "train.updates_per_step=2", "train.warmup_steps=4", "train.max_steps=3",
                          "train.lr_scheduler=cosine", lr=1e-2)
    assert total_optimizer_steps(cfg) == 6
    groups = _groups(4)
    _record(learner, groups)
    used = []
    monkeypatch.setattr(optim, "learning_rate", lambda cfg, step: used.append(learning_rate(cfg, step)) or used[-1])
    metrics = _train(learner, groups, cfg)
    assert used == pytest.approx([1e-2 * 1 / 4, 1e-2 * 2 / 4])
    param_lr = learner.optimizer.optimizer.param_groups[0]["lr"]
    assert metrics["lr"] == pytest.approx(5e-3) and param_lr == pytest.approx(5e-3)
    # After warmup the cosine runs over the remaining 6 - 4 = 2 optimizer steps: half-way at step 5.
    assert learning_rate(cfg, 5) == pytest.approx(1e-2 * 0.5)


def test_a_carried_groups_ratio_is_taken_against_the_policy_that_generated_it():
    """A group recorded under policy A and trained after the weights moved to B: the loss sees
    r = exp(logp_B - logp_A); its metrics (ratio_mean, approx_kl) are checked against a hand
    forward of both models."""
    model = make_random_model(seed=7).train()
    group = _groups(1, seed=3)
    learner, cfg = _setup(model)
    _record(learner, group)  # policy A
    old = torch.cat(group[0].old_logprobs)
    with torch.no_grad():  # an update happened in between: policy B
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    micro = learner.batching.micro_batches(flatten_groups(group, False))
    new = torch.cat([learner.scorer(model, m.batch)[0][m.batch.completion_mask.bool()] for m in micro]).detach()
    assert not torch.allclose(new, old)  # the weights really moved
    metrics = _train(learner, group, cfg)
    assert metrics["ratio_mean"] == pytest.approx(float(torch.exp(new - old).mean()), rel=1e-5)
    assert metrics["approx_kl"] == pytest.approx(float((old - new).mean()), rel=1e-4, abs=1e-7)


def test_the_on_policy_path_scores_nothing_extra(monkeypatch):
    """One update, one pass, no carried group: the ratio is exactly 1 with no old-log-prob pass,
    only the training forwards run; with two updates one extra no-grad pass scores every row."""
    calls = []
    real = batching.score_tokens

    def counting(model, batch, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(model, batch, **kwargs)

    monkeypatch.setattr(batching, "score_tokens", counting)
    groups = _groups(4)
    on_policy, cfg = _setup(make_random_model(seed=8).train())
    assert _record(on_policy, []) == 0
    metrics = _train(on_policy, groups, cfg)
    assert calls == [True] * 6 and metrics["ratio_mean"] == 1.0  # 16 rows in micro-batches of 3
    calls.clear()
    two, two_cfg = _setup(make_random_model(seed=8).train(), "train.updates_per_step=2")
    _record(two, groups)
    _train(two, groups, two_cfg)
    assert calls == [False] * 6 + [True] * 6  # one no-grad pass, then the same training forwards


def test_eps_high_moves_the_weights_once_the_clip_can_act():
    """With two updates per rollout batch the second one's ratio leaves 1 and eps_high changes the
    weights; with one on-policy update (the setting the trainer warns about) it cannot."""

    def weights_after(eps_high: float, updates: int) -> list[torch.Tensor]:
        model = make_random_model(seed=9).train()
        learner, cfg = _setup(model, f"dapo.eps_high={eps_high}", f"train.updates_per_step={updates}", lr=5e-2)
        groups = _groups(4, seed=4)
        _record(learner, groups if updates > 1 else [])
        metrics = _train(learner, groups, cfg)
        assert (metrics["ratio_mean"] == 1.0) == (updates == 1)
        return [p.detach().clone() for p in model.parameters()]

    low, high = weights_after(0.01, 2), weights_after(0.5, 2)
    assert any(not torch.equal(a, b) for a, b in zip(low, high))
    low, high = weights_after(0.01, 1), weights_after(0.5, 1)
    assert all(torch.equal(a, b) for a, b in zip(low, high))


def test_num_iterations_repeats_the_updates_over_the_same_batch():
    """dapo.num_iterations=2 with one update per pass: two optimizer steps on the same groups, the
    second against the old log-probs recorded before the first (so its ratio leaves 1), equal to
    two manual updates; one pass moves the weights less."""
    base, other, single = (make_random_model(seed=10).train() for _ in range(3))
    groups = _groups(2, seed=6)
    twice, twice_cfg = _setup(base, "dapo.num_iterations=2")
    _record(twice, groups)
    metrics = _train(twice, groups, twice_cfg)
    assert metrics["optimizer_steps"] == 2 and metrics["ratio_mean"] != 1.0
    (manual, manual_cfg), manual_groups = _setup(other), copy.deepcopy(groups)
    _record(manual, manual_groups)
    for _ in range(2):
        _train(manual, manual_groups, manual_cfg)
    once, once_cfg = _setup(single)
    _train(once, copy.deepcopy(groups), once_cfg)
    for a, b in zip(base.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(not torch.allclose(a, c) for a, c in zip(base.parameters(), single.parameters()))


def test_logprob_chunk_mib_sets_the_rows_per_chunk_of_the_head(monkeypatch):
    """train.logprob_chunk_mib reaches the LM-head kernel as rows per chunk (rows x V x 4 bytes <= the
    setting), and the log-probs do not depend on it."""
    from dapo_train.model import scoring as logprobs

    seen = []
    real = logprobs.LinearHeadLogprobs.apply
    monkeypatch.setattr(logprobs.LinearHeadLogprobs, "apply", lambda *a: seen.append(a[5]) or real(*a))
    samples = _samples(4)
    results = []
    for mib in (64 * 4 * 3 / 2**20, 64.0):  # 3 rows of V = 64 logits, or everything at once
        model = make_random_model(seed=3)
        cfg = load_config(None, ["train.prompts_per_step=1", "rollout.group_size=4", "train.micro_batch_size=4",
                                 f"train.logprob_chunk_mib={mib}"])
        learner = _learner(model, cfg)
        with torch.no_grad():
            results.append(learner.scorer(model, collate_micro_batch(samples, EOS2_ID).batch)[0])
    assert seen == [3, 64 * 2**20 // (4 * 64)]
    torch.testing.assert_close(results[0], results[1], atol=1e-6, rtol=0)


def test_dapo_policy_loss_chooses_an_objective_from_outside_the_package(monkeypatch):
    """dapo.policy_loss names the objective: REINFORCE from a test module (no ratio, no clip), by
    import path, trains the same groups to other weights than the default clip; an unknown name is
    one ConfigError naming the key and what is registered."""
    from dapo_train import algo
    from dapo_train.errors import ConfigError
    from dapo_train.train.update.objective import loss_settings

    plugin = "objective_plugin:reinforce"
    monkeypatch.delitem(algo.POLICY_LOSSES, plugin, raising=False)  # registered by this test only
    weights = {}
    for name in ("clip", plugin):
        model = make_random_model(seed=11).train()
        learner, cfg = _setup(model, f"dapo.policy_loss={name}", "train.updates_per_step=2", lr=5e-2)
        assert learner.loss.objective == name
        groups = _groups(4, seed=2)
        _record(learner, groups)
        metrics = _train(learner, groups, cfg)
        assert ("clip_frac_high" in metrics) == (name == "clip")  # each objective reports its own
        weights[name] = [p.detach().clone() for p in model.parameters()]
    assert any(not torch.allclose(a, b) for a, b in zip(weights["clip"], weights[plugin]))
    monkeypatch.delitem(algo.POLICY_LOSSES, plugin)
    with pytest.raises(ConfigError, match="dapo.policy_loss.*unknown objective 'nope'.*clip"):
        loss_settings(load_config(None, ["dapo.policy_loss=nope"]))
    with pytest.raises(ConfigError, match="dapo.policy_loss.*cannot import module 'no_such_module'"):
        loss_settings(load_config(None, ["dapo.policy_loss=no_such_module:fn"]))


# --------------------------------------------------------------------------------------------
# The behaviour policy: rollout correction, measured mismatch, old log-probs from the rollout.


def _behaviour_groups(learner: Learner, n: int = 4, seed: int = 0, spread: float = 1.2) -> list[Group]:
    """n groups whose completions carry behaviour log-probs: the training forward's (recorded, then
    dropped again) plus a per-token offset uniform in +-spread / 2, as from a sampler that is not the
    training forward."""
    groups = _groups(n, seed)
    _record(learner, groups)
    g = torch.Generator().manual_seed(seed + 100)
    for group in groups:
        for completion, old in zip(group.completions, group.old_logprobs):
            completion.behaviour_logprobs = old + spread * (torch.rand(old.shape, generator=g) - 0.5)
        group.old_logprobs = None
    return groups


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-mis"])
def test_a_rollout_correction_is_exact_over_micro_batches_and_counts_only_kept_tokens(mode):
    """Recorded old log-probs, behaviour log-probs that differ: micro-batches of 3 give the weights of one
    micro-batch of 16 (Eq. 12, the normaliser counted from the corrected masks), the update's token count
    is the tokens the correction keeps (by hand), and the correction changes the weights."""
    results = {}
    for name, micro in ((mode, 16), (mode, 3), ("off", 16)):
        model = make_random_model(seed=12).train()
        learner, cfg = _setup(model, f"dapo.rollout_correction={name}", f"train.micro_batch_size={micro}",
                              "train.updates_per_step=2", "dapo.rollout_correction_cap=1.4")
        groups = _behaviour_groups(learner)
        _record(learner, groups)
        metrics = _train(learner, groups, cfg)
        results[name, micro] = (metrics, [p.detach().clone() for p in model.parameters()], groups)
    for a, b in zip(results[mode, 16][1], results[mode, 3][1]):  # AdamW's first steps amplify rounding: 1e-5
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    kept = 0
    for group in results[mode, 16][2]:
        for completion, old in zip(group.completions, group.old_logprobs):
            _, masked, _ = RolloutCorrection(mode, 1.4)(old[None], completion.behaviour_logprobs[None],
                                                        torch.ones(1, old.numel(), dtype=torch.bool))
            kept += int((~masked).sum())
    assert results[mode, 16][0]["num_tokens"] == results[mode, 3][0]["num_tokens"] == kept
    assert (kept < results["off", 16][0]["num_tokens"]) == (mode != "tis")
    assert any(not torch.allclose(a, b) for a, b in zip(results[mode, 16][1], results["off", 16][1]))


def test_the_mismatch_is_measured_once_per_row_against_the_recorded_old_logprobs():
    """rollout_* over every token, once, though two passes train each row twice: the hand means of
    |old - behaviour|, exp(old - behaviour) and k3, and the largest |old - behaviour|."""
    model = make_random_model(seed=13).train()
    learner, cfg = _setup(model, "dapo.num_iterations=2", "train.updates_per_step=2")
    groups = _behaviour_groups(learner, spread=0.4)
    _record(learner, groups)
    metrics = _train(learner, groups, cfg)
    old = torch.cat([row for group in groups for row in group.old_logprobs])
    behaviour = torch.cat([c.behaviour_logprobs for group in groups for c in group.completions])
    diff = old - behaviour
    assert metrics["rollout_tokens"] == diff.numel() == metrics["num_tokens"]
    assert metrics["rollout_logprob_diff_mean"] == pytest.approx(float(diff.abs().mean()), rel=1e-5)
    assert metrics["rollout_logprob_diff_max"] == pytest.approx(float(diff.abs().max()), rel=1e-5)
    assert metrics["rollout_is_weight_mean"] == pytest.approx(float(diff.exp().mean()), rel=1e-5)
    assert metrics["rollout_kl"] == pytest.approx(float((diff.expm1() - diff).mean()), rel=1e-4)
    assert metrics["rollout_is_clipped_frac"] == pytest.approx(float((diff > math.log(2.0)).float().mean()))


def _rollout_learner(seed: int, updates: int) -> tuple[Learner, Config]:
    """A learner with dapo.old_logprobs=rollout resolved as for a rollout that is the training forward."""
    from dapo_train.train.update.old_policy import resolve

    learner, cfg = _setup(make_random_model(seed=seed).train(), "dapo.old_logprobs=rollout",
                          f"train.updates_per_step={updates}")
    return dataclasses.replace(learner, behaviour=resolve(cfg, ())), cfg


def _scored(learner: Learner, groups: list[Group]) -> torch.Tensor:
    """The training forward's log-probs of every valid token of `groups`, now."""
    micro = learner.batching.micro_batches(flatten_groups(groups, False))
    return torch.cat([learner.scorer(learner.model, m.batch)[0][m.batch.completion_mask.bool()]
                      for m in micro]).detach()


def test_old_logprobs_from_the_rollout_are_the_ratios_denominator_and_fresh_rows_are_measured():
    """dapo.old_logprobs=rollout: nothing is recorded; the ratio is taken against the behaviour
    log-probs (by hand: a forward at the same weights), and the mismatch is measured on the rows an
    update trains at the weights that sampled them: every row of one update, the first mini-batch's
    of two."""
    learner, cfg = _rollout_learner(seed=14, updates=1)
    assert learner.behaviour.old_from_rollout and learner.behaviour.correction.mode == "off"
    groups = _behaviour_groups(learner, spread=0.2)
    new, behaviour = _scored(learner, groups), torch.cat([c.behaviour_logprobs for g in groups for c in g.completions])
    metrics = _train(learner, groups, cfg)
    assert all(group.old_logprobs is None for group in groups)
    assert metrics["ratio_mean"] == pytest.approx(float((new - behaviour).exp().mean()), rel=1e-5)
    assert metrics["rollout_tokens"] == behaviour.numel()
    assert metrics["rollout_logprob_diff_mean"] == pytest.approx(float((new - behaviour).abs().mean()), rel=1e-5)

    learner, cfg = _rollout_learner(seed=14, updates=2)
    groups = _behaviour_groups(learner, spread=0.2)
    first = groups[:2]  # the first of two mini-batches over four groups
    new, behaviour = _scored(learner, first), torch.cat([c.behaviour_logprobs for g in first for c in g.completions])
    metrics = _train(learner, groups, cfg)
    assert metrics["rollout_tokens"] == behaviour.numel()
    assert metrics["rollout_logprob_diff_mean"] == pytest.approx(float((new - behaviour).abs().mean()), rel=1e-5)


def test_the_correction_cap_moves_the_weights():
    """dapo.rollout_correction_cap 1.1 vs 3: tis truncates other tokens, so the update differs."""
    weights = []
    for cap in (1.1, 3.0):
        model = make_random_model(seed=15).train()
        learner, cfg = _setup(model, "dapo.rollout_correction=tis", f"dapo.rollout_correction_cap={cap}")
        groups = _behaviour_groups(learner)
        _record(learner, groups)
        metrics = _train(learner, groups, cfg)
        weights.append(([p.detach().clone() for p in model.parameters()], metrics["rollout_is_clipped_frac"]))
    assert weights[0][1] > weights[1][1]  # e^0.6 < 3: cap 3 truncates nothing, cap 1.1 some
    assert any(not torch.allclose(a, b) for a, b in zip(weights[0][0], weights[1][0]))


def test_each_trained_completion_keeps_its_mean_ratio_and_clipped_share():
    """Two updates of two groups each, micro-batches of 3 rows (they straddle groups): the first
    mini-batch trains at the weights that recorded the old log-probs (ratio 1, nothing clipped), the
    second after the first moved them (eps_high 1e-3: the clip acts). Each completion's values,
    weighted by its valid tokens, average to the step's ratio_mean and clip_frac."""
    model = make_random_model(seed=12).train()
    groups = _groups(4, seed=8)
    learner, cfg = _setup(model, "train.updates_per_step=2", "dapo.eps_high=1e-3", "dapo.eps_low=1e-3")
    _record(learner, groups)
    metrics = _train(learner, groups, cfg)
    first = [value for group in groups[:2] for value in group.trained.ratio_mean]
    second = [value for group in groups[2:] for value in group.trained.ratio_mean]
    assert first == pytest.approx([1.0] * 8, abs=1e-5) and all(abs(value - 1) > 1e-5 for value in second)
    assert all(share == 0.0 for group in groups[:2] for share in group.trained.clip_frac)
    assert any(share > 0.0 for group in groups[2:] for share in group.trained.clip_frac)
    tokens = [c.length for group in groups for c in group.completions]
    for name, key in (("ratio_mean", "ratio_mean"), ("clip_frac", "clip_frac")):
        values = [value for group in groups for value in getattr(group.trained, name)]
        weighted = sum(v * n for v, n in zip(values, tokens)) / sum(tokens)
        assert weighted == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), name


def test_token_batches_count_their_padding_and_the_heads_positions():
    """Plain layout: prompts of 3 and 2 tokens left-padded to 3, completions of 3 and 1 right-padded to 3:
    2 rows x 6 = 12 positions, 9 tokens, 3 padding; the head scores the 4 completion tokens. Shared
    prefix: prompt A (3 tokens) with completions of 3 and 1, prompt B (2) with one of 2: rows of 7 and
    4 tokens at width 7, 14 positions, 3 padding; the head scores 6. Leaving the loss (in_loss False)
    takes a completion out of the loss mask, not out of what the head scores."""
    a, b = torch.tensor([3, 4, 5]), torch.tensor([6, 7])
    plain = collate_micro_batch([TrainSample(a, torch.tensor([8, 9, EOS_ID]), 1.0, True),
                                 TrainSample(b, torch.tensor([EOS_ID]), 1.0, False)], EOS2_ID).batch
    assert (plain.forward_tokens, plain.padding_tokens, plain.head_tokens) == (12, 3, 4)
    assert plain.completion_mask.sum() == 3
    samples = [TrainSample(a, torch.tensor([8, 9, EOS_ID]), 1.0, True),
               TrainSample(a, torch.tensor([EOS_ID]), 1.0, True), TrainSample(b, torch.tensor([10, EOS_ID]), 1.0, True)]
    shared = collate_micro_batch(samples, EOS2_ID, share_prefix=True).batch
    assert shared.shared_prefix
    assert (shared.forward_tokens, shared.padding_tokens, shared.head_tokens) == (14, 3, 6)


def test_the_demo_reports_the_updates_work_and_its_head_scores_exactly_the_trained_tokens(tmp_path, monkeypatch):
    """Two steps of the demo's settings: every row the LM head received in the run (counted at the head
    itself) is one of update_head_tokens, which equals update_trained_tokens (the loss mask's ones, no
    overlong filtering: every valid token trains), but the out-of-memory guard's one probe at step 1 (its
    largest micro-batch: train.micro_batch_size 16 completions of rollout.max_new_tokens 96, 1,536 head rows);
    the forward computed update_forward_tokens positions, of which update_padding_tokens padding, and the
    per-token ratios are their quotients."""
    from dapo_train.model import scoring
    from dapo_train.run.logs import read_metrics
    from dapo_train.train.loop import train

    rows_scored = []
    apply = scoring.LinearHeadLogprobs.apply
    monkeypatch.setattr(scoring.LinearHeadLogprobs, "apply",
                        lambda hidden, *rest: rows_scored.append(hidden.shape[0]) or apply(hidden, *rest))
    cfg = load_config(None, [f"output_dir={tmp_path / 'demo'}", "train.max_steps=2", "eval.every_steps=0",
                             "eval.final_full=false", "logging.progress_bar=false", "eval.print_samples=0"])
    rows = [row for row in read_metrics(train(cfg)) if row.get("step", 0) > 0]
    assert len(rows) == 2 and all(row["optimizer_steps"] == 8 for row in rows)
    assert sum(rows_scored) == sum(row["update_head_tokens"] for row in rows) + 16 * 96
    assert [row["update_probes"] for row in rows] == [1, 0]
    for row in rows:
        assert row["update_head_tokens"] == row["update_trained_tokens"] == row["num_tokens"]
        assert 0 <= row["update_padding_tokens"] < row["update_forward_tokens"]
        assert row["update_forward_per_token"] == pytest.approx(row["update_forward_tokens"] / row["num_tokens"])
        assert row["update_head_per_token"] == pytest.approx(1.0)


def test_a_step_fp16s_scaler_skips_is_counted_apart_and_the_next_mini_batch_trains(monkeypatch):
    """Two mini-batches under fp16's loss scaler: the first one's loss, times 1e12 and scaled by 2^100,
    overflows in backward (its own value stays finite), so the scaler skips that optimizer step and
    drops its scale to 2^10; the second mini-batch trains. The step is not a non-finite one, one
    optimizer step applied, and only the second mini-batch's groups were trained by it."""
    real, calls = objectives.policy_loss, []

    def overflowing_first(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        return (loss * 1e12 if len(calls) == 1 else loss), metrics

    monkeypatch.setattr(objectives, "policy_loss", overflowing_first)
    model = make_random_model(seed=5).train()
    groups = _groups(4)
    cfg = load_config(None, ["train.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_size=16",
                             "train.updates_per_step=2", "train.warmup_steps=0"])
    accelerator = fp16_on_cpu(init_scale=2.0**100, backoff_factor=2.0**-90)
    optimizer = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    learner = Learner.build(cfg, model, optimizer, accelerator, EOS2_ID)
    _record(learner, groups)
    metrics = _train(learner, groups, cfg)
    assert (metrics["scaler_skips"], metrics["optimizer_steps"], metrics["skipped_nonfinite"]) == (1, 1, 0)
    assert learner.optimizer.steps == 1 and accelerator.scaler.get_scale() == 2.0**10 and len(calls) == 2
    assert [group.trained.applied for group in groups] == [False, False, True, True]
    assert all(value is None for group in groups[:2] for value in group.trained.ratio_mean)
    assert all(value is not None for group in groups[2:] for value in group.trained.ratio_mean)
