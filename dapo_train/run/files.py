"""Files a run or a study writes whole or not at all, and the JSON Lines reader.

Result files (eval_<what>.json, completions_<what>.jsonl, per-item records, sweep.json) are written to
a temporary sibling and renamed into place, so an interrupted write never leaves a half-written file
that a later comparison would read as complete. JSON has no NaN/inf: such values are kept visible as
strings.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path


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


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON Lines file (metrics.jsonl, eval_items/*.jsonl), blank lines skipped."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
