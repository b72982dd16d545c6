"""Rollout record files in a run folder (one per step, atomic, listed by step, moved or dropped as a
whole) and their short forms for the progress log and the trackers' tables."""

import builtins
import errno
import io

import pytest

from dapo_train.run.rollouts import (
    RECORD_KEYS,
    brief,
    drop_rollouts,
    excerpt,
    read_rollouts,
    reward_breakdown,
    rollouts_after,
    saved_rollouts,
    table_rows,
    write_rollouts,
)

RECORD = {
    "step": 12, "round": 1, "group": 3, "sample": 0, "uid": "train:17", "question": "q", "gold": "42",
    "completion": "<think>\n6 × 7 = 42\n</think>\n<answer>\n42\n</answer>", "length": 21, "truncated": False,
    "extracted": "42", "correct": True, "rewards": {"accuracy": 1.0, "overlong": -0.25}, "reward": 0.75,
    "advantage": 1.2247, "fate": "trained", "behaviour_logprob_mean": -0.31, "ratio_mean": 1.02, "clip_frac": 0.0,
    "tool_calls": [], "over_calls": False, "tool_turn_spans": [],
}


def test_a_steps_records_are_one_file_cut_to_the_record_keys(tmp_path):
    path = write_rollouts(tmp_path, 12, [{**RECORD, "scratch": 1}, {**RECORD, "sample": 1}])
    assert path == tmp_path / "rollouts" / "step_12.jsonl"
    assert read_rollouts(path) == [RECORD, {**RECORD, "sample": 1}]
    assert list(read_rollouts(path)[0]) == list(RECORD_KEYS)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """The disk fills half-way through a step's file: a reader still finds the complete file that was there
    (or none, for a new step), never half of the new one, and no temporary file is left behind."""
    path = write_rollouts(tmp_path, 12, [RECORD])
    before = path.read_bytes()
    real_open = io.open

    def filling_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode or "a" in mode:
            def write(data):
                real_write(data[: len(data) // 2])
                handle.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write, handle.write = handle.write, write
        return handle

    monkeypatch.setattr(io, "open", filling_open)
    monkeypatch.setattr(builtins, "open", filling_open)
    for step in (12, 13):
        with pytest.raises(OSError, match="No space left"):
            write_rollouts(tmp_path, step, [{**RECORD, "completion": "x" * 5000, "sample": j} for j in range(4)])
    monkeypatch.undo()
    assert path.read_bytes() == before and read_rollouts(path) == [RECORD]
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_12.jsonl"]  # no step_13, no temporary file


def test_files_are_listed_by_step_and_dropped_or_split_at_a_step(tmp_path):
    for step in (10, 2, 1):
        write_rollouts(tmp_path, step, [RECORD])
    (tmp_path / "rollouts" / "notes.txt").write_text("not a step")
    assert list(saved_rollouts(tmp_path)) == [1, 2, 10]  # by number, not by name
    assert [p.name for p in rollouts_after(tmp_path, 1)] == ["step_2.jsonl", "step_10.jsonl"]
    drop_rollouts(tmp_path)
    assert saved_rollouts(tmp_path) == {} and (tmp_path / "rollouts" / "notes.txt").is_file()
    assert saved_rollouts(tmp_path / "no-run") == {}


def test_the_short_forms_are_one_line_each():
    assert excerpt("a\nb") == "'a\\nb'"
    assert excerpt("x" * 30, limit=10) == "'xxxxxxxxxx' ... (+20 chars)"
    assert reward_breakdown(RECORD) == "reward 0.750 (accuracy 1.000, overlong -0.250), advantage 1.225"
    head, text = brief(RECORD, limit=12)
    assert head == ("train:17 (step 12, trained): gold 42, got 42 (correct), 21 tokens; reward 0.750 (accuracy "
                    "1.000, overlong -0.250), advantage 1.225")
    assert text == "  '<think>\\n6 × ' ... (+37 chars)"  # 12 of the 49 characters
    (row,) = table_rows([RECORD], limit=8)
    assert row[-1] == "<think>\n ..." and "accuracy 1.000, overlong -0.250" in row
