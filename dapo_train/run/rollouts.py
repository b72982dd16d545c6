"""Rollout records inside a run folder: what the policy wrote in the rollouts a step generated, and
why each completion got its reward.

    rollouts/step_<N>.jsonl   the groups step N generated that logging.rollout_groups sampled

One JSON object per completion (RECORD_KEYS), ordered by generation round, group and completion:
where it came from (step, round, group: its prompt's position in the round's batch over all ranks,
sample: its index in the group, uid, question, gold), what it wrote (completion, length in tokens with
EOS, tool turns included, truncated, extracted: the task's answer in the policy's own text or None,
tool_calls: each call it made with rollout.tools, {name, text: the call as written, result, error};
over_calls: it ended by a turn whose calls would pass rollout.max_tool_calls; tool_turn_spans: the
[start, end) character spans of `completion` that are tool turns, context the policy did not write; the
last three absent in folders from before them), why it scored so (correct, rewards: each
configured reward's unweighted value under its metrics key, as in `rewards/<key>/mean`; reward: the
weighted total, Eq. 9's R; advantage, Eq. 9), what became of its group (fate, FATES), and where cheap
what the update saw: behaviour_logprob_mean (the mean log-prob of its tokens under the policy that
sampled them; None when the engine records none), ratio_mean and clip_frac (the mean ratio of its
tokens and the share of them the objective clipped, over the passes that trained it; None unless its
fate is `trained`).

Written by the main process, atomically, once per step with every rank's sampled groups. A fresh
run in an old folder drops the files, as its logs start anew; a resumed run moves the files of steps
after its checkpoint aside with the rest (folder.set_aside_abandoned), so the folder never holds
records of a trajectory the run no longer follows. `dapo-train show` reads them (study/show.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dapo_train.run.files import read_jsonl, write_jsonl_atomic

ROLLOUTS_DIR = "rollouts"
RECORD_KEYS = (
    "step", "round", "group", "sample", "uid", "question", "gold", "completion", "length", "truncated", "extracted",
    "correct", "rewards", "reward", "advantage", "fate", "behaviour_logprob_mean", "ratio_mean", "clip_frac",
    "tool_calls", "over_calls", "tool_turn_spans",
)
# A group's fate -> what it means. The dropped and screened ones are generation_stats.CollectStats' counters
# (groups_dropped_*, groups_screened_* in metrics.jsonl; a screened group has only its screen's completions);
# trained and update_skipped ones count in groups_kept, carried ones in the later steps' groups_carried.
FATES = {
    "trained": "trained this step",
    "update_skipped": "not trained: the update skipped it (a non-finite loss or gradient norm, or fp16's loss scaler, "
                      "skipped each optimizer step that would have trained it, or the update ended first)",
    "carried": "kept, and carried over to a later step (the batch was full)",
    "dropped_all_correct": "every completion correct (Eq. 11)",
    "dropped_all_wrong": "every completion wrong (Eq. 11)",
    "dropped_no_variance": "the filter metric (dapo.filter_metric) did not vary, correct bits mixed (Eq. 11)",
    "screened_all_right": "its screen (dapo.screen_size completions, all it got) all correct: ruled out",
    "screened_all_wrong": "its screen (dapo.screen_size completions, all it got) all wrong: ruled out",
}
_FILE_RE = re.compile(r"^step_(\d+)\.jsonl$")


def rollouts_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"


def write_rollouts(run_dir: Path, step: int, records: list[dict]) -> Path:
    """A step's records, each cut to RECORD_KEYS, in one atomic write."""
    path = rollouts_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(path, [{key: record[key] for key in RECORD_KEYS} for record in records])
    return path


def saved_rollouts(run_dir: Path) -> dict[int, Path]:
    """step -> file, for every rollout file of the run, by step."""
    folder = Path(run_dir) / ROLLOUTS_DIR
    found = {}
    for path in folder.iterdir() if folder.is_dir() else []:
        if match := _FILE_RE.match(path.name):
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def rollouts_after(run_dir: Path, step: int | None) -> list[Path]:
    """The rollout files of steps after `step` (None: all of them)."""
    return [path for saved, path in saved_rollouts(run_dir).items() if step is None or saved > step]


def drop_rollouts(run_dir: Path) -> None:
    """A fresh run in an old folder without checkpoints starts its records anew, as its logs do."""
    for path in rollouts_after(run_dir, None):
        path.unlink()


def read_rollouts(path: Path) -> list[dict]:
    return read_jsonl(path)


# Keys a record from before them lacks -> the value it reads as.
LATER_KEYS = {"tool_calls": [], "over_calls": False, "tool_turn_spans": []}
_CALL_TYPES = {"name": str, "text": str, "result": str, "error": bool}


def read_whole_rollouts(path: Path) -> tuple[list[dict], list[int]]:
    """The whole records of a rollout file (LATER_KEYS filled in where absent) and the numbers of the lines
    that are not one, skipped: a line cut short (a copy stopped, a disk filled) or edited out of shape."""
    records, skipped = [], []
    lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        record = _whole_record(line)
        if record is None:
            skipped.append(number)
        else:
            records.append(record)
    return records, skipped


def _whole_record(line: str) -> dict | None:
    """One line as a record with every key and the types `show` reads, or None."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or not set(RECORD_KEYS) - set(LATER_KEYS) <= set(record):
        return None
    record = {**LATER_KEYS, **record}
    numbers = [record["reward"], record["advantage"], *record["rewards"].values()] \
        if isinstance(record["rewards"], dict) else [None]
    optional = [record[key] for key in ("behaviour_logprob_mean", "ratio_mean", "clip_frac")]
    calls, spans, text = record["tool_calls"], record["tool_turn_spans"], record["completion"]
    whole = (all(map(_is_number, numbers)) and all(value is None or _is_number(value) for value in optional)
             and isinstance(text, str) and isinstance(calls, list) and all(map(_is_call, calls))
             and isinstance(spans, list) and _in_order(spans, len(text)))
    return record if whole else None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_call(call: object) -> bool:
    return isinstance(call, dict) and all(isinstance(call.get(key), kind) for key, kind in _CALL_TYPES.items())


def _in_order(spans: list, length: int) -> bool:
    """[start, end] pairs of ints, in order and apart, within a text of `length` characters."""
    cursor = 0
    for span in spans:
        if not (isinstance(span, list) and len(span) == 2 and all(type(i) is int for i in span)
                and cursor <= span[0] <= span[1] <= length):
            return False
        cursor = span[1]
    return True


# --------------------------------------------------------------------------------------------
# Short forms, for the progress log and the trackers' tables.


def excerpt(text: str, limit: int = 160) -> str:
    """`text` on one line, as a Python literal (newlines shown as \\n), cut to about `limit` characters
    with the number of characters left out: a log line stays one line, however long the completion."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r} ... (+{len(text) - limit} chars)"


def reward_breakdown(record: dict) -> str:
    """'reward 0.750 (accuracy 1.000, overlong -0.250), advantage 1.225': the total (Eq. 9's R) and
    each reward's unweighted value."""
    parts = ", ".join(f"{key} {value:.3f}" for key, value in record["rewards"].items())
    return f"reward {record['reward']:.3f} ({parts}), advantage {record['advantage']:.3f}"


def brief(record: dict, limit: int = 160) -> list[str]:
    """Two lines about one completion: where it came from, its answer and its reward breakdown;
    then the start of what it wrote; then a line per tool call it made, with the tool's answer."""
    verdict = "correct" if record["correct"] else "wrong"
    cut = ", truncated" if record["truncated"] else ""
    calls = [f"  call {call['name'] or '?'}: {excerpt(call['text'], limit)} -> {excerpt(call['result'], limit)}"
             for call in record.get("tool_calls", [])]
    return [
        f"{record['uid']} (step {record['step']}, {record['fate']}): gold {record['gold']}, got "
        f"{record['extracted']} ({verdict}), {record['length']} tokens{cut}; {reward_breakdown(record)}",
        f"  {excerpt(record['completion'], limit)}",
        *calls,
    ]


TABLE_COLUMNS = ("step", "group", "sample", "fate", "uid", "gold", "extracted", "correct", "reward", "rewards",
                 "advantage", "length", "truncated", "completion")


def table_rows(records: list[dict], limit: int = 0) -> list[list]:
    """The records as rows of TABLE_COLUMNS (rewards as 'key value' pairs; completions cut to `limit`
    characters when limit > 0), for a tracker's table."""
    rows = []
    for record in records:
        row = {**record, "rewards": ", ".join(f"{key} {value:.3f}" for key, value in record["rewards"].items())}
        text = record["completion"]
        row["completion"] = text if not limit or len(text) <= limit else text[:limit] + " ..."
        rows.append([row[column] for column in TABLE_COLUMNS])
    return rows
