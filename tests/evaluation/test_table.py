"""The aligned table that `eval` and `compare` print (their own tests check the whole output)."""

from dapo_train.evaluation.table import aligned_table


def test_names_flush_left_numbers_flush_right_each_column_as_wide_as_its_widest_cell():
    lines = aligned_table(["run", "seed", "acc"], [["a", "1", "0.5"], ["long name", "12", "0.25"]], left=2)
    # Widths 9, 4, 4 (the widest cell of each column); two spaces between; the first two flush left.
    assert lines == [
        "run        seed   acc",
        "---------  ----  ----",
        "a          1      0.5",
        "long name  12    0.25",
    ]
