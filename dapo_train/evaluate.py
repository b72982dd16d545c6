"""Evaluation of a loaded model on a list of prompts: accuracy with its uncertainty, pass@k, maj@k.

The trainer's periodic eval, `dapo-train eval` and the tiny model's build all call
`evaluate_prompts`, so the numbers a run logs and the numbers a later `eval` prints come from the
same prompt builder (data.py), the same batched, left-padded generation (rollout.py) and the same
answer check (the task's data.correctness; numeric by default).
- Greedy decoding over a fixed item list by default, so two evals of the same weights on the same
  items give the same numbers.
- Completions are cut at the first EOS token (rollout.completion_mask).
- Every accuracy comes with its standard error and a 95% interval, so a 2-point difference on
  100 items is visibly inside the noise.
With `samples = K > 1`, K completions per item are sampled at the given temperature and the
report adds pass@1, pass@K (the unbiased estimator of Chen et al. 2021) and maj@K.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dapo_train.answers import ANSWER_CHECKS, AnswerCheck
from dapo_train.config import Config
from dapo_train.data import Prompt
from dapo_train.rewards import REWARDS
from dapo_train.rollout import Completion, SamplingSettings, sample_completions

NUMERIC = ANSWER_CHECKS["numeric"]
Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


@dataclass
class EvalResult:
    """metrics: stable keys (see summarize_records); records: one dict per completion, in
    item order and, within an item, sample order (keys: uid, question, gold, completion,
    extracted, correct, format_ok, length, truncated, and sample when K > 1)."""

    metrics: dict[str, float] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Pure statistics: numbers in, numbers out.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item from n samples of which c are correct (Chen et al. 2021, Eq. 1):
    1 - C(n - c, k) / C(n, k), the chance that k of the n samples drawn without replacement hold
    at least one correct one. Exact integer binomials, so no overflow or cancellation."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent extracted answer (None = no answer, never a vote); None if no votes.

    Tie rule: among answers with the top count, the one whose first vote came earliest in sample
    order wins. This depends only on the samples, never on the gold answer, so a tie is not
    resolved in the model's favour. Numeric answers are canonical strings (answers.canonical), so
    "72" and "72.0" are the same vote.
    """
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return None
    top = max(counts.values())
    return next(answer for answer in counts if counts[answer] == top)  # dicts keep first-seen order


def mean_stderr(scores: Sequence[float]) -> tuple[float, float]:
    """Mean of per-item scores and its standard error sqrt(var / N) (population variance): for
    0/1 scores this is the binomial sqrt(p (1 - p) / N)."""
    n = len(scores)
    mean = sum(scores) / n
    variance = sum((s - mean) ** 2 for s in scores) / n
    return mean, math.sqrt(variance / n)


def wilson_interval(p: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a proportion p over n items.

    Chosen over mean +- 1.96 stderr because that interval collapses to a point at p = 0 or 1 and
    leaves [0, 1] on small n. With K samples per item, p is the mean per-item score and n the
    number of items: conservative, since a per-item mean varies less than a single 0/1 draw.
    """
    denominator = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


def summarize_records(records: Sequence[dict], samples: int) -> dict[str, float]:
    """Metrics of N items x K samples from their records (K consecutive records per item).

    accuracy = mean over items of the fraction of correct samples (= pass@1; greedy accuracy
    when K = 1), with accuracy_stderr and the Wilson 95% interval; format_rate, lengths (tokens,
    EOS included) and truncated_rate are over all completions. K > 1 adds pass@1, pass@K, maj@K.
    """
    if not records or len(records) % samples:
        raise ValueError(f"need N x {samples} records (K per item), got {len(records)}")
    items = [records[i : i + samples] for i in range(0, len(records), samples)]
    correct_counts = [sum(r["correct"] for r in item) for item in items]
    scores = [c / samples for c in correct_counts]
    accuracy, stderr = mean_stderr(scores)
    low, high = wilson_interval(accuracy, len(items))
    lengths = [r["length"] for r in records]
    metrics = {
        "accuracy": accuracy,
        "accuracy_stderr": stderr,
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "format_rate": sum(r["format_ok"] for r in records) / len(records),
        "completion_length_mean": sum(lengths) / len(lengths),
        "completion_length_max": max(lengths),
        "truncated_rate": sum(r["truncated"] for r in records) / len(records),
        "num_items": len(items),
        "samples": samples,
    }
    if samples > 1:
        metrics["pass@1"] = accuracy  # pass@1 = c / K averaged over items
        metrics[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in correct_counts) / len(items)
        metrics[f"maj@{samples}"] = sum(_majority_correct(item) for item in items) / len(items)
    return metrics


def _majority_correct(item: Sequence[dict]) -> bool:
    """The majority vote is graded as the samples that gave that answer were."""
    vote = majority_answer([r["extracted"] for r in item])
    return vote is not None and next(r["correct"] for r in item if r["extracted"] == vote)


# --------------------------------------------------------------------------------------------
# Generation and scoring.


def eval_max_new_tokens(cfg: Config) -> int:
    """eval.max_new_tokens, or the rollout budget when it is 0."""
    return cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens


def completion_records(
    prompts: Sequence[Prompt], completions: Sequence[Completion], samples: int, check: AnswerCheck = NUMERIC
) -> list[dict]:
    """One record per completion: the task's answer and correct bit (check, data.correctness) and
    the hard format check of the `hard_format` reward (format_ok)."""
    texts = [c.text for c in completions]
    golds = [prompts[i // samples].gold for i in range(len(completions))]
    format_scores = REWARDS["hard_format"].fn(texts, golds)
    records = []
    for index, (completion, gold, format_score) in enumerate(zip(completions, golds, format_scores)):
        prompt = prompts[index // samples]
        record = {
            "uid": prompt.uid,
            "question": prompt.question,
            "gold": gold,
            "completion": completion.text,
            "extracted": check.extract(completion.text),
            "correct": bool(check.is_correct(completion.text, gold)),
            "format_ok": format_score > 0,
            "length": completion.length,
            "truncated": completion.truncated,
        }
        if samples > 1:
            record["sample"] = index % samples
        records.append(record)
    return records


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed sampling without disturbing the caller's RNG streams (the trainer's stay intact)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        yield


def evaluate_prompts(model, tokenizer, prompts: list[Prompt], *, samples: int = 1, **options) -> EvalResult:
    """Evaluate an already-loaded model on `prompts`, in their order: eval_records (same options),
    summarised."""
    records = eval_records(model, tokenizer, prompts, samples=samples, **options)
    return EvalResult(metrics=summarize_records(records, samples), records=records)


def eval_records(
    model,
    tokenizer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    batch_size: int,
    samples: int = 1,
    temperature: float = 1.0,
    seed: int | None = None,
    check: AnswerCheck = NUMERIC,
) -> list[dict]:
    """The completion records (completion_records) of an already-loaded model on `prompts`, in their
    order; the trainer's ranks each make their share's and summarise the gathered whole once.

    samples == 1: greedy decoding (temperature ignored), deterministic for a fixed item list and
    batch size. samples == K > 1: K samples per item at `temperature` (top_p = 1, top_k = 0),
    reproducible when `seed` is given (the caller's RNG state is restored afterwards).
    batch_size counts sequences per generate call (prompts x samples). The model is switched to
    eval mode during generation and back to its previous mode afterwards.
    """
    if not prompts:
        raise ValueError("evaluate_prompts needs at least one prompt")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"sampling needs temperature > 0, got {temperature}")
    settings = SamplingSettings(max_new_tokens=max_new_tokens, do_sample=samples > 1, temperature=temperature)
    prompt_ids = [prompt.input_ids for prompt in prompts]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with _seeded(seed if samples > 1 else None, device):
            completions = sample_completions(  # N*K rows, K per item
                model, tokenizer, prompt_ids, settings, batch_size=batch_size, group_size=samples
            )
    finally:
        model.train(was_training)
    return completion_records(prompts, completions, samples, check)
