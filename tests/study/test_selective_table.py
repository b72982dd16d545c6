"""scripts/studies/selective_table.py on hand-written runs: sums over steps, prompts drawn, the .time file,
accuracy at the baseline's training seconds, and the paired table."""

import json

import pytest

import selective_table


def _run(folder, name, rows, time_line):
    run = folder / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{name}.time").write_text(time_line)
    return run


def _step(step, generated, trained, kept, seconds, **extra):
    return {"step": step, "generated_tokens": generated, "trained_tokens": trained, "groups_kept": kept,
            "seconds_step": seconds, **extra}


OFF = [{"step": 0, "accuracy": 0.10},
       _step(1, 300, 100, 2, 5.0, groups_dropped_all_wrong=3, gen_rounds=2, seconds_generate=3.0),
       _step(2, 100, 100, 2, 5.0, groups_dropped_all_correct=1, gen_rounds=1, buffer_size=1,
             seconds_generate=1.0, accuracy=0.30, final_accuracy=0.25)]
SCREENED = [{"step": 0, "accuracy": 0.10},
            _step(1, 150, 100, 2, 6.0, groups_screened_all_wrong=4, prompts_skipped=2, gen_rounds=3,
                  batch_short=0, accuracy=0.20),
            _step(2, 150, 50, 1, 6.0, groups_screened_all_wrong=1, gen_rounds=4, batch_short=1,
                  accuracy=0.40, final_accuracy=0.35)]


def test_a_run_is_summed_over_its_steps(tmp_path):
    """off: 400 generated / 200 trained = 2; drawn 4 kept + 1 left in the buffer + 4 dropped = 9; CPU 10 + 2."""
    off = selective_table.run_outcomes(_run(tmp_path, "off_seed1", OFF, "10.0 2.0 15.5\n"))
    assert off["gen/trained"] == pytest.approx(2.0)
    assert (off["groups"], off["drawn"], off["rounds"], off["gen s"]) == (4, 9, 3, 4.0)
    assert (off["CPU s"], off["wall s"], off["train s"]) == (12.0, 15.5, 10.0)
    assert (off["final acc"], off["last acc"]) == (0.25, 0.30)
    screened = selective_table.run_outcomes(_run(tmp_path, "s_seed1", SCREENED, "1 1 1\n"))
    assert screened["drawn"] == 3 + 5 + 2  # kept, ruled out by the screen, skipped on history
    assert (screened["screened out"], screened["skipped"], screened["short"]) == (5, 2, 1)
    # within off's 10 training seconds the screened run had made the eval after step 1 (6 s), not step 2 (12 s)
    assert selective_table.accuracy_within(screened, 10.0) == 0.20
    assert selective_table.accuracy_within(screened, 5.0) == 0.10  # only step 0's


def test_an_unfinished_run_is_left_out(tmp_path):
    _run(tmp_path, "off_seed1", OFF, "Command exited with non-zero status 1\n10.0 2.0 15.5\n")
    _run(tmp_path, "off_seed2", OFF, "")
    _run(tmp_path, "off_seed3", OFF, "10.0 2.0 15.5\n")
    assert list(selective_table.load(tmp_path)["off"]) == [3]


def test_the_paired_table_differences_seed_by_seed(tmp_path):
    """Two seeds, the screened runs the same: gen/trained 300/150 - 2 = 0 each seed (an interval of width 0);
    CPU 2 - 12 = -10 (-83.3%); accuracy at off's seconds 0.20 - 0.30 = -0.100."""
    for seed in (1, 2):
        _run(tmp_path, f"off_seed{seed}", OFF, "10.0 2.0 15.5\n")
        _run(tmp_path, f"s_seed{seed}", SCREENED, "1 1 1\n")
    text = selective_table.tables(selective_table.load(tmp_path), "off")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert "| 2 | 2.00 ± 0.00 |" in rows["off"]
    assert "+0.000 [+0.000, +0.000] (+0.0%)" in rows["generated tokens per trained token"]
    assert "-10.0 [-10.0, -10.0] (-83.3%)" in rows["CPU seconds (user + system)"]
    assert "-0.100 [-0.100, -0.100] |" in rows[selective_table.EQUAL_TIME]
    assert "+0.100 [+0.100, +0.100] |" in rows["final accuracy (whole eval split)"]
