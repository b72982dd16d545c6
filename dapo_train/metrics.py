"""Run logs: metrics.jsonl (one JSON object per step), two plain text logs, and an optional
tracker chosen by name.

- metrics.jsonl: every metric of a step in one object with a `step` key; stable key names.
- training_losses.txt: `step,loss`; accuracy_losses.txt: `step,accuracy` (first row = step 0,
  before any update) -- simple files that plotting scripts read as CSV.
A resumed run truncates all three to the checkpoint's step, so they never hold duplicate steps.

Result files (eval_<what>.json, completions_<what>.jsonl) are written to a temporary sibling and
renamed into place, so an interrupted eval never leaves a half-written file that a later
comparison would read as complete. JSON has no NaN/inf: such values are kept visible as strings.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

from dapo_train.errors import UserError

METRICS_FILE = "metrics.jsonl"


def json_safe(value):
    """JSON has no NaN/inf: keep such a value visible as a string instead of an invalid file."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: dict) -> None:
    _write_atomic(path, json.dumps(json_safe(data), ensure_ascii=False, indent=2) + "\n")


def write_jsonl_atomic(path: Path, records: Iterable[dict]) -> None:
    _write_atomic(path, "".join(json.dumps(json_safe(r), ensure_ascii=False) + "\n" for r in records))


class NullTracker:
    def __init__(self, run_dir: Path | None = None) -> None:
        pass

    @staticmethod
    def check() -> None:
        pass

    def log(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _summary_writer() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("logging.tracker=tensorboard needs the tensorboard package (pip install tensorboard)") from None
    return SummaryWriter


class TensorBoardTracker:
    @staticmethod
    def check() -> None:
        _summary_writer()

    def __init__(self, run_dir: Path) -> None:
        self.writer = _summary_writer()(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


# Tracker name -> the class that logs to it; its `check` says, before the run folder exists,
# whether it can start (a missing package is a UserError then, not after the model has loaded).
TRACKERS: dict[str, type] = {
    "none": NullTracker,
    "tensorboard": TensorBoardTracker,
}


def check_tracker(name: str) -> None:
    TRACKERS[name].check()


class MetricsLogger:
    """One `log(step, metrics)` call per step writes every sink."""

    def __init__(self, run_dir: str | Path, tracker: str = "none", resume_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.paths = {
            "jsonl": self.run_dir / METRICS_FILE,
            "loss": self.run_dir / "training_losses.txt",
            "accuracy": self.run_dir / "accuracy_losses.txt",
        }
        if resume_step is None:
            for path in self.paths.values():
                path.write_text("")
        else:
            self._truncate_after(resume_step)
        self.tracker = TRACKERS[tracker](self.run_dir)

    def _truncate_after(self, step: int) -> None:
        """Drop rows of steps > `step` (written after the checkpoint we resume from)."""
        for kind, path in self.paths.items():
            if not path.exists():
                path.write_text("")
                continue
            kept = []
            for line in path.read_text().splitlines():
                row_step = json.loads(line)["step"] if kind == "jsonl" else int(line.split(",")[0])
                if row_step <= step:
                    kept.append(line + "\n")
            path.write_text("".join(kept))

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

    def close(self) -> None:
        self.tracker.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
