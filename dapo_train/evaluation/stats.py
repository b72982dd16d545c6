"""The statistics of evaluations, numbers in and numbers out: one eval's accuracy with its uncertainty,
pass@k and maj@k, and the paired statistics that compare two settings evaluated on the same items.

One eval: every accuracy comes with its standard error and a 95% Wilson interval, so a 2-point
difference on 100 items is visibly inside the noise; with K samples per item, pass@K is the unbiased
estimator of Chen et al. 2021 and maj@K the majority answer's accuracy.

Two settings: the points of a study are evaluated greedily on the same eval items, and, where they
have several seeds, usually with the same seeds. Comparing them item by item (and seed by seed)
removes the item-to-item variation both share, which is most of the noise of an accuracy on a few
hundred items: the interval of a paired difference is much narrower than two unpaired intervals
suggest.
- `bootstrap_difference`: the accuracy difference other - baseline with a 95% percentile interval
  from a paired bootstrap. Each replicate draws the N items with replacement (one draw shared by
  both points, so an item's pair stays together) and, independently, the seeds with replacement:
  with the same seeds on both sides one draw of seed indices serves both (seeds paired); otherwise
  each point's seeds are drawn on their own. This two-way resampling of a seeds x items table is
  the "pigeonhole" bootstrap (Owen 2007, Ann. Appl. Stat. 1(2)); its variance is
  var_seeds / S + var_items / N + var_residual / (S N), a little conservative.
- `mcnemar`: for two single runs, McNemar's test on the discordant items: exact two-sided binomial
  p-value when they are few, the continuity-corrected chi-square otherwise.
- `t_interval`: a per-run outcome (entropy) paired seed by seed: mean difference and Student's t
  95% interval over the seed pairs.
- `change_from_start`: a run's eval against its own step-0 eval on the items both cover, strict and
  answer accuracy, by the same paired bootstrap (one seed a side): what a run has done to its model; and
  beside each, `sign_test` on the items the two evals grade differently (lost, gained): the exact one-sided
  p-value of "no worse than step 0" that a run's regression stop reads (train/regression.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


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
    when K = 1), with accuracy_stderr and the Wilson 95% interval; answer_accuracy the same of
    answer_correct (the gold number wherever a reader takes the answer to be) and format_gap =
    answer_accuracy - accuracy (what the answer's format costs); format_rate, lengths (tokens,
    EOS included) and truncated_rate are over all completions. K > 1 adds pass@1, pass@K, maj@K.
    Records a reward model scored (generate.add_model_scores) add rewards/<key>/mean.
    """
    if not records or len(records) % samples:
        raise ValueError(f"need N x {samples} records (K per item), got {len(records)}")
    items = [records[i : i + samples] for i in range(0, len(records), samples)]
    correct_counts = [sum(r["correct"] for r in item) for item in items]
    scores = [c / samples for c in correct_counts]
    accuracy, stderr = mean_stderr(scores)
    low, high = wilson_interval(accuracy, len(items))
    answer_accuracy = sum(r["answer_correct"] for r in records) / len(records)  # K per item: the mean of item means
    lengths = [r["length"] for r in records]
    metrics = {
        "accuracy": accuracy,
        "accuracy_stderr": stderr,
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "answer_accuracy": answer_accuracy,
        "format_gap": answer_accuracy - accuracy,
        "format_rate": sum(r["format_ok"] for r in records) / len(records),
        "completion_length_mean": sum(lengths) / len(lengths),
        "completion_length_max": max(lengths),
        "truncated_rate": sum(r["truncated"] for r in records) / len(records),
        "num_items": len(items),
        "samples": samples,
    }
    for key in records[0].get("scores", {}):  # the reward models' view of the same completions
        metrics[f"rewards/{key}/mean"] = sum(r["scores"][key] for r in records) / len(records)
    if samples > 1:
        metrics["pass@1"] = accuracy  # pass@1 = c / K averaged over items
        metrics[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in correct_counts) / len(items)
        metrics[f"maj@{samples}"] = sum(majority_correct(item) for item in items) / len(items)
    return metrics


def majority_correct(item: Sequence[dict]) -> bool:
    """The majority vote is graded as the samples that gave that answer were."""
    vote = majority_answer([r["extracted"] for r in item])
    return vote is not None and next(r["correct"] for r in item if r["extracted"] == vote)

# --------------------------------------------------------------------------------------------
# Paired statistics: two settings, or two evals, on the same items.

REPLICATES = 10_000
BOOTSTRAP_SEED = 0  # a fixed stream: the same runs always give the same interval
EXACT_BELOW = 25  # discordant pairs below which McNemar's p-value is the exact binomial one
_CHUNK = 1_000  # replicates drawn at a time (memory: CHUNK x N item counts)


@dataclass(frozen=True)
class PairedDifference:
    """accuracy - baseline_accuracy (each the mean over its seeds and items); low/high: the 95%
    percentile interval of that difference; std: its bootstrap standard deviation; items: N."""

    baseline_accuracy: float
    accuracy: float
    difference: float
    low: float
    high: float
    std: float
    items: int
    seeds_paired: bool
    replicates: int


def bootstrap_difference(
    baseline: np.ndarray, other: np.ndarray, *, seeds_paired: bool, replicates: int = REPLICATES,
    seed: int = BOOTSTRAP_SEED,
) -> PairedDifference:
    """baseline: (S_a, N) and other: (S_b, N) correctness (0/1 or scores), one row per seed, the
    same N items in the same column order on both sides. seeds_paired: row s of both is the same
    seed (then S_a == S_b and one seed draw serves both). See the module docstring."""
    baseline, other = np.asarray(baseline, dtype=float), np.asarray(other, dtype=float)
    if baseline.ndim != 2 or other.ndim != 2 or baseline.shape[1] != other.shape[1] or baseline.shape[1] == 0:
        raise ValueError(f"need (seeds, items) tables over the same items, got {baseline.shape} and {other.shape}")
    if seeds_paired and baseline.shape[0] != other.shape[0]:
        raise ValueError(f"paired seeds need as many on both sides, got {baseline.shape[0]} and {other.shape[0]}")
    rng = np.random.default_rng(seed)
    items = baseline.shape[1]
    stats = []
    for start in range(0, replicates, _CHUNK):
        size = min(_CHUNK, replicates - start)
        item_counts = rng.multinomial(items, np.full(items, 1.0 / items), size=size)  # (R, N), rows sum to N
        seeds_a = _seed_counts(rng, baseline.shape[0], size)  # (R, S_a), rows sum to S_a
        seeds_b = seeds_a if seeds_paired else _seed_counts(rng, other.shape[0], size)
        mean_a = ((seeds_a @ baseline) * item_counts).sum(axis=1) / (baseline.shape[0] * items)  # (R,)
        mean_b = ((seeds_b @ other) * item_counts).sum(axis=1) / (other.shape[0] * items)
        stats.append(mean_b - mean_a)
    values = np.concatenate(stats)
    low, high = np.quantile(values, [0.025, 0.975])
    return PairedDifference(
        baseline_accuracy=float(baseline.mean()), accuracy=float(other.mean()),
        difference=float(other.mean() - baseline.mean()),
        low=float(low), high=float(high), std=float(values.std()), items=items, seeds_paired=seeds_paired,
        replicates=replicates,
    )


def _seed_counts(rng: np.random.Generator, seeds: int, size: int) -> np.ndarray:
    """(size, seeds) how often each seed is drawn in each replicate; one seed: always once."""
    return rng.multinomial(seeds, np.full(seeds, 1.0 / seeds), size=size).astype(float)


@dataclass(frozen=True)
class McNemar:
    """baseline_only: items the baseline got right and the other wrong; other_only: the reverse;
    p: two-sided p-value of 'both are equally good'; method: 'exact' or 'chi2'."""

    baseline_only: int
    other_only: int
    p: float
    method: str


def mcnemar(baseline_only: int, other_only: int) -> McNemar:
    """McNemar's test: only the discordant items inform a paired comparison of two 0/1 columns.
    Under equal accuracy each discordant item is a fair coin, so with n = b + c < EXACT_BELOW the
    p-value is the exact two-sided binomial one, min(1, 2 P(X <= min(b, c))) for X ~ Bin(n, 1/2);
    else chi2 = (|b - c| - 1)^2 / n (continuity-corrected) on one degree of freedom."""
    b, c = baseline_only, other_only
    n = b + c
    if n < EXACT_BELOW:
        tail = Fraction(sum(math.comb(n, k) for k in range(min(b, c) + 1)), 2**n)
        return McNemar(b, c, float(min(Fraction(1), 2 * tail)), "exact")
    chi2 = max(abs(b - c) - 1, 0) ** 2 / n
    return McNemar(b, c, math.erfc(math.sqrt(chi2 / 2)), "chi2")  # P(chi2_1 > x) = erfc(sqrt(x / 2))


@dataclass(frozen=True)
class SignTest:
    """A later eval against a baseline on the same items, read on the items the two grade differently: lost
    (the baseline right, the later wrong), gained (the reverse), and p, the exact one-sided p-value of 'the
    later eval is no worse'."""

    lost: int
    gained: int
    p: float


def sign_test(lost: int, gained: int) -> SignTest:
    """The exact one-sided sign test (McNemar's test on the discordant items, one-sided and exact): when
    the later eval is no worse, each of the n = lost + gained discordant items is lost at most as often as
    gained, so p = P(X >= lost), X ~ Bin(n, 1/2). Exact, so under 'no worse' P(p <= level) <= level for any n
    (less, as the binomial is discrete); no normal approximation for the handful of items a run flips."""
    return SignTest(lost, gained, _upper_tail(lost, lost + gained))


@functools.lru_cache(maxsize=4096)  # the same few counts recur eval after eval (and in the simulations)
def _upper_tail(k: int, n: int) -> float:
    """P(X >= k), X ~ Bin(n, 1/2), from exact integers."""
    return float(Fraction(sum(math.comb(n, j) for j in range(k, n + 1)), 2**n))


@dataclass(frozen=True)
class MeanInterval:
    """Mean of paired differences with its 95% interval (None with one pair) over n pairs."""

    mean: float
    low: float | None
    high: float | None
    n: int


def t_interval(differences: list[float]) -> MeanInterval:
    """mean +- t_{0.975, n-1} * s / sqrt(n) over n seed-paired differences (sample std s)."""
    n = len(differences)
    if n == 0:
        raise ValueError("t_interval needs at least one difference")
    mean = sum(differences) / n
    if n == 1:
        return MeanInterval(mean, None, None, 1)
    half = student_t_quantile(n - 1) * math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1) / n)
    return MeanInterval(mean, mean - half, mean + half, n)


def student_t_quantile(df: int, coverage: float = 0.95) -> float:
    """t such that P(|T| <= t) = coverage for Student's t with integer df, by bisection on the
    closed-form two-sided CDF (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    low, high = 0.0, 1.0
    while _t_central(high, df) < coverage:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if _t_central(middle, df) < coverage else (low, middle)
    return (low + high) / 2


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t), T ~ Student's t with df degrees of freedom (A&S 26.7.3 odd df, 26.7.4 even)."""
    theta = math.atan(t / math.sqrt(df))
    cos2, term, total = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):  # terms 2k/(2k+1) cos^2k
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        tail = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + tail)
    for k in range(1, df // 2):  # terms (2k-1)/(2k) cos^2k
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


@dataclass(frozen=True)
class StartChange:
    """An eval against its run's step-0 eval, paired on the items both cover: strict accuracy (`correct`) and
    answer accuracy (`answer_correct`; None when a side's records predate it), each a PairedDifference and the
    sign test on its discordant items."""

    strict: PairedDifference
    answer: PairedDifference | None
    strict_test: SignTest
    answer_test: SignTest | None


def shared_items(start: Sequence[dict], records: Sequence[dict]) -> list[tuple[dict, dict]]:
    """(start record, later record) for the items both hold (the same uid and gold answer), in `records`' order."""
    before = {(r["uid"], r["gold"]): r for r in start}
    return [(before[r["uid"], r["gold"]], r) for r in records if (r["uid"], r["gold"]) in before]


def discordant_test(shared: Sequence[tuple[dict, dict]], key: str) -> SignTest:
    """sign_test on the pairs whose `key` (correct, answer_correct) differs: lost right -> wrong, gained the reverse."""
    lost = sum(bool(before[key]) and not after[key] for before, after in shared)
    gained = sum(not before[key] and bool(after[key]) for before, after in shared)
    return sign_test(lost, gained)


def change_from_start(start: Sequence[dict], records: Sequence[dict]) -> StartChange | None:
    """The paired difference records - start (greedy, one record per item) on the items both hold (the same uid
    and gold answer), with the 95% paired bootstrap interval `compare` gives two runs (bootstrap_difference, one
    seed on each side) and the sign test of its discordant items; None when they share no item."""
    shared = shared_items(start, records)
    if not shared:
        return None

    def paired(key: str) -> PairedDifference:
        table = np.array([[[float(pair[side][key]) for pair in shared]] for side in (0, 1)])  # (2, 1, N)
        return bootstrap_difference(table[0], table[1], seeds_paired=True)

    lenient = all("answer_correct" in r for pair in shared for r in pair)
    answer = (paired("answer_correct"), discordant_test(shared, "answer_correct")) if lenient else (None, None)
    return StartChange(paired("correct"), answer[0], discordant_test(shared, "correct"), answer[1])


def change_metrics(change: StartChange | None) -> dict[str, float]:
    """The metrics of a change from step 0: change, change_low, change_high (strict), change_lost, change_gained and
    change_p (its sign test), the same as answer_change*, and change_items (the items paired); {} for None."""
    if change is None:
        return {}
    metrics = {"change_items": change.strict.items}
    for name, diff, test in (("change", change.strict, change.strict_test),
                             ("answer_change", change.answer, change.answer_test)):
        if diff is not None:
            metrics.update({name: diff.difference, f"{name}_low": diff.low, f"{name}_high": diff.high,
                            f"{name}_lost": test.lost, f"{name}_gained": test.gained, f"{name}_p": test.p})
    return metrics
