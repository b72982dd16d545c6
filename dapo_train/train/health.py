"""When a run stops on its own, and which of its checkpoints can be trusted.

A step that does not train is one of three kinds (its metrics say which):
- non-finite (`skipped_nonfinite`): a loss or gradient norm was NaN/inf, so the step's updates
  stopped there. The weights are suspect when an optimizer step of that step applied before it: its
  values are what made the next one non-finite (train.learning_rate=1e10: the first update overflows
  the weights, the second is NaN). When the first one failed, no optimizer step applied and the
  weights are those of the step before;
- starved (`skipped_no_groups`): no group was informative after dapo.max_gen_rounds rounds, so
  there was nothing to train on and the weights did not move;
- fp16 overflow only (`scaler_skips`, no optimizer step applied): the loss scaler skipped each
  optimizer step and lowered its scale, as it does in the first steps of an fp16 run; neither bad
  nor trained.
`train.max_bad_steps` non-finite steps since the last step that trained stop the run (TrainingAborted,
exit code 3), as does reaching train.max_steps with suspect weights.

Starvation is judged by its signature once `train.max_starved_steps` steps in a row (since the last
that trained) had no informative group, and at every starved step after:
- after a non-finite step: the weights diverged (exit 3);
- the training accuracy, or the share of completions that ended before rollout.max_new_tokens, fell
  from what the last HISTORY_STEPS steps before showed so far that chance explains it with a
  probability below COLLAPSE_P (Fisher's exact test, one-sided): the policy collapsed (exit 3);
- every prompt of the streak had all its completions right (all G, or all k of a screen that ruled
  it out: a screened prompt's outcome counts, dapo.screen_size; a prompt the history skipped counts on
  the side its last group or screen fell, dapo.skip_history): the model answers every prompt
  correctly and there is nothing left to learn at G (TaskSolved, exit code 5; its checkpoint is
  saved, the weights are fine);
- otherwise (every group all wrong: the task is too hard for the model for now; or some all right
  and some all wrong) the numbers are said once per run, and the run goes on: a healthy run at a
  pass rate of 1% starves five steps in a row in most runs of qwen1.5b-seed.yaml's batch (tests).
No checkpoint is saved from suspect weights (periodic, final or at a stop), so every checkpoint the
run leaves holds weights no optimizer step broke, and the reason names the newest of them (or says
there is none).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dapo_train.config.schema import Config
from dapo_train.run.checkpoint import CHECKPOINT_RE, checkpoint_dirs

logger = logging.getLogger(__name__)

HISTORY_STEPS = 50  # the steps before a starved streak that its accuracy and truncation are compared with
COLLAPSE_P = 1e-6  # a fall this improbable by chance is a collapse
# One step's counts, in a history entry: completions, correct, ended before the limit, prompts whose completions
# were all right (a group dropped so, a screen that ruled it out, or the last of a prompt the history skipped), all
# wrong (the same), other groups (dropped for another reason, or kept), and of these prompts those a screen ruled
# out and those the history skipped (dapo.skip_history: generated nothing this step).
COUNTS = ("completions", "correct", "finished", "all_correct", "all_wrong", "other_groups", "screened", "skipped")


@dataclass
class StepHealth:
    """The run's bad steps since the last step that trained, and what its recent steps generated
    (saved in every checkpoint)."""

    nonfinite: int = 0  # steps whose loss or gradient norm was not finite
    starved: int = 0  # steps without an informative group
    last_trained: int = 0  # the last step whose update ran cleanly (0: none yet)
    clean_step: int = 0  # the last step after which the weights were not suspect
    suspect: bool = False  # an optimizer step applied before a non-finite one, since the last step that trained
    history: list[list[int]] = field(default_factory=list)  # COUNTS of the steps before the streak, oldest first
    streak: list[int] = field(default_factory=lambda: [0] * len(COUNTS))  # COUNTS summed over the starved streak
    explained: list[str] = field(default_factory=list)  # the benign starvation kinds already said this run

    def record(self, step: int, metrics: dict) -> None:
        """Count step `step` by its metrics, and say what it skipped."""
        counts = step_counts(metrics)
        if metrics.get("skipped_nonfinite"):
            self.nonfinite += 1
            self.suspect = self.suspect or metrics.get("optimizer_steps", 1) > 0
            logger.warning("step %d: non-finite loss or grad norm; update skipped (%s)", step, self._since())
        elif metrics.get("skipped_no_groups"):
            self.starved += 1
            self.streak = [a + b for a, b in zip(self.streak, counts)]
            logger.warning("step %d: no informative group after %d rounds; update skipped (%s)", step,
                           metrics.get("gen_rounds", 0), self._since())
        elif not metrics.get("optimizer_steps", 1):
            logger.info("step %d: fp16's loss scaler skipped every optimizer step (its scale fell)", step)
        else:
            self.nonfinite = 0
            self.suspect = False
            self.last_trained = step
        if not self.suspect:
            self.clean_step = step
        if not metrics.get("skipped_no_groups"):
            self._end_streak(counts)

    def _end_streak(self, counts: list[int]) -> None:
        """A step that was not starved: the streak (one entry) and this step join the history."""
        if self.starved:
            self.history.append(self.streak)
            self.starved, self.streak = 0, [0] * len(COUNTS)
        self.history = [*self.history, counts][-HISTORY_STEPS:]

    def _since(self) -> str:
        counts = [f"{n} {kind}" for n, kind in ((self.nonfinite, "non-finite"), (self.starved, "starved")) if n]
        return f"{', '.join(counts)} since step {self.last_trained}, the last that trained"

    def abort_reason(self, cfg: Config, step: int, run_dir: Path) -> str | None:
        """One line saying why the run must stop after step `step` (exit code 3), or None when it goes on
        (or stops solved: `solved`). A benign starvation is said once, here."""
        t = cfg.train
        why = None
        if self.nonfinite >= t.max_bad_steps:
            why = (f"{self.nonfinite} non-finite steps since step {self.last_trained}, the last that trained "
                   f"(train.max_bad_steps={t.max_bad_steps}): the loss or gradient norm overflowed")
        elif self.starved >= t.max_starved_steps:
            why = self._starved_abort(cfg)
        if why is None and step >= t.max_steps and self.suspect:
            why = (f"the run reached train.max_steps with {self.nonfinite} non-finite step(s) since step "
                   f"{self.last_trained}, the last that trained, after an optimizer step applied")
        if why is None:
            return None
        return f"{why}; {self.last_good(run_dir)}; {_advice(cfg)}"

    def _starved_abort(self, cfg: Config) -> str | None:
        """Why a starved streak means a broken run, or None (then it is solved or said once)."""
        if self.nonfinite:
            return (f"{self.starved} steps in a row without an informative group (train.max_starved_steps="
                    f"{cfg.train.max_starved_steps}) after {self.nonfinite} non-finite step(s): the weights have "
                    "likely diverged")
        before = [sum(column) for column in zip(*self.history)] or [0] * len(COUNTS)
        streak = dict(zip(COUNTS, self.streak))
        for key, what in (("correct", "the training accuracy"),
                          ("finished", "the share of completions that ended before rollout.max_new_tokens")):
            n, hits = before[0], before[COUNTS.index(key)]
            if fell_by_chance(hits, n, streak[key], streak["completions"]) < COLLAPSE_P:
                return (f"{what} fell from {_share(hits, n)} over the {len(self.history)} steps before to "
                        f"{_share(streak[key], streak['completions'])} in the {self.starved} steps without an "
                        f"informative group since (chance explains a fall this deep with p < {COLLAPSE_P:g}): the "
                        "policy collapsed")
        if self.solved(cfg) is None:
            self._explain(cfg, streak)
        return None

    def _explain(self, cfg: Config, streak: dict) -> None:
        """Say once per run what a benign starvation is, with its numbers."""
        groups, g = streak["all_correct"] + streak["all_wrong"] + streak["other_groups"], cfg.rollout.group_size
        metric, screened = cfg.dapo.filter_metric, _unseen(streak, cfg)
        every = "all its completions" if screened else f"all {g} completions"
        kind = "flat" if metric != "correct" else "too hard" if streak["all_wrong"] == groups else "mixed"
        if kind in self.explained or not groups:
            return
        self.explained.append(kind)
        before = (f"{_share(sum(e[1] for e in self.history), sum(e[0] for e in self.history))} over the "
                  f"{len(self.history)} steps before, " if self.history else "")
        accuracy = f"training accuracy {before}{_share(streak['correct'], streak['completions'])} in these steps"
        truncated = _share(streak["completions"] - streak["finished"], streak["completions"])
        what = {
            "too hard": f"every one of the {groups} prompts{screened} had {every} wrong; the task is too hard for the "
                        "model for now, and a step trains only on a group it answers sometimes",
            "mixed": f"of the {groups} prompts{screened}, {streak['all_correct']} had {every} right and "
                     f"{streak['all_wrong']} all wrong ({streak['other_groups']} alike by dapo.filter_metric): nothing "
                     f"to learn from these at G={g}",
            "flat": f"dapo.filter_metric={metric} was alike within each of the {groups} groups{screened} "
                    f"({streak['all_correct']} all right, {streak['all_wrong']} all wrong by the task's answers): the "
                    "reward does not tell the completions apart; check the rewards (dapo-train show RUN --where "
                    "dropped)",
        }[kind]
        logger.warning("%d steps in a row without an informative group (train.max_starved_steps=%d): %s (%s; %s "
                       "truncated at rollout.max_new_tokens); not stopping: nothing says the run is broken, as a "
                       "fall from a higher accuracy or a non-finite step would. Said once per run.",
                       self.starved, cfg.train.max_starved_steps, what, accuracy, truncated)

    def solved(self, cfg: Config) -> str | None:
        """Why the run stops solved (TaskSolved, exit code 5), or None: train.max_starved_steps steps in a
        row whose every prompt had all its completions right (its group of G, the screen of k that ruled
        it out, or the last of these of a prompt the history skipped), with no non-finite step since the
        last that trained."""
        streak = dict(zip(COUNTS, self.streak))
        groups = streak["all_correct"] + streak["all_wrong"] + streak["other_groups"]
        if self.starved < cfg.train.max_starved_steps or self.nonfinite or not groups or streak["all_correct"] < groups:
            return None
        g, k, screened, skipped = cfg.rollout.group_size, cfg.dapo.screen_size, streak["screened"], streak["skipped"]
        parts = [f"all {g} completions of each of {groups - screened - skipped} groups",
                 f"all {k} screening completions of each of {screened} prompts a screen ruled out (dapo.screen_size)",
                 f"the last group or screen of each of {skipped} prompts the history skipped (dapo.skip_history)"]
        parts = [part for part, n in zip(parts, (groups - screened - skipped, screened, skipped)) if n]
        return (f"the model answers every prompt correctly: in the last {self.starved} steps, {' and '.join(parts)} "
                f"were right; nothing left to learn at G={g} (rollout.group_size)")

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
        (`bad_steps`, consecutive then): the step before those trained cleanly. One written before
        `suspect` was kept counted any non-finite step as making the weights suspect."""
        if "health" in state:
            health = dict(state["health"])
            health.setdefault("suspect", health["nonfinite"] > 0)
            # Written before the screened or skipped counts: the counts it had, none of those (padded to COUNTS).
            health["history"] = [_padded(entry) for entry in health.get("history", [])]
            health["streak"] = _padded(health.get("streak", []))
            return cls(**health)
        nonfinite = int(state.get("bad_steps", 0))
        clean = int(state["step"]) - nonfinite
        return cls(nonfinite=nonfinite, last_trained=clean, clean_step=clean, suspect=nonfinite > 0)


def step_counts(metrics: dict) -> list[int]:
    """A step's COUNTS from its metrics (collect/rounds.py's): a prompt a screen ruled out is all right or all wrong
    as its screen was (its k completions are in the completions and correct counts too), and one the history
    skipped as its last group or screen was (alike with mixed answers when neither)."""
    n, skipped = int(metrics.get("completions", 0)), metrics.get("prompts_skipped", 0)
    screened = [metrics.get(f"groups_screened_{side}", 0) for side in ("all_right", "all_wrong")]
    skipped_on = [metrics.get(f"prompts_skipped_{side}", 0) for side in ("all_right", "all_wrong")]
    all_correct = metrics.get("groups_dropped_all_correct", 0) + screened[0] + skipped_on[0]
    all_wrong = metrics.get("groups_dropped_all_wrong", 0) + screened[1] + skipped_on[1]
    other = metrics.get("groups_dropped_no_variance", 0) + metrics.get("groups_kept", 0) + skipped - sum(skipped_on)
    return [n, round(metrics.get("train_accuracy", 0.0) * n), n - round(metrics.get("truncated_ratio", 0.0) * n),
            all_correct, all_wrong, other, sum(screened), skipped]


def _padded(counts: list[int]) -> list[int]:
    return [*counts, *[0] * (len(COUNTS) - len(counts))]


def _unseen(streak: dict, cfg: Config) -> str:
    """What a starvation message says of the prompts a screen ruled out and those the history skipped (none:
    nothing)."""
    parts = [f"{streak['screened']} of them on the {cfg.dapo.screen_size} completions of a screen that ruled them "
             "out, dapo.screen_size", f"{streak['skipped']} skipped on their history and counted as their last group "
             "or screen fell, dapo.skip_history"]
    parts = [part for part, n in zip(parts, (streak["screened"], streak["skipped"])) if n]
    return f" ({'; '.join(parts)})" if parts else ""


def _advice(cfg: Config) -> str:
    """What to change after a bad run. float16 weights go non-finite at AdamW's first step whatever the learning
    rate: its eps (1e-8) rounds to 0 in float16, so a weight whose gradient is 0 (or underflows) gets 0/0. LoRA's
    adapters train in float32 (peft casts them), but the float16 forward still overflows past 65,504."""
    if cfg.model.dtype != "float16":
        return "lower train.learning_rate or check the data and rewards"
    if cfg.model.lora.r > 0:
        return ("model.dtype=float16 may be the cause: its forward overflows past 65,504; set model.dtype=bfloat16, "
                "or lower train.learning_rate")
    return ("model.dtype=float16 is the likely cause, not the learning rate: AdamW's eps (1e-8) is 0 in float16, so "
            "its steps divide by 0; set model.dtype=bfloat16 or auto (float32 master weights)")


def fell_by_chance(hits_before: int, n_before: int, hits_after: int, n_after: int) -> float:
    """P(at most hits_after of n_after) if both stretches had one success rate: n_after draws from the
    n_before + n_after outcomes, hits_before + hits_after of them successes (Fisher's exact test,
    one-sided; the hypergeometric lower tail). 1.0 when nothing was seen before or the rate rose."""
    total, hits = n_before + n_after, hits_before + hits_after
    if not n_before or not n_after or hits_after * n_before >= hits_before * n_after:
        return 1.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    lowest = max(0, n_after - (total - hits))
    log_all = log_comb(total, n_after)
    return min(1.0, sum(math.exp(log_comb(hits, x) + log_comb(total - hits, n_after - x) - log_all)
                        for x in range(lowest, hits_after + 1)))


def _share(part: int, whole: int) -> str:
    return f"{100 * part / max(1, whole):.1f}% ({part} of {whole} completions)"
