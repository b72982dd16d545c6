"""The end-of-run summary a run prints, and run.log keeps: how it ended, eval accuracy first -> best -> last, the
answer accuracy and the last eval's change from step 0 with its interval, the sampled eval's (eval.samples) the
same way, the final accuracy on the whole eval split (eval.final_full), the steps skipped of each kind
(non-finite, without an informative group), what generation cost per trained token and group, the update's work
over the run (positions its forwards computed, of which padding, and those the LM head scored, per trained
token), wall time, the checkpoints, and the command to run next. It reads the run's metrics.jsonl, so a resumed
run's summary covers every session.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from dapo_train.evaluation.sampled import SHOWN, change_text, score_label
from dapo_train.run.checkpoint import CheckpointScore, checkpoint_dirs
from dapo_train.run.eval_items import FINAL, SAMPLED
from dapo_train.run.logs import generation_cost, read_metrics
from dapo_train.run.rollouts import saved_rollouts
from dapo_train.train.progress import FLAT_STEPS, duration, final_line, flat_reward, show_command
from dapo_train.train.regression import best_text, start_changes


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


def sampled_line(evals: list[dict]) -> str | None:
    """'  sampled eval (eval.samples, 8 an item): pass@1 0.613 -> 0.640, +0.027 [+0.004, +0.050]; maj@8 ...; pass@8
    ...': first -> last sampled eval, with the last one's change from step 0; None without a sampled eval."""
    rows = [row for row in evals if SAMPLED.accuracy in row]
    if not rows:
        return None
    first, last = rows[0], rows[-1]
    samples = int(last[f"{SAMPLED.prefix}samples"])
    parts = []
    for name in SHOWN:
        key = f"{SAMPLED.prefix}{name}"
        change = f", {change_text(last, key)}" if f"{key}_change" in last else ""
        parts.append(f"{score_label(name, samples)} {first[key]:.3f} -> {last[key]:.3f}{change}")
    steps = f"step {first['step']} -> {last['step']}"
    paired = f"; change from step 0, 95% interval, paired on the {int(last[f'{SAMPLED.prefix}change_items'])} " \
        "eval items" if f"{SAMPLED.prefix}change_items" in last else ""
    return f"  sampled eval (eval.samples, {samples} an item; {steps}{paired}): {'; '.join(parts)}"


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
    tokens: 4.50 forward and 1.50 head positions per trained token; besides, 1,868 positions the out-of-memory
    guard ran once': the run's totals (update_work), and what the guard ran apart from them (its probes,
    train/update/out_of_memory.py); None when no step trained."""
    work = update_work(rows)
    if work is None:
        return None
    probed = sum(int(row.get("update_probe_positions") or 0) for row in rows)
    return (f"  update work: {work['forward_tokens']:,} forward positions ({100 * work['padding_frac']:.1f}% "
            f"padding), {work['head_tokens']:,} scored by the LM head, for {work['trained_tokens']:,} trained tokens: "
            f"{work['forward_per_token']:.2f} forward and {work['head_per_token']:.2f} head positions per trained "
            "token" + (f"; besides, {probed:,} positions the out-of-memory guard ran, its gradient dropped"
                       if probed else ""))


def end_of_run_summary(
    run_dir: Path, step: int, max_steps: int, wall_s: float, ending: str = "finished", session_s: float | None = None,
    eval_split_missing: str | None = None,  # why data.path has no eval split: `next` then suggests other data
    best_checkpoint: CheckpointScore | None = None, keep_best: bool = False,
) -> str:
    """The end-of-run report (printed): how it ended (finished, stopped by a signal, aborted or
    solved: train/health.py, regressed: train/regression.py), accuracy first -> best -> last, the answer
    accuracy and the change from step 0 with its interval (answer_lines), the sampled eval's (sampled_line), the
    steps skipped of each kind, the update's work, wall time (the whole run's; session_s, a resumed session's
    own), checkpoints and the best of them (checkpoint.keep_best), next."""
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
        sampled = sampled_line(evals)
        lines += [sampled] if sampled else []
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
