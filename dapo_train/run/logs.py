"""Run logs: metrics.jsonl (one JSON object per step) and two plain text logs.

- metrics.jsonl: every metric of a step in one object with a `step` key; stable key names.
- training_losses.txt: `step,loss`; accuracy_losses.txt: `step,accuracy` (first row = step 0,
  before any update) -- simple files that plotting scripts read as CSV.
A resumed run appends to all three; their rows past the checkpoint's step were split off first
(split_logs), so they never hold duplicate steps. The same rows go to the trackers (run/trackers.py).
- run.log: what the main process says from the moment its run folder is opened (RunLog), because the
  console may not keep it: `| tee log` dies with the Ctrl-C that stops the run. A resumed run appends.
- run_status.json: how the last session ended, as a record a study reads (`compare`'s status column):
  {"status": ..., "step": ...}, status one of running (the session has not ended: it runs, or was killed),
  finished, stopped, aborted, solved, regressed, out of memory, error, interrupted, crashed.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path

from dapo_train.errors import UserError
from dapo_train.run.files import json_safe, read_jsonl, write_json_atomic
from dapo_train.run.trackers import NullTracker

METRICS_FILE = "metrics.jsonl"
# MetricsLogger's sinks: kind -> file name in the run folder.
LOG_FILES = {"jsonl": METRICS_FILE, "loss": "training_losses.txt", "accuracy": "accuracy_losses.txt"}
RUN_LOG = "run.log"
RUN_STATUS = "run_status.json"
_RUN_LOG_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")


class RunLog:
    """run.log, a context around a training session: every log line of the process (at the level the
    command set), the end-of-run summary and the resume command (say), and how the session ended when it
    raised, in the command's words (`stopped: ...`, `aborted: ...`, `solved: ...`, `error: ...`,
    `interrupted` for a second Ctrl-C) or, for a bug, its traceback; and the same ending as a record,
    run_status.json ("running" while the session runs)."""

    def __init__(self, run_dir: str | Path, resumed: bool) -> None:
        self.path = Path(run_dir) / RUN_LOG
        self.handler = logging.FileHandler(self.path, mode="a" if resumed else "w", encoding="utf-8")
        self.handler.setFormatter(_RUN_LOG_FORMAT)
        self.step: int | None = None  # the step the session ended at (end)

    def __enter__(self) -> RunLog:
        logging.getLogger().addHandler(self.handler)
        write_status(self.path.parent, "running")
        return self

    def __exit__(self, kind, exc, tb) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()
        if exc is not None:
            self.write(_ending(exc))
            otherwise = "interrupted" if isinstance(exc, KeyboardInterrupt) else "crashed"
            write_status(self.path.parent, getattr(exc, "verdict", None) or otherwise, self.step)

    def end(self, status: str, step: int) -> None:
        """How the session ended (finished, stopped, aborted, solved, regressed), at which step: run_status.json.
        A verdict raised after it (__exit__) keeps the step."""
        self.step = step
        write_status(self.path.parent, status, step)

    def say(self, text: str, stream=None) -> None:
        """`text` on the console (stdout unless `stream`) and in run.log."""
        print(text, file=stream or sys.stdout, flush=True)
        self.write(text)

    def write(self, text: str) -> None:
        """`text` in run.log alone. A log that cannot be written (the disk that stopped the run) is no
        reason to fail: the console has the text too."""
        try:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError:
            pass


def write_status(run_dir: Path, status: str, step: int | None = None) -> None:
    write_json_atomic(Path(run_dir) / RUN_STATUS, {"status": status, "step": step})


def read_status(run_dir: Path) -> dict | None:
    """run_status.json as the run wrote it; None for a run from before it (or one whose record is damaged)."""
    try:
        record = json.loads((Path(run_dir) / RUN_STATUS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("status"), str) else None


def _ending(exc: BaseException) -> str:
    verdict = getattr(exc, "verdict", None)
    if verdict is not None:
        return f"{verdict}: {exc}"
    if isinstance(exc, UserError):
        return f"error: {exc}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "".join(traceback.format_exception(exc)).rstrip()


class MetricsLogger:
    """One `log(step, metrics)` call per step writes every sink."""

    def __init__(self, run_dir: str | Path, tracker=None, resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.paths = {kind: self.run_dir / name for kind, name in LOG_FILES.items()}
        for path in self.paths.values():
            if resume_step is None or not path.exists():
                path.write_text("")
        self.tracker = tracker or NullTracker()

    def log(self, step: int, metrics: dict) -> None:
        row = json_safe({"step": step, **metrics})
        with self.paths["jsonl"].open("a") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        if "loss" in metrics:
            with self.paths["loss"].open("a") as f:
                f.write(f"{step},{metrics['loss']}\n")
        if "accuracy" in metrics:
            with self.paths["accuracy"].open("a") as f:
                f.write(f"{step},{metrics['accuracy']}\n")
        self.tracker.log(step, metrics)

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        """A step's rollout records (already in rollouts/) to the trackers' tables."""
        self.tracker.log_rollouts(step, records)

    def close(self) -> None:
        self.tracker.close()


def _row_step(kind: str, line: str) -> int | None:
    """The step a log line belongs to; None for a line cut short (a kill during the write)."""
    try:
        return int(json.loads(line)["step"]) if kind == "jsonl" else int(line.split(",")[0])
    except (ValueError, KeyError, TypeError):
        return None


def split_logs(run_dir: str | Path, step: int) -> dict[str, tuple[str, str]]:
    """Each log file of the run folder -> (its rows of steps <= `step`, the rest), as text: what a run
    resumed at `step` keeps, and what came after it (a line cut short goes with the rest)."""
    parts = {}
    for kind, name in LOG_FILES.items():
        path = Path(run_dir) / name
        kept, later = [], []
        for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
            row_step = _row_step(kind, line)
            (kept if row_step is not None and row_step <= step else later).append(line + "\n")
        parts[name] = ("".join(kept), "".join(later))
    return parts


def read_metrics(run_dir: str | Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / METRICS_FILE)


def generation_cost(rows: list[dict]) -> dict[str, float | None]:
    """What the trained tokens of a run's steps (metrics rows) cost in generation, as ratios of sums
    over the steps: generated_tokens, dropped_tokens (on groups Eq. 11 or a screen dropped), trained_tokens,
    generated_per_trained_token and seconds_generate_per_group (None where nothing trained, or the rows
    predate these metrics)."""
    rows = [row for row in rows if isinstance(row.get("trained_tokens"), (int, float))]
    sums = {key: sum(float(row.get(key) or 0) for row in rows)
            for key in ("generated_tokens", "dropped_tokens", "trained_tokens", "seconds_generate", "groups_kept")}
    return {
        "generated_tokens": sums["generated_tokens"] if rows else None,
        "dropped_tokens": sums["dropped_tokens"] if rows else None,
        "trained_tokens": sums["trained_tokens"] if rows else None,
        "generated_per_trained_token": sums["generated_tokens"] / sums["trained_tokens"] if sums["trained_tokens"]
        else None,
        "seconds_generate_per_group": sums["seconds_generate"] / sums["groups_kept"] if sums["groups_kept"] else None,
    }
