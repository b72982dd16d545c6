"""What a run says while it trains and when it ends.

- The tqdm bar (logging.progress_bar) labels its fields, so eval and train accuracy are never
  confused: `reward`, `train_acc` (this step's rollouts), `eval_acc` (the last eval), `ent`.
- Without the bar (server logs, CI) every step logs one plain line instead.
- Every eval logs one line: step, accuracy with its 95% interval, the answer accuracy and the format
  gap, the change from step 0 with its 95% paired interval ("+0.070 [+0.040, +0.100] over step 0"),
  and the means since the last eval of reward, train accuracy, entropy, clip fractions, the rollout's
  KL to the training forward (rollout_kl) and seconds per step. Step 0's says what share of its greedy
  answers the token budget cut, and their mean length; more than CUT_WARN cut is a warning line.
- Every eval also shows one trained completion (the latest in the rollout records) in two lines:
  its answer, its reward breakdown and the start of what it wrote.
- A step that dropped every group, and a reward that has not moved in FLAT_STEPS steps, each get a
  line saying so and the `dapo-train show` command that shows what the model wrote; the end-of-run
  summary says the same.
- The end of a run prints a summary: how it ended, eval accuracy first -> best -> last, the answer
  accuracy and the last eval's change from step 0 with its interval, the final
  accuracy on the whole eval split (eval.final_full), the steps skipped of each kind (non-finite,
  without an informative group), what generation cost per trained token and group, the update's
  work over the run (positions its forwards computed, of which padding, and those the LM head scored,
  per trained token), wall time, the checkpoints, and the command to run next.
Lines go through `logging` (redirected around the bar, so the bar stays one line).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shlex
import time
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from dapo_train.config.schema import Config
from dapo_train.evaluation.generate import eval_max_new_tokens
from dapo_train.run.checkpoint import CheckpointScore, checkpoint_dirs
from dapo_train.run.eval_items import FINAL
from dapo_train.run.logs import generation_cost, read_metrics
from dapo_train.run.rollouts import brief, saved_rollouts
from dapo_train.train.regression import best_text, start_changes

logger = logging.getLogger(__name__)

# Label in a log line -> the step metric it shows (means over the steps the line covers).
STEP_FIELDS = (
    ("reward", "reward_mean", "{:.3f}"),
    ("train acc", "train_accuracy", "{:.3f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("clip high", "clip_frac_high", "{:.4f}"),
    ("low", "clip_frac_low", "{:.4f}"),
    ("rollout kl", "rollout_kl", "{:.1e}"),
)
# Steps in a row whose reward_mean stays within FLAT_TOLERANCE make a reward that "has not moved".
FLAT_STEPS = 5
FLAT_TOLERANCE = 1e-6


def duration(seconds: float) -> str:
    """3725 -> '1h02m', 200 -> '3m20s', 7.4 -> '7s'."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _mean(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
    return sum(values) / len(values) if values else None


def step_fields(rows: list[dict]) -> str:
    """'reward 0.412, train acc 0.375, entropy 0.521, clip high 0.0120 low 0.0030, 4.1 s/step': means
    over `rows`; a metric no row has (no update ran) is left out."""
    parts = []
    for label, key, form in STEP_FIELDS:
        value = _mean(rows, key)
        if value is not None:
            parts.append(f"{label} {form.format(value)}")
    seconds = _mean(rows, "seconds_step")
    if seconds is not None:
        parts.append(f"{seconds:.1f} s/step")
    return ", ".join(parts).replace(", low ", " low ")


def accuracy_text(metrics: dict, prefix: str) -> str:
    """'answer accuracy 0.310 (format gap +0.080)', then the change from step 0 where the eval has one:
    '; +0.070 [+0.040, +0.100] over step 0 (answer +0.020 [-0.010, +0.050])'; '' for rows before them."""
    text = ""
    if f"{prefix}answer_accuracy" in metrics:
        text = f", answer accuracy {metrics[f'{prefix}answer_accuracy']:.3f} (format gap " \
            f"{metrics[f'{prefix}format_gap']:+.3f})"
    changes = start_changes(metrics, prefix)
    if "strict" in changes:
        answer = changes.get("answer")
        text += f"; {changes['strict'].text()} over step 0" + (f" (answer {answer.text()})" if answer else "")
    return text


def eval_line(step: int, max_steps: int, metrics: dict, since: list[dict]) -> str:
    """One line per eval: both accuracies, the strict one with its interval, the change from step 0, then what
    training did since the last eval (step 0: how many greedy answers the budget cut, and their mean length)."""
    low, high = metrics.get("eval/accuracy_ci95_low"), metrics.get("eval/accuracy_ci95_high")
    interval = f" (95% CI {low:.3f}-{high:.3f})" if low is not None and high is not None else ""
    items = metrics.get("eval/num_items")
    head = f"eval step {step}/{max_steps}: accuracy {metrics['accuracy']:.3f}{interval}"
    head += (f" on {int(items)} items" if items is not None else "") + accuracy_text(metrics, "eval/")
    if step == 0:
        cut = f"; {cut_text(metrics)}" if "eval/truncated_rate" in metrics else ""
        return f"{head} (before training){cut}"
    if not since:
        return head
    return f"{head}; since the last eval: {step_fields(since)}"


CUT_WARN = 0.10  # a step-0 eval whose greedy answers the budget cut more often than this gets a warning line
CUT_WARNING = "step 0: the token budget cut "  # its start: preflight ignores it on the rehearsal's own budget


def cut_text(metrics: dict) -> str:
    """'2.0% of the greedy answers cut at the token budget, mean length 85.3 tokens' (eval/truncated_rate)."""
    return f"{100 * metrics['eval/truncated_rate']:.1f}% of the greedy answers cut at the token budget, mean " \
        f"length {metrics['eval/completion_length_mean']:.1f} tokens"


def cut_warning(metrics: dict, budget: int) -> str | None:
    """The step-0 eval's line when the budget cut more than CUT_WARN of its greedy answers, else None."""
    if metrics.get("eval/truncated_rate", 0.0) <= CUT_WARN:
        return None
    return (f"{CUT_WARNING}{100 * metrics['eval/truncated_rate']:.1f}% of the greedy eval answers at {budget} tokens "
            f"(more than {100 * CUT_WARN:.0f}%): a cut answer has no final answer to grade or reward; raise "
            "rollout.max_new_tokens and eval.max_new_tokens")


def final_line(step: int, metrics: dict) -> str:
    """The end-of-run eval on the whole split (eval.final_full), apart from the periodic evals; its change from
    step 0 is paired on the items step 0's eval (the eval.num_items subset) shares with it."""
    low, high = metrics[f"{FINAL.prefix}accuracy_ci95_low"], metrics[f"{FINAL.prefix}accuracy_ci95_high"]
    paired = metrics.get(f"{FINAL.prefix}change_items")
    on = f" (paired on the {int(paired)} items of step 0's eval)" if paired is not None else ""
    return (
        f"final eval step {step}: accuracy {metrics[FINAL.accuracy]:.3f} (95% CI {low:.3f}-{high:.3f}) on all "
        f"{int(metrics[f'{FINAL.prefix}num_items'])} items of the eval split{accuracy_text(metrics, FINAL.prefix)}{on}"
    )


def show_command(run_dir: str | Path, step: int | None = None, where: str | None = None) -> str:
    """`dapo-train show RUN [--step N] [--where EXPR]`, quoted for a shell."""
    command = f"dapo-train show {shlex.quote(str(run_dir))}"
    command += f" --step {step}" if step is not None else ""
    return command + (f" --where {where}" if where else "")


# What the progress lines say instead of a `dapo-train show` command when the run keeps no rollout records.
NO_RECORDS = "no rollout records to show them (logging.rollout_groups=0)"


def all_dropped_line(step: int, metrics: dict, look: str) -> str:
    """A step whose every group was dropped (Eq. 11) or screened out (dapo.screen_size): why, and where to
    `look`."""
    counts = ", ".join(f"{label} {int(metrics.get(f'groups_dropped_{key}', 0))}"
                       for key, label in (("all_correct", "all correct"), ("all_wrong", "all wrong"),
                                          ("no_variance", "no variance")))
    screened = [int(metrics.get(f"groups_screened_{side}", 0)) for side in ("all_right", "all_wrong")]
    if any(screened):
        counts += f"; screened out: all right {screened[0]}, all wrong {screened[1]}"
    rounds = metrics.get("gen_rounds", 0)
    return f"step {step}: every group dropped in {rounds} rounds ({counts}); update skipped; {look}"


def flat_reward(rows: list[dict]) -> float | None:
    """The reward_mean of the last FLAT_STEPS rows when it has not moved over them, else None."""
    values = [row["reward_mean"] for row in rows[-FLAT_STEPS:] if "reward_mean" in row]
    if len(values) < FLAT_STEPS or max(values) - min(values) > FLAT_TOLERANCE:
        return None
    return values[-1]


def flat_line(step: int, reward: float, look: str) -> str:
    return f"step {step}: the reward has not moved in {FLAT_STEPS} steps (mean {reward:.3f}); {look}"


class Progress:
    """The bar or the plain lines, and the eval lines, for one training session."""

    def __init__(self, cfg: Config, start_step: int) -> None:
        self.max_steps = cfg.train.max_steps
        self.eval_budget = eval_max_new_tokens(cfg)
        self.use_bar = cfg.logging.progress_bar
        self.run_dir, self.records = cfg.output_dir, cfg.logging.rollout_groups != 0
        self.started, self.start_step = time.monotonic(), start_step
        self.since_eval: list[dict] = []
        self.eval_accuracy: float | None = None
        self.trained_example: dict | None = None  # the latest trained completion of the rollout records
        self.recent: list[dict] = []  # the last FLAT_STEPS steps' metrics
        self.bar = tqdm(total=self.max_steps, initial=start_step, disable=not self.use_bar, desc="dapo")
        self._stack = contextlib.ExitStack()
        if self.use_bar:
            self._stack.enter_context(logging_redirect_tqdm())

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        """A step's rollout records, before its metrics row: its first trained completion is the one
        the next eval shows."""
        self.trained_example = next((r for r in records if r["fate"] == "trained"), self.trained_example)

    def log(self, step: int, metrics: dict) -> None:
        """Called with every metrics row the trainer writes (step 0: the eval before training)."""
        if step > 0:
            self.since_eval.append(metrics)
            self.bar.update(1)
            if not self.use_bar:
                logger.info("step %d/%d: %s%s", step, self.max_steps, step_fields([metrics]), self._eta(step))
            self._warn_if_stuck(step, metrics)
        if "accuracy" in metrics:
            logger.info("%s", eval_line(step, self.max_steps, metrics, self.since_eval))
            if step == 0 and (warning := cut_warning(metrics, self.eval_budget)) is not None:
                logger.warning("%s", warning)
            if step > 0 and self.trained_example is not None:
                logger.info("  a trained completion: %s", "\n  ".join(brief(self.trained_example)))
            self.since_eval, self.eval_accuracy, self.trained_example = [], metrics["accuracy"], None
        if FINAL.accuracy in metrics:
            logger.info("%s", final_line(step, metrics))
        if step > 0:
            fields = {"reward": f"{metrics['reward_mean']:.3f}", "train_acc": f"{metrics['train_accuracy']:.3f}"}
            if self.eval_accuracy is not None:
                fields["eval_acc"] = f"{self.eval_accuracy:.3f}"
            fields["ent"] = f"{metrics.get('entropy', 0.0):.3f}"
            self.bar.set_postfix(fields)

    def _warn_if_stuck(self, step: int, metrics: dict) -> None:
        """A step that dropped every group; a reward that just completed FLAT_STEPS steps unmoved."""
        if metrics.get("skipped_no_groups"):
            look = f"see them: {show_command(self.run_dir, step, 'dropped')}" if self.records else NO_RECORDS
            logger.warning("%s", all_dropped_line(step, metrics, look))
        was_flat = flat_reward(self.recent) is not None
        self.recent = [*self.recent, metrics][-FLAT_STEPS:]
        reward = flat_reward(self.recent)
        if reward is not None and not was_flat:
            look = f"see what the model writes: {show_command(self.run_dir, step)}" if self.records else NO_RECORDS
            logger.warning("%s", flat_line(step, reward, look))

    def _eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0 or step >= self.max_steps:
            return ""
        return f", eta {duration((time.monotonic() - self.started) / done * (self.max_steps - step))}"

    def close(self) -> None:
        self.bar.close()
        self._stack.close()


def _at(row: dict) -> str:
    return f"{row['accuracy']:.3f} (step {row['step']})"


def answer_lines(evals: list[dict]) -> list[str]:
    """The summary's answer accuracy and format gap, first -> last, and the last eval's change from step 0 with
    its interval (both accuracies); nothing for rows from before them."""
    first, last = evals[0], evals[-1]
    lines = []
    if "eval/answer_accuracy" in first and "eval/answer_accuracy" in last:
        lines.append(f"  answer accuracy (the gold number wherever the final answer is read): first "
                     f"{first['eval/answer_accuracy']:.3f} -> last {last['eval/answer_accuracy']:.3f}; format gap "
                     f"(answer - strict) {first['eval/format_gap']:+.3f} -> {last['eval/format_gap']:+.3f}")
    changes = start_changes(last)
    if "strict" in changes:
        answer = changes.get("answer")
        lines.append(f"  change from step 0 at step {last['step']}: {changes['strict'].text()}"
                     + (f" (answer {answer.text()})" if answer else "")
                     + f", 95% interval, paired on the {int(last['eval/change_items'])} eval items")
    return lines


def skipped_line(rows: list[dict]) -> str:
    """'  skipped steps: 1 non-finite (loss or grad norm), 5 without an informative group, of 6': always
    there, zeros included, so a run that trained on nothing cannot read as a good one."""
    steps = [row for row in rows if row.get("step", 0) > 0]
    nonfinite = sum(int(row.get("skipped_nonfinite", 0)) for row in steps)
    starved = sum(int(row.get("skipped_no_groups", 0)) for row in steps)
    return f"  skipped steps: {nonfinite} non-finite (loss or grad norm), {starved} without an informative group, " \
        f"of {len(steps)}"


def generation_line(rows: list[dict]) -> str | None:
    """'  generation: 175,576 tokens for 83,572 trained (2.10 per trained token; 92,004 on dropped groups),
    0.46 s per trained group'; None for rows without the counts (a run from before them)."""
    cost = generation_cost(rows)
    if cost["trained_tokens"] is None:
        return None
    per_token = cost["generated_per_trained_token"]
    per_group = cost["seconds_generate_per_group"]
    return (f"  generation: {cost['generated_tokens']:,.0f} tokens for {cost['trained_tokens']:,.0f} trained ("
            f"{'-' if per_token is None else f'{per_token:.2f}'} per trained token; {cost['dropped_tokens']:,.0f} on "
            f"dropped groups), {'-' if per_group is None else f'{per_group:.2f}'} s per trained group")


def update_work(rows: list[dict]) -> dict | None:
    """The update's work over metrics rows, from their update_* metrics: totals of forward, padding, head
    and trained tokens, forward and head positions per trained token, and the padding's share of the
    forward; None when no row trained."""
    totals = {f"{key}_tokens": sum(int(row.get(f"update_{key}_tokens") or 0) for row in rows)
              for key in ("forward", "padding", "head", "trained")}
    forward, trained = totals["forward_tokens"], totals["trained_tokens"]
    if not trained:
        return None
    return {**totals, "forward_per_token": forward / trained, "head_per_token": totals["head_tokens"] / trained,
            "padding_frac": totals["padding_tokens"] / forward}


def work_line(rows: list[dict]) -> str | None:
    """'  update work: 9,000 forward positions (10.0% padding), 3,000 scored by the LM head, for 2,000 trained
    tokens: 4.50 forward and 1.50 head positions per trained token': the run's totals (update_work);
    None when no step trained."""
    work = update_work(rows)
    if work is None:
        return None
    return (f"  update work: {work['forward_tokens']:,} forward positions ({100 * work['padding_frac']:.1f}% "
            f"padding), {work['head_tokens']:,} scored by the LM head, for {work['trained_tokens']:,} trained tokens: "
            f"{work['forward_per_token']:.2f} forward and {work['head_per_token']:.2f} head positions per trained "
            "token")


def end_of_run_summary(
    run_dir: Path, step: int, max_steps: int, wall_s: float, ending: str = "finished", session_s: float | None = None,
    eval_split_missing: str | None = None,  # why data.path has no eval split: `next` then suggests other data
    best_checkpoint: CheckpointScore | None = None, keep_best: bool = False,
) -> str:
    """The end-of-run report (printed): how it ended (finished, stopped by a signal, aborted or
    solved: train/health.py, regressed: train/regression.py), accuracy first -> best -> last, the answer
    accuracy and the change from step 0 with its interval (answer_lines), the steps skipped of each kind, the update's
    work, wall time (the whole run's; session_s, a resumed session's own), checkpoints and the best of them
    (checkpoint.keep_best), next."""
    head = f"finished {run_dir}: {step} steps" if ending == "finished" else f"{ending} {run_dir} at step {step} of " \
        f"{max_steps}"
    session = f" (this session: {duration(session_s)})" if session_s is not None else ""
    lines = [f"{head} in {duration(wall_s)}{session}"]
    rows = read_metrics(run_dir)
    evals = [row for row in rows if "accuracy" in row]
    if evals:
        best = max(evals, key=lambda row: row["accuracy"])
        items = evals[-1].get("eval/num_items")
        on = f" ({int(items)} eval items)" if items is not None else ""
        lines.append(f"  eval accuracy{on}: first {_at(evals[0])} -> best {_at(best)} -> last {_at(evals[-1])}")
        lines += answer_lines(evals)
        if ending == "regressed" and best["step"] == 0:
            lines.append("  no checkpoint beats the start: the best eval accuracy is step 0's, the model the run "
                         "started from (model.name_or_path)")
    else:
        lines.append("  eval accuracy: not evaluated (eval.every_steps=0)")
    finals = [row for row in rows if FINAL.accuracy in row]
    if finals:
        lines.append(f"  {final_line(finals[-1]['step'], finals[-1])}")
    lines.append(skipped_line(rows))
    generation = generation_line(rows)
    if generation is not None:
        lines.append(generation)
    work = work_line(rows)
    if work is not None:
        lines.append(work)
    checkpoints = checkpoint_dirs(run_dir)
    if checkpoints:
        names = [p.name for p in checkpoints]
        shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]} ({len(names)})"
        lines.append(f"  checkpoints in {run_dir}: {shown}")
    if best_checkpoint is not None:
        lines.append(f"  best checkpoint (checkpoint.keep_best): {best_checkpoint.name}, eval accuracy "
                     f"{best_checkpoint.accuracy:.3f} at step {best_checkpoint.step}; evaluate it: dapo-train eval "
                     f"{shlex.quote(str(run_dir))} --best")
    elif ending == "regressed":
        lines.append(f"  {best_text(None, keep_best)}")
    # stopped: StopRequested.report says how to resume; aborted: its reason names the last good checkpoint
    if checkpoints and ending in ("finished", "solved"):
        command = f"dapo-train eval {shlex.quote(str(checkpoints[-1]))}"
        lines.append(f"  next: {command}   # every item of data.eval_split" if eval_split_missing is None else
                     f"  next: {command} data.path=EVAL_DATA   # {eval_split_missing.split('; ')[0]}")
    return "\n".join(lines + rollout_lines(run_dir, rows))


def rollout_lines(run_dir: Path, rows: list[dict]) -> list[str]:
    """The summary's pointer at the rollout records: the steps that dropped every group, a reward
    that ended unmoved, or else where to read what the model wrote; nothing when none were kept."""
    if not saved_rollouts(run_dir):
        return []
    empty = [row["step"] for row in rows if row.get("skipped_no_groups")]
    trained = [row for row in rows if row.get("step", 0) > 0]
    lines = []
    if empty:
        lines.append(f"  {len(empty)} of {len(trained)} steps dropped every group (first: step {empty[0]}); see "
                     f"them: {show_command(run_dir, empty[0], 'dropped')}")
    reward = flat_reward(trained)
    if reward is not None:
        lines.append(f"  the reward did not move in the last {FLAT_STEPS} steps (mean {reward:.3f}); see what the "
                     f"model writes: {show_command(run_dir, trained[-1]['step'])}")
    return lines or [f"  rollouts (what the model wrote, and each reward): {show_command(run_dir)}"]
