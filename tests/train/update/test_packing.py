"""Packed shared-prefix rows and micro-batches formed by a token budget (train.micro_batch_tokens):
the same loss, gradients, old log-probs and entropy as one row per completion cut by count, with
nearly no padding. Expected values come from the plain layout (one left-padded row per completion),
which test_scoring checks against full logits."""

import copy
import logging

import pytest
import torch
from accelerate import Accelerator

from dapo_train.algo import loss_normalizer
from dapo_train.config.load import load_config
from dapo_train.model.layout import row_limit
from dapo_train.rollout import Completion
from dapo_train.task.prompts import Prompt
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.update import batching as batching
from dapo_train.train.update.batching import Batching, MiniBatch, TrainSample, micro_batch_tokens, split_micro_batches
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.passes import Learner, _means, accumulate_gradients, update

from conftest import EOS2_ID, EOS_ID, make_random_model


def _mixed(seed: int = 0) -> list[TrainSample]:
    """Groups of 1 to 6 completions, prompts of 2 to 14 tokens, completions of 0 to 12 tokens and one
    of 40 (longer than the budgets below); some truncated, one out of the loss."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group, size in enumerate([4, 1, 6, 3, 5, 2]):
        prompt = torch.randint(3, 60, (int(torch.randint(2, 15, (1,), generator=g)),), generator=g)
        for j in range(size):
            length = 40 if (group, j) == (2, 1) else 0 if (group, j) == (3, 0) else int(torch.randint(1, 13, (1,),
                                                                                                       generator=g))
            body = torch.randint(3, 60, (length,), generator=g)
            completion = torch.cat([body, torch.tensor([EOS_ID])]) if j % 2 and length else body
            out.append(TrainSample(prompt, completion, float(torch.randn(1, generator=g)), in_loss=(group, j) != (4, 2),
                                   old_logprobs=-torch.rand(completion.numel(), generator=g)))
    return out


def _run(model, micro_batches) -> tuple[list, dict, list]:
    """One mini-batch's gradients, metrics, and the per-sample log-probs scored without gradient."""
    cfg = load_config(None, ["train.prompts_per_step=6", "rollout.group_size=6"])
    learner = Learner.build(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3), Accelerator(cpu=True), EOS2_ID)
    normalizer = loss_normalizer([m.batch.completion_mask for m in micro_batches], "token")
    metrics = _means(accumulate_gradients(learner, MiniBatch(micro_batches, normalizer, len(micro_batches), [])).sums)
    scored = []
    with torch.no_grad():
        for micro in micro_batches:
            logprobs, entropy = learner.scorer(model, micro.batch)
            lengths = micro.batch.valid_mask.sum(dim=1)
            scored += [(lp[:n], en[:n]) for lp, en, n in zip(logprobs, entropy, lengths)]
    return [p.grad.clone() for p in model.parameters()], metrics, scored


@pytest.mark.parametrize("kernel,budget", [("sdpa", 48), ("sdpa", 120), ("eager", 64)])
def test_packed_budgeted_micro_batches_match_one_row_per_completion(kernel, budget):
    samples = _mixed()
    base = make_random_model(seed=3).train()
    base.set_attn_implementation(kernel)
    plain = Batching(EOS2_ID, torch.device("cpu"), share_prefix=False, max_count=len(samples))
    packed = Batching(EOS2_ID, torch.device("cpu"), share_prefix=True, max_count=1, max_tokens=budget)
    reference = plain.micro_batches(samples)
    micro = packed.micro_batches(samples)
    assert len(reference) == 1 and len(micro) > 2
    # where sharing saves work, runs of one prompt share rows (else collate keeps one row per sample)
    packed_rows = any(m.batch.shared_prefix and m.batch.input_ids.shape[0] < _runs(m) for m in micro)
    assert packed_rows == (budget >= 64)  # rows of at most budget / 2 tokens: at 48 a row holds one group at most
    parts = split_micro_batches(samples, 1, budget, share_prefix=True)
    assert [len(part) for part in parts] == [m.batch.completion_ids.shape[0] for m in micro]
    cut_runs = any(_runs(m) > len({id(s.prompt_ids) for s in part}) for m, part in zip(micro, parts))
    assert cut_runs  # a group cut between two rows (layout.row_limit), its prompt in both
    grads_a, metrics_a, scored_a = _run(copy.deepcopy(base), reference)
    grads_b, metrics_b, scored_b = _run(copy.deepcopy(base), micro)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for key in ("loss", "entropy", "num_tokens"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=1e-5), key
    assert len(scored_a) == len(scored_b) == len(samples)
    for (lp_a, en_a), (lp_b, en_b), sample in zip(scored_a, scored_b, samples):
        assert lp_a.numel() == lp_b.numel() == sample.completion_ids.numel()
        torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=0)
        torch.testing.assert_close(en_a, en_b, atol=1e-5, rtol=0)


def _runs(micro) -> int:
    """Runs of one prompt in a micro-batch: distinct (row, prompt-end) pairs."""
    return len({(int(r), int(p[0])) for r, p in zip(micro.batch.rows, micro.batch.positions)})


def test_budget_forms_few_balanced_micro_batches_in_order():
    """Counted as the forward computes them (each run's prompt once, or padded rows), in order, the
    fewest micro-batches within the budget, and their tokens close to each other."""
    samples = _mixed(seed=1)
    for share_prefix in (True, False):
        budget, rows = 70, row_limit(70)
        parts = split_micro_batches(samples, 1, budget, share_prefix)
        assert [s for part in parts for s in part] == samples
        tokens = [micro_batch_tokens(part, share_prefix, rows) for part in parts]
        assert all(t <= budget or len(p) == 1 for t, p in zip(tokens, parts))
        greedy: list[list] = []  # the fewest consecutive parts: a plain greedy count, as an independent check
        for sample in samples:
            if greedy and micro_batch_tokens([*greedy[-1], sample], share_prefix, rows) <= budget:
                greedy[-1].append(sample)
            else:
                greedy.append([sample])
        assert len(parts) == len(greedy)
        assert max(tokens) <= max(micro_batch_tokens(part, share_prefix, rows) for part in greedy)
    g = torch.Generator().manual_seed(2)
    prompt = torch.arange(3, 11)
    even = [TrainSample(prompt, torch.randint(3, 60, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g),
                        1.0, True) for _ in range(32)]
    tokens = [micro_batch_tokens(part, True, row_limit(200)) for part in split_micro_batches(even, 1, 200, True)]
    assert max(tokens) - min(tokens) <= 40 and max(tokens) <= 200


def test_the_shared_layout_counts_each_prompt_once():
    prompt_a, prompt_b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    samples = [TrainSample(prompt_a, torch.tensor([6, 7]), 0.0, True),
               TrainSample(prompt_a, torch.tensor([8]), 0.0, True),
               TrainSample(prompt_b, torch.tensor([9, 9, 9]), 0.0, True)]
    assert micro_batch_tokens(samples, True) == 3 + 2 + 1 + 2 + 3
    assert micro_batch_tokens(samples, False) == 3 * (3 + 3)


def test_a_sequence_over_the_budget_gets_its_own_micro_batch_and_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(batching, "_warned_over_budget", [])
    samples = _mixed()
    with caplog.at_level(logging.WARNING):
        parts = split_micro_batches(samples, 1, 30, True)
        split_micro_batches(samples, 1, 30, True)
    long = next(i for i, part in enumerate(parts) if any(s.completion_ids.numel() > 30 for s in part))
    assert len(parts[long]) == 1
    assert sum("micro_batch_tokens=30" in r.message for r in caplog.records) == 1


def test_demo_like_batch_computes_under_5_percent_padding():
    """16 groups of 8 completions of 10-120 tokens after prompts of 30-60, the budget about two groups
    (rows filled up to half of it, layout.row_limit)."""
    g = torch.Generator().manual_seed(4)
    samples = []
    for _ in range(16):
        prompt = torch.randint(3, 60, (int(torch.randint(30, 61, (1,), generator=g)),), generator=g)
        samples += [TrainSample(prompt, torch.randint(3, 60, (int(torch.randint(10, 121, (1,), generator=g)),),
                                                      generator=g), 1.0, True) for _ in range(8)]
    budgeted = Batching(EOS2_ID, torch.device("cpu"), share_prefix=True, max_count=1, max_tokens=1200)
    micro = budgeted.micro_batches(samples)
    forward = sum(m.batch.forward_tokens for m in micro)
    padding = sum(m.batch.padding_tokens for m in micro)
    assert padding <= 0.05 * forward
    assert sum(m.batch.head_tokens for m in micro) == sum(s.completion_ids.numel() for s in samples)
    # the budget counts the rows as the forward computes them, padding and repeated prompts included
    assert max(m.batch.forward_tokens for m in micro) <= 1200


def _groups(sizes: list[int], seed: int = 0) -> list[Group]:
    samples, groups = _mixed(seed), []
    runs: dict[int, list[TrainSample]] = {}
    for sample in samples:
        runs.setdefault(id(sample.prompt_ids), []).append(sample)
    for run, size in zip(runs.values(), sizes):
        run = run[:size]
        groups.append(Group(
            prompt=Prompt(f"train:{len(groups)}", "q", "1", "p", tuple(run[0].prompt_ids.tolist())),
            completions=[Completion(s.prompt_ids, s.completion_ids, False, "") for s in run],
            rewards=torch.zeros(len(run)), correct=torch.zeros(len(run), dtype=torch.bool),
            advantages=torch.tensor([s.advantage for s in run]),
        ))
    return groups


def test_micro_batch_tokens_changes_the_micro_batches_not_the_update_or_the_old_logprobs():
    """A whole update (two mini-batches) and the old-log-prob pass, by count vs by a token budget."""
    groups = _groups([4, 1, 6, 3, 5, 2])
    results = {}
    for budget in (0, 40):
        model = make_random_model(seed=3).train()
        cfg = load_config(None, ["train.prompts_per_step=6", "rollout.group_size=6", "train.micro_batch_size=36",
                                 "train.updates_per_step=2", f"train.micro_batch_tokens={budget}"])
        learner = Learner.build(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3), Accelerator(cpu=True),
                                EOS2_ID)
        trained = copy.deepcopy(groups)
        record_old_logprobs(learner.model, trained, learner.batching, learner.scorer)
        metrics = update(learner, StepBatch(trained, [len(trained)], {}), cfg)
        results[budget] = (metrics, [p.detach().clone() for p in model.parameters()], trained)
    (by_count, weights_a, groups_a), (by_tokens, weights_b, groups_b) = results[0], results[40]
    assert by_count["micro_batches"] == 2 and by_tokens["micro_batches"] > 4
    assert by_count["num_tokens"] == by_tokens["num_tokens"]
    for a, b in zip(weights_a, weights_b):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for group_a, group_b in zip(groups_a, groups_b):
        for a, b in zip(group_a.old_logprobs, group_b.old_logprobs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
