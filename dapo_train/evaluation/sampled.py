"""The sampled eval beside a run's greedy one (eval.samples): K completions per item drawn as the rollout draws
them, scored per item and paired with step 0's.

Reinforcement learning on a strong start sharpens sampling before it moves greedy decoding, so a run that reads
only its greedy accuracy cannot tell that it is working (docs/training.md: Sampled accuracy). Per item, from its K
records: pass@1 = the share of the K graded correct (strict, as the reward grades; answer pass@1 the same of the
answer accuracy), maj@K = 1 if the majority answer is right (stats.majority_answer's tie rule), pass@K = 1 if
any of the K is (Chen et al.'s estimator at n = k). Every score is a number per item, so a later eval is paired
with step 0's item by item, with the paired bootstrap of the greedy change (stats.bootstrap_difference, one seed
a side): pass@1 rising while pass@K stays is sharpening; pass@K falling is a model that has stopped reaching
answers it reached.

The keys are stable whatever K, and every tracker takes them (no `@`, which MLflow refuses): SCORES, pass_at_1
for pass@1 and maj_at_k for maj@K (`samples` holds K; the lines say maj@8), each with `_change`, `_change_low`,
`_change_high` after step 0; and change_items, num_items, samples, completion_length_mean, truncated_rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dapo_train.config.schema import Config
from dapo_train.evaluation.stats import PairedDifference, bootstrap_difference, majority_correct

SCORES = ("pass_at_1", "answer_pass_at_1", "maj_at_k", "pass_at_k")
SHOWN = ("pass_at_1", "maj_at_k", "pass_at_k")  # what the progress lines and the summary say


def item_scores(records: Sequence[dict], samples: int) -> dict[tuple[str, str], dict[str, float]]:
    """(uid, gold) -> SCORES of that item, from N x K records (K consecutive per item, as eval_records
    writes them)."""
    if not records or len(records) % samples:
        raise ValueError(f"need N x {samples} records (K per item), got {len(records)}")
    scores = {}
    for start in range(0, len(records), samples):
        item = records[start : start + samples]
        scores[item[0]["uid"], item[0]["gold"]] = {
            "pass_at_1": sum(r["correct"] for r in item) / samples,
            "answer_pass_at_1": sum(r["answer_correct"] for r in item) / samples,
            "maj_at_k": float(majority_correct(item)),
            "pass_at_k": float(any(r["correct"] for r in item)),
        }
    return scores


def samples_per_item(records: Sequence[dict]) -> int:
    """K of records eval_records wrote (each holds its `sample` index when K > 1)."""
    return 1 + max(int(r.get("sample", 0)) for r in records)


def sampled_change(start: Sequence[dict], records: Sequence[dict], samples: int) -> dict[str, PairedDifference]:
    """Each of SCORES, records - start, paired on the items both hold (the same uid and gold); {} when they share
    no item or step 0 drew another K (a resume that changed eval.samples: maj@K and pass@K mean something else)."""
    if samples_per_item(start) != samples:
        return {}
    before, after = item_scores(start, samples), item_scores(records, samples)
    shared = [key for key in after if key in before]
    if not shared:
        return {}
    return {name: bootstrap_difference(np.array([[before[key][name] for key in shared]]),  # (1 seed, N items)
                                       np.array([[after[key][name] for key in shared]]), seeds_paired=True)
            for name in SCORES}


def sampled_metrics(records: Sequence[dict], samples: int, start: Sequence[dict] | None = None) -> dict[str, float]:
    """The sampled eval's metrics (the module docstring's keys, without the eval's prefix); with step 0's
    `start` records, each score's change from them and its 95% interval."""
    scores = item_scores(records, samples)
    metrics: dict[str, float] = {name: sum(s[name] for s in scores.values()) / len(scores) for name in SCORES}
    metrics.update(samples=samples, num_items=len(scores),
                   completion_length_mean=sum(r["length"] for r in records) / len(records),
                   truncated_rate=sum(r["truncated"] for r in records) / len(records))
    changes = sampled_change(start, records, samples) if start else {}
    for name, diff in changes.items():
        metrics.update({f"{name}_change": diff.difference, f"{name}_change_low": diff.low,
                        f"{name}_change_high": diff.high})
    if changes:
        metrics["change_items"] = changes["pass_at_1"].items
    return metrics


def score_label(name: str, samples: int) -> str:
    """'maj_at_k' -> 'maj@8' for K = 8, 'pass_at_1' -> 'pass@1'."""
    return name.replace("_at_", "@").replace("@k", f"@{samples}")


def sampled_text(metrics: dict, prefix: str) -> str:
    """'sampled x8: pass@1 0.613 +0.010 [-0.020, +0.040], maj@8 0.655 ..., pass@8 0.810 ... over step 0' from an
    eval's metrics (keys under `prefix`); '' without a sampled eval."""
    if f"{prefix}samples" not in metrics:
        return ""
    samples = int(metrics[f"{prefix}samples"])
    parts = []
    for name in SHOWN:
        part = f"{score_label(name, samples)} {metrics[f'{prefix}{name}']:.3f}"
        if f"{prefix}{name}_change" in metrics:
            part += " " + change_text(metrics, f"{prefix}{name}")
        parts.append(part)
    over = " over step 0" if f"{prefix}change_items" in metrics else ""
    return f"sampled x{samples}: {', '.join(parts)}{over}"


def change_text(metrics: dict, key: str) -> str:
    """'+0.010 [-0.020, +0.040]': metrics[key + '_change'] and its interval."""
    change, low, high = (metrics[f"{key}_change{end}"] for end in ("", "_low", "_high"))
    return f"{change:+.3f} [{low:+.3f}, {high:+.3f}]"


def sampled_note(cfg: Config) -> str | None:
    """Why eval.samples cannot act as configured (said at start), or None."""
    if cfg.eval.samples and cfg.eval.every_steps == 0:
        return "eval.samples cannot act: eval.every_steps=0, no periodic eval to add the sampled one to"
    return None
