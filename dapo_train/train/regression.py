"""Whether a run is making its model worse than it started, judged at its periodic evals.

Each periodic eval after step 0 is compared with step 0 on the same fixed items: the paired change of the
strict and of the answer accuracy, each with its 95% interval (evaluation/stats.change_from_start, the
metrics `eval/change*` and `eval/answer_change*`). One accuracy whose whole interval lies below 0 (its
upper bound under 0) at REGRESSED_EVALS evals in a row has regressed: the run says so in one line, once,
with the figures and the best checkpoint (checkpoint.keep_best), and with eval.stop_on_regression it stops
there (RunRegressed, exit code 6; its checkpoint is saved). One such eval alone is not enough (a 95%
interval lies wholly below the truth one time in forty by chance), nor is an interval that reaches 0: a
flat or improving run, or one noisy around where it started, does not trip it on one unlucky eval
(tests/train/test_regression.py drives it through these cases).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dapo_train.config.schema import Config
from dapo_train.run.checkpoint import CheckpointScore
from dapo_train.run.eval_items import PERIODIC

REGRESSED_EVALS = 2  # evals in a row whose interval lies below 0
# The two accuracies: name in the line -> the metric prefix of its change (eval/<prefix>, _low, _high).
ACCURACIES = {"strict": "change", "answer": "answer_change"}


@dataclass(frozen=True)
class Change:
    """A paired change from step 0 and its 95% interval."""

    difference: float
    low: float
    high: float

    def below(self) -> bool:
        return self.high < 0

    def text(self) -> str:
        """'+0.070 [+0.040, +0.100]'."""
        return f"{self.difference:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


@dataclass(frozen=True)
class EvalOutcome:
    """One periodic eval against step 0: accuracy name (ACCURACIES) -> its Change (absent: not measured)."""

    step: int
    changes: dict[str, Change]


def eval_outcome(step: int, metrics: dict, prefix: str = PERIODIC.prefix) -> EvalOutcome | None:
    """The outcome an eval's metrics hold (`eval/change`, `eval/change_low`, ...); None without a change."""
    changes = {}
    for name, key in ACCURACIES.items():
        values = [metrics.get(f"{prefix}{key}{end}") for end in ("", "_low", "_high")]
        if all(isinstance(value, (int, float)) for value in values):
            changes[name] = Change(*map(float, values))
    return EvalOutcome(step, changes) if changes else None


def regressed(outcomes: Sequence[EvalOutcome]) -> list[str]:
    """The accuracies (ACCURACIES names) below step 0, interval and all, at each of the last REGRESSED_EVALS
    evals; [] when none (the run has not regressed)."""
    last = outcomes[-REGRESSED_EVALS:]
    if len(last) < REGRESSED_EVALS:
        return []
    return [name for name in ACCURACIES if all(name in o.changes and o.changes[name].below() for o in last)]


def best_text(best: CheckpointScore | None, keep_best: bool) -> str:
    """What the run says of its best checkpoint (checkpoint.keep_best)."""
    if best is not None:
        return f"the best checkpoint is {best.name} (eval accuracy {best.accuracy:.3f} at step {best.step})"
    if keep_best:
        return "no checkpoint has been saved at an eval step yet (checkpoint.keep_best ranks those)"
    return "no best checkpoint is kept (checkpoint.keep_best=false)"


def regression_line(outcomes: Sequence[EvalOutcome], names: list[str], best: CheckpointScore | None,
                    keep_best: bool) -> str:
    """The warning: which accuracy fell, its change at each of the evals that show it, and the best checkpoint."""
    last = outcomes[-REGRESSED_EVALS:]
    fell = "; ".join(f"{name} accuracy " + ", ".join(f"{o.changes[name].text()} at step {o.step}" for o in last)
                     for name in names)
    keep = best_text(best, keep_best)
    return (f"step {last[-1].step}: the model is worse than at step 0 at {REGRESSED_EVALS} evals in a row, the "
            f"95% interval below 0 (change from step 0 on the same eval items): {fell}; {keep}")


def stop_note(cfg: Config) -> str | None:
    """Why eval.stop_on_regression cannot act as configured (said at start), or None."""
    every, steps = cfg.eval.every_steps, cfg.train.max_steps
    if not cfg.eval.stop_on_regression:
        return None
    evals = 0 if every <= 0 else steps // every + (steps % every > 0)  # the periodic evals after step 0
    if evals < REGRESSED_EVALS:
        return (f"eval.stop_on_regression cannot act: it needs {REGRESSED_EVALS} periodic evals after step 0 and "
                f"eval.every_steps={every} with train.max_steps={steps} makes {evals}")
    return None


@dataclass
class RegressionWatch:
    """The run's periodic evals against step 0, and whether it has said it regressed (once per run)."""

    outcomes: list[EvalOutcome] = field(default_factory=list)
    said: bool = False

    @classmethod
    def from_rows(cls, rows: Sequence[dict]) -> RegressionWatch:
        """From metrics.jsonl's rows (a resumed run's, up to its checkpoint): its evals so far; said when they
        already show a regression."""
        outcomes = [o for row in rows if (o := eval_outcome(int(row["step"]), row)) is not None]
        return cls(outcomes, any(regressed(outcomes[: i + 1]) for i in range(len(outcomes))))

    def record(self, step: int, metrics: dict, best: CheckpointScore | None, keep_best: bool) -> str | None:
        """Count an eval's metrics (a step without a periodic eval changes nothing). -> the warning line the
        first time the run regressed, else None."""
        outcome = eval_outcome(step, metrics)
        if outcome is None:
            return None
        self.outcomes.append(outcome)
        names = regressed(self.outcomes)
        if not names or self.said:
            return None
        self.said = True
        return regression_line(self.outcomes, names, best, keep_best)
