"""The aligned table that `eval` and `compare` print (their own tests check the whole output), and the rows of
`dapo-train eval`'s table."""

import re

from dapo_train.evaluation.table import aligned_table, format_table

METRICS = {"num_items": 100, "accuracy": 0.2, "accuracy_stderr": 0.04, "accuracy_ci95_low": 0.13,
           "accuracy_ci95_high": 0.29, "answer_accuracy": 0.6, "format_gap": 0.4, "format_rate": 1.0,
           "completion_length_mean": 40.0, "completion_length_max": 50, "truncated_rate": 0.0}


def test_names_flush_left_numbers_flush_right_each_column_as_wide_as_its_widest_cell():
    lines = aligned_table(["run", "seed", "acc"], [["a", "1", "0.5"], ["long name", "12", "0.25"]], left=2)
    # Widths 9, 4, 4 (the widest cell of each column); two spaces between; the first two flush left.
    assert lines == [
        "run        seed   acc",
        "---------  ----  ----",
        "a          1      0.5",
        "long name  12    0.25",
    ]


def test_the_eval_table_shows_both_accuracies_and_the_change_from_step_0():
    """Strict 20%, answer 60% (the gap, +40 points, is format); the checkpoint of a run with step-0 records also
    gets its change from step 0 in points, and a model without them a dash."""
    graded = METRICS
    changed = {**graded, "change": 0.07, "change_low": 0.04, "change_high": 0.1, "answer_change": -0.02,
               "answer_change_low": -0.05, "answer_change_high": 0.01, "change_items": 100}
    lines = format_table([("run/checkpoint_40", changed, []), ("base", graded, [])]).splitlines()
    headers = re.split(r"\s{2,}", lines[0])
    row = dict(zip(headers, re.split(r"\s{2,}", lines[2])))
    assert (row["accuracy"], row["answer"], row["format gap"]) == ("20.0%", "60.0%", "+40.0")
    assert (row["Δ from step 0"], row["Δ answer"]) == ("+7.0 [+4.0, +10.0]", "-2.0 [-5.0, +1.0]")
    assert re.split(r"\s{2,}", lines[3])[-2:] == ["-", "-"]
    assert lines[-1].startswith("Δ from step 0: against the run's own eval before training") and "the 100 items" in \
        lines[-1]
    plain = format_table([("base", graded, [])]).splitlines()
    assert "Δ from step 0" not in plain[0] and plain[-1].startswith("accuracy: strict")
