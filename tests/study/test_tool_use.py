"""scripts/studies/tool_use.py on hand-written runs: the windows' ratios of sums, the paired change, and the
rollout records' bare-number calls."""

import json

import pytest

from dapo_train.config.load import load_config, save_config
from dapo_train.run.rollouts import rollouts_path

import tool_use


def _call(expression: str, error: bool = False) -> dict:
    text = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return {"name": "calculator", "text": text, "result": "1", "error": error}


def test_windows_are_ratios_of_sums_and_bare_numbers_are_counted(tmp_path):
    """Steps 1-2: 10 + 30 completions, 10 + 50 calls (1.5 per completion), 1 + 2 errors (3 / 60 = 0.05), tool
    use 0.5 x 10 + 1.0 x 30 over 40 = 0.875; steps 3-4: 20 calls over 20 completions, no error, all used.
    The records: 3 calls, one of them "42" (a bare number): 1/3; the right completion made 2 calls, the
    wrong one 1."""
    run = tmp_path / "calc"
    run.mkdir()
    save_config(load_config(None, ["rollout.tools=[calculator]", f"output_dir={run}"]), run / "config.yaml")
    rows = [{"step": 0, "accuracy": 0.9},
            {"step": 1, "completions": 10, "tool_calls": 10, "tool_errors": 1, "tool_use_ratio": 0.5},
            {"step": 2, "completions": 30, "tool_calls": 50, "tool_errors": 2, "tool_use_ratio": 1.0},
            {"step": 3, "completions": 10, "tool_calls": 10, "tool_errors": 0, "tool_use_ratio": 1.0},
            {"step": 4, "completions": 10, "tool_calls": 10, "tool_errors": 0, "tool_use_ratio": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert tool_use.window_rates(rows, 1, 2) == pytest.approx(
        {"calls_per_completion": 1.5, "error_share": 0.05, "use_share": 0.875})
    assert tool_use.window_rates(rows, 3, 4) == pytest.approx(
        {"calls_per_completion": 1.0, "error_share": 0.0, "use_share": 1.0})
    assert tool_use.window_rates(rows, 5, 9) is None
    records = [{"step": 1, "correct": True, "tool_calls": [_call("6 × 9"), _call("42")]},
               {"step": 1, "correct": False, "tool_calls": [_call("50 - 40", error=True)]}]
    path = rollouts_path(run, 1)  # the two keys the script reads of each record, as a run writes them
    path.parent.mkdir()
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    (record,) = [tool_use.record_stats(r) for r in tool_use.load_runs([str(run)])]
    assert record == pytest.approx({"bare_share": 1 / 3, "calls_right": 2.0, "calls_wrong": 1.0})
    text = tool_use.report([str(run)], window=2)
    assert "1.500" in text and "0.050" in text and "0.875" in text  # one seed: the mean alone
    assert "last-first" in text and "-0.500" in text  # calls per completion 1.5 -> 1.0
    assert "bare-number calls 0.333" in text
