"""Whether a run is making its model worse than it started: a test at each periodic eval, whose chance of a
false alarm over the whole run is bounded, however many evals the run makes.

The rule (docs/training.md states it too). Each periodic eval after step 0 grades the same fixed items step 0
graded; only the items the two grade differently inform the comparison: lost (right at step 0, wrong now) and
gained (the reverse). If the model is no worse than at step 0, each of them is lost at most as often as gained,
so the exact one-sided sign test's p = P(X >= lost), X ~ Bin(lost + gained, 1/2) (evaluation/stats.sign_test).
The run has regressed at the first eval where the strict or the answer accuracy has p <= alpha / (2 m): alpha is
eval.regression_alpha, m the periodic evals after step 0 the config makes (train.max_steps / eval.every_steps,
rounded up), 2 the accuracies. By Bonferroni's inequality a run whose accuracy does not change is called
regressed, at any of its evals in either accuracy, with chance at most alpha, however the evals depend on one
another (they share step 0, and each checkpoint follows the last) and however many there are. One eval past the
bound is enough: the bound, not a run of bad evals, keeps the false alarms rare, and a collapse stops at its
first eval. The price is power: on 100 items over 30 evals the bound (1.7e-4) needs at least 13 items lost and
none gained, so a drop of a few points goes unflagged (docs/studies.md, "The regression stop", measures both).

The run says so once, in one line (the counts, p and the bound): with eval.stop_on_regression that line ends
the run (RunRegressed, exit code 6, the checkpoint of that step saved, the summary naming the best); without,
it is a warning naming the best checkpoint (checkpoint.keep_best) and the run goes on. Every eval's test is in
metrics.jsonl (eval/change_lost, _gained, _p, the same for answer_change, eval/regression_bound), so a resumed
run knows whether it had said so; older rows, with the interval alone, are no test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapo_train.config.schema import Config
from dapo_train.evaluation.stats import SignTest
from dapo_train.run.checkpoint import CheckpointScore
from dapo_train.run.eval_items import PERIODIC

# The two accuracies: name in the line -> the metric prefix of its change (eval/<prefix>, _low, _high, _lost, ...).
ACCURACIES = {"strict": "change", "answer": "answer_change"}


@dataclass(frozen=True)
class Change:
    """A paired change from step 0 and its 95% bootstrap interval: what the eval lines show, not the test."""

    difference: float
    low: float
    high: float

    def text(self) -> str:
        """'+0.070 [+0.040, +0.100]'."""
        return f"{self.difference:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def start_changes(metrics: dict, prefix: str = PERIODIC.prefix) -> dict[str, Change]:
    """The changes from step 0 an eval's metrics hold (`eval/change`, `eval/change_low`, ...), by accuracy name;
    {} for step 0, or an eval without a start to pair with."""
    changes = {}
    for name, key in ACCURACIES.items():
        values = [metrics.get(f"{prefix}{key}{end}") for end in ("", "_low", "_high")]
        if all(isinstance(value, (int, float)) for value in values):
            changes[name] = Change(*map(float, values))
    return changes


@dataclass(frozen=True)
class Rule:
    """The bound each test is held to: eval.regression_alpha spread evenly (Bonferroni) over the run's tests,
    its `evals` periodic evals after step 0 times the accuracies."""

    alpha: float
    evals: int

    @classmethod
    def of(cls, cfg: Config) -> Rule:
        every, steps = cfg.eval.every_steps, cfg.train.max_steps
        return cls(cfg.eval.regression_alpha, 0 if every <= 0 else math.ceil(steps / every))

    @property
    def bound(self) -> float:
        return self.alpha / (len(ACCURACIES) * max(self.evals, 1))

    def fewest_lost(self) -> int:
        """The fewest items an eval must lose, gaining none, to reach the bound: the smallest k with 2^-k <= it."""
        lost = 0
        while 0.5**lost > self.bound:
            lost += 1
        return lost

    def text(self) -> str:
        evals = f"{self.evals} eval" + ("s" if self.evals != 1 else "")
        return f"{self.alpha:g} over its {evals} x {len(ACCURACIES)} accuracies (eval.regression_alpha)"


@dataclass(frozen=True)
class EvalTest:
    """One periodic eval against step 0: accuracy name -> its sign test (absent: not measured), over `items`
    paired items, each held to `bound`."""

    step: int
    tests: dict[str, SignTest]
    items: int
    bound: float

    def fell(self) -> list[str]:
        """The accuracies past the bound: this eval says the run regressed."""
        return [name for name, test in self.tests.items() if test.p <= self.bound]


def eval_test(step: int, metrics: dict, prefix: str = PERIODIC.prefix) -> EvalTest | None:
    """The test an eval's metrics hold; None for a row without one (step 0, a step without an eval, an older
    run's row with the interval alone)."""
    tests = {}
    for name, key in ACCURACIES.items():
        values = [metrics.get(f"{prefix}{key}_{end}") for end in ("lost", "gained", "p")]
        if all(isinstance(value, (int, float)) for value in values):
            tests[name] = SignTest(int(values[0]), int(values[1]), float(values[2]))
    bound, items = metrics.get(f"{prefix}regression_bound"), metrics.get(f"{prefix}change_items")
    if not tests or not isinstance(bound, (int, float)) or not isinstance(items, (int, float)):
        return None
    return EvalTest(step, tests, int(items), float(bound))


def regression_line(test: EvalTest, rule: Rule) -> str:
    """The verdict in one line: which accuracy fell, its counts and p, and the bound it passed."""
    fell = "; ".join(f"{name} accuracy {t.lost} lost, {t.gained} gained ({(t.gained - t.lost) / test.items:+.3f}), "
                     f"p = {t.p:.1e} <= {test.bound:.1e}" for name, t in test.tests.items() if name in test.fell())
    return (f"step {test.step}: the model is worse than at step 0 on the same {test.items} eval items, by the exact "
            f"one-sided sign test on the items graded differently: {fell}, the bound that holds a run's chance of a "
            f"false alarm to {rule.text()}")


def best_text(best: CheckpointScore | None, keep_best: bool) -> str:
    """What the run says of its best checkpoint (checkpoint.keep_best)."""
    if best is not None:
        return f"the best checkpoint is {best.name} (eval accuracy {best.accuracy:.3f} at step {best.step})"
    if keep_best:
        return "no checkpoint has been saved at an eval step yet (checkpoint.keep_best ranks those)"
    return "no best checkpoint is kept (checkpoint.keep_best=false)"


def stop_note(cfg: Config) -> str | None:
    """Why eval.stop_on_regression cannot act as configured (said at start), or None."""
    if not cfg.eval.stop_on_regression:
        return None
    rule, items = Rule.of(cfg), cfg.eval.num_items
    if rule.evals == 0:
        return (f"eval.stop_on_regression cannot act: eval.every_steps={cfg.eval.every_steps} with "
                f"train.max_steps={cfg.train.max_steps} makes no periodic eval after step 0")
    if 0 < items < rule.fewest_lost():
        return (f"eval.stop_on_regression cannot act: its test reaches its bound {rule.bound:.1e} ({rule.text()}) "
                f"only with at least {rule.fewest_lost()} eval items lost and none gained, and eval.num_items={items}; "
                "raise eval.num_items or eval.regression_alpha")
    return None


@dataclass
class RegressionWatch:
    """Whether the run has said it regressed (once per run)."""

    said: bool = False

    @classmethod
    def from_rows(cls, rows: Sequence[dict]) -> RegressionWatch:
        """From metrics.jsonl's rows (a resumed run's, up to its checkpoint): said when an eval's test fell."""
        tests = (eval_test(int(row["step"]), row) for row in rows)
        return cls(any(test.fell() for test in tests if test is not None))

    def record(self, step: int, metrics: dict, rule: Rule) -> str | None:
        """An eval's metrics (a step without a periodic eval changes nothing). -> the line the first time the run
        regressed, else None."""
        test = eval_test(step, metrics)
        if self.said or test is None or not test.fell():
            return None
        self.said = True
        return regression_line(test, rule)
