"""What a run says while it trains (the end-of-run summary: summary.py).

- The tqdm bar (logging.progress_bar) labels its fields, so eval and train accuracy are never
  confused: `reward`, `train_acc` (this step's rollouts), `eval_acc` (the last eval), `ent`.
- Without the bar (server logs, CI) every step logs one plain line instead.
- Every eval logs one line: step, accuracy with its 95% interval, the answer accuracy and the format
  gap, the change from step 0 with its 95% paired interval ("+0.070 [+0.040, +0.100] over step 0"),
  and the means since the last eval of reward, train accuracy, entropy, clip fractions, the rollout's
  KL to the training forward (rollout_kl) and seconds per step. Step 0's says what share of its greedy
  answers the token budget cut, and their mean length; more than CUT_WARN cut is a warning line. With
  eval.samples, the sampled eval's pass@1, maj@K and pass@K, each with its change from step 0 (step 0's:
  what it cost beside the greedy eval).
- Every eval also shows one trained completion (the latest in the rollout records) in two lines:
  its answer, its reward breakdown and the start of what it wrote.
- A step that dropped every group, and a reward that has not moved in FLAT_STEPS steps, each get a
  line saying so and the `dapo-train show` command that shows what the model wrote; the end-of-run
  summary says the same.
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
from dapo_train.evaluation.sampled import sampled_text
from dapo_train.run.eval_items import FINAL, PERIODIC, SAMPLED
from dapo_train.run.rollouts import brief
from dapo_train.train.regression import start_changes

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
    """One line per eval: both accuracies, the strict one with its interval, the change from step 0, the sampled
    eval's (eval.samples), then what training did since the last eval (step 0: how many greedy answers the budget
    cut, and their mean length, and what the sampled eval cost)."""
    low, high = metrics.get("eval/accuracy_ci95_low"), metrics.get("eval/accuracy_ci95_high")
    interval = f" (95% CI {low:.3f}-{high:.3f})" if low is not None and high is not None else ""
    items = metrics.get("eval/num_items")
    head = f"eval step {step}/{max_steps}: accuracy {metrics['accuracy']:.3f}{interval}"
    head += (f" on {int(items)} items" if items is not None else "") + accuracy_text(metrics, "eval/")
    sampled = sampled_text(metrics, SAMPLED.prefix)
    if step == 0:
        cut = f"; {cut_text(metrics)}" if "eval/truncated_rate" in metrics else ""
        cost = f" ({metrics[SAMPLED.seconds]:.1f} s beside the greedy eval's {metrics[PERIODIC.seconds]:.1f} s)" \
            if sampled else ""
        return f"{head} (before training){cut}" + (f"; {sampled}{cost}" if sampled else "")
    head += f"; {sampled}" if sampled else ""
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
