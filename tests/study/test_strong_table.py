"""scripts/studies/strong_table.py on hand-written runs: each run's final eval paired with the start item by item,
the warning counted from the run's log, an unfinished run left out."""

import json

import pytest

import strong_table

# 4 items; the start gets items 0 and 1 right (strict), and item 2 right only by the answer grading.
START = [(1, 1), (1, 1), (0, 1), (0, 0)]


def _write(path, pairs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"uid": f"test:{i}", "gold": "1", "correct": bool(c), "answer_correct": bool(a)})
                            + "\n" for i, (c, a) in enumerate(pairs)))


def _run(study, name, pairs, log="", time_line="80.0 2.0 100.0\n"):
    _write(study / name / "eval_items" / "final_40.jsonl", pairs)
    (study / f"{name}.log").write_text(log)
    (study / f"{name}.time").write_text(time_line)


def test_a_recipe_is_paired_with_the_start_and_its_warnings_counted(tmp_path):
    """seed 1 loses item 1 (strict 0.25), seed 2 also gains item 2 (0.50): strict after = 0.375, before 0.5, so
    -0.125; answer: seed 1 keeps the start's three (0.75), seed 2 loses item 1 (0.5): 0.625 - 0.75 = -0.125."""
    _write(tmp_path / "start" / "completions_test.jsonl", START)
    _run(tmp_path, "demo_seed1", [(1, 1), (0, 1), (0, 1), (0, 0)],
         log="step 20: the model is worse than at step 0 on the same 100 eval items, ...\n")
    _run(tmp_path, "demo_seed2", [(1, 1), (0, 0), (1, 1), (0, 0)])
    (tmp_path / "demo_seed3").mkdir()  # not finished: no final eval
    _run(tmp_path, "demo_seed4", [(1, 1)] * 4, time_line="")  # its final eval written, the process not yet ended
    start, runs = strong_table.load(tmp_path)
    assert list(runs) == ["demo"] and sorted(runs["demo"]) == [1, 2]
    found = strong_table.changes(start, runs["demo"], [f"test:{i}" for i in range(4)])
    assert found["strict"].baseline_accuracy == pytest.approx(0.5)
    assert found["strict"].difference == pytest.approx(-0.125)
    assert found["answer"].difference == pytest.approx(-0.125)
    assert found["strict"].low <= -0.125 <= found["strict"].high
    assert (found["warned"], found["seconds"]) == (1, 80.0)
    # each run alone on 4 items: seed 1's -0.25 (one item lost) is inside its own interval's noise, so its warning
    # counts as one given while its own interval holds 0
    assert found["alone"] == 0 and found["warned_holding_0"] == 1
