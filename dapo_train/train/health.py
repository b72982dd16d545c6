"""When a run stops on its own, and which of its checkpoints can be trusted.

A step that does not train is bad in one of two ways (its metrics say which):
- non-finite (`skipped_nonfinite`): a loss or gradient norm was NaN/inf, so the step's updates
  stopped there; the optimizer steps before it in the same rollout batch did apply, so the weights
  may already be broken (train.learning_rate=1e10: the first update overflows them, the second is
  NaN);
- starved (`skipped_no_groups`): no group was informative after dapo.max_gen_rounds rounds, so
  there was nothing to train on; the weights did not move, but a policy that collapsed (every
  completion truncated, every reward alike) starves every step after it.
Counted since the last step that trained, `train.max_bad_steps` non-finite or `train.max_starved_steps`
starved steps stop the run (TrainingAborted, exit code 3), as does reaching train.max_steps with a
non-finite step since the last one that trained. Weights after a non-finite step are suspect: no
checkpoint is saved from them (periodic or final), so every checkpoint the run leaves holds weights
that trained cleanly, and the reason names the newest of them (or says there is none).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from dapo_train.config.schema import Config
from dapo_train.model.checkpoint import CHECKPOINT_RE, checkpoint_dirs

logger = logging.getLogger(__name__)


@dataclass
class StepHealth:
    """The run's bad steps since the last step that trained (saved in every checkpoint)."""

    nonfinite: int = 0  # steps whose loss or gradient norm was not finite
    starved: int = 0  # steps without an informative group
    last_trained: int = 0  # the last step whose update ran cleanly (0: none yet)
    clean_step: int = 0  # the last step after which the weights were clean (no non-finite step since training)

    @property
    def suspect(self) -> bool:
        """The weights may be broken: a non-finite step since the last one that trained."""
        return self.nonfinite > 0

    def record(self, step: int, metrics: dict) -> None:
        """Count step `step` by its metrics, and say what it skipped."""
        if metrics.get("skipped_nonfinite"):
            self.nonfinite += 1
            logger.warning("step %d: non-finite loss or grad norm; update skipped (%s)", step, self._since())
        elif metrics.get("skipped_no_groups"):
            self.starved += 1
            logger.warning("step %d: no informative group after %d rounds; update skipped (%s)", step,
                           metrics.get("gen_rounds", 0), self._since())
        else:
            self.nonfinite = self.starved = 0
            self.last_trained = step
        if not self.suspect:
            self.clean_step = step

    def _since(self) -> str:
        counts = [f"{n} {kind}" for n, kind in ((self.nonfinite, "non-finite"), (self.starved, "starved")) if n]
        return f"{', '.join(counts)} since step {self.last_trained}, the last that trained"

    def abort_reason(self, cfg: Config, step: int, run_dir: Path) -> str | None:
        """One line saying why the run must stop after step `step`, or None when it goes on."""
        t = cfg.train
        if self.nonfinite >= t.max_bad_steps:
            why = (f"{self.nonfinite} non-finite steps since step {self.last_trained}, the last that trained "
                   f"(train.max_bad_steps={t.max_bad_steps}): the loss or gradient norm overflowed")
        elif self.starved >= t.max_starved_steps:
            rounds = cfg.dapo.max_gen_rounds
            why = (f"{self.starved} steps in a row without an informative group (train.max_starved_steps="
                   f"{t.max_starved_steps}): every group scored alike in all dapo.max_gen_rounds={rounds} rounds, so "
                   "nothing trained")
            if self.nonfinite:
                why += f", after {self.nonfinite} non-finite step(s): the weights have likely diverged"
        elif step >= t.max_steps and self.suspect:
            why = (f"the run reached train.max_steps with {self.nonfinite} non-finite step(s) since step "
                   f"{self.last_trained}, the last that trained")
        else:
            return None
        return f"{why}; {self.last_good(run_dir)}; lower train.learning_rate or check the data and rewards"

    def last_good(self, run_dir: Path) -> str:
        """Where the run's last clean weights are: the newest checkpoint saved at or before clean_step."""
        good = [path for path in checkpoint_dirs(run_dir) if int(CHECKPOINT_RE.match(path.name)[1]) <= self.clean_step]
        if not good:
            return ("no checkpoint holds weights from before it (none was saved by then), and the weights since "
                    "were not saved")
        return (f"the last good checkpoint is {good[-1]} (the weights since were not saved): resume from it with "
                f"dapo-train run --resume {good[-1]} KEY=VALUE")

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> StepHealth:
        """From trainer_state.pt; a checkpoint written before this record has its non-finite count only
        (`bad_steps`, consecutive then): the step before those trained cleanly."""
        if "health" in state:
            return cls(**state["health"])
        nonfinite = int(state.get("bad_steps", 0))
        clean = int(state["step"]) - nonfinite
        return cls(nonfinite=nonfinite, last_trained=clean, clean_step=clean)
