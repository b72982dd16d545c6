"""Evaluation output: the comparison table and the result files, written atomically.

A file is written to a temporary sibling and renamed into place, so an interrupted eval never
leaves a half-written eval_<split>.json that a later comparison would read as complete.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Sequence


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


# Column header -> how one row's metrics render in it (K = samples per item).
_BASE_COLUMNS = (
    ("items", lambda m, k: str(m["num_items"])),
    ("accuracy", lambda m, k: _percent(m["accuracy"])),
    ("stderr", lambda m, k: f"{100 * m['accuracy_stderr']:.1f}"),
    ("95% CI", lambda m, k: f"[{100 * m['accuracy_ci95_low']:.1f}, {100 * m['accuracy_ci95_high']:.1f}]"),
    ("format", lambda m, k: _percent(m["format_rate"])),
    ("len mean", lambda m, k: f"{m['completion_length_mean']:.1f}"),
    ("len max", lambda m, k: str(m["completion_length_max"])),
    ("truncated", lambda m, k: _percent(m["truncated_rate"])),
)
_SAMPLED_COLUMNS = (
    ("pass@1", lambda m, k: _percent(m["pass@1"])),
    ("pass@K", lambda m, k: _percent(m[f"pass@{k}"])),
    ("maj@K", lambda m, k: _percent(m[f"maj@{k}"])),
)


def format_table(rows: Sequence[tuple[str, dict]], samples: int = 1) -> str:
    """One line per evaluated target, columns aligned; stderr and the CI in accuracy points."""
    columns = _BASE_COLUMNS + (_SAMPLED_COLUMNS if samples > 1 else ())
    headers = ["model"] + [name.replace("K", str(samples)) for name, _ in columns]
    body = [[label] + [render(metrics, samples) for _, render in columns] for label, metrics in rows]
    widths = [max(len(line[i]) for line in [headers, *body]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first] + [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])])

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(cells) for cells in body])


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
