"""scripts/studies/regression_sim.py: its simulated items flip as stated, flat runs of 30 evals stay under the
stop's 1% bound with the code's own test and verdict, a collapse stops at the first eval, the old rule's
interval calls 4 items lost "below 0", and the real runs' table reads a run folder."""

import json

import numpy as np
import regression_sim


def test_the_simulated_items_flip_as_stated():
    """An unchanged model's fresh eval grades a share `flips` of the items differently from step 0."""
    world = regression_sim.World(20_000, 0.73, 0.10, 0.0)
    start, first = list(regression_sim.evals_of(world, 1, 0.0, np.random.default_rng(0)))
    assert abs((start != first).mean() - 0.10) < 0.01
    assert abs(start.mean() - 0.73) < 0.01 and abs(first.mean() - 0.73) < 0.01


def test_flat_runs_of_30_evals_stay_under_the_bound():
    """500 flat runs, Qwen's start, a fifth of the items flipping at every eval, each eval graded afresh (the
    grid's worst case): the stop's rate is at most its stated 1% (5 runs), by the code's own statistics."""
    world, rng = regression_sim.World(100, 0.73, 0.20, 0.0), np.random.default_rng(1)
    outcomes = [regression_sim.simulate_run(world, 30, 0.0, rng, old=False) for _ in range(500)]
    assert sum(outcome.new is not None for outcome in outcomes) <= 5


def test_a_collapse_stops_at_its_first_eval():
    world, rng = regression_sim.World(100, 0.73, 0.10, 0.0), np.random.default_rng(2)
    outcomes = [regression_sim.simulate_run(world, 30, 0.40, rng, old=False) for _ in range(50)]
    assert {outcome.new for outcome in outcomes} == {1}


def test_the_old_rule_called_4_items_lost_below_0():
    """The issue's case: 4 of 100 items lost, none gained; the bootstrap's upper end is under 0 although the
    exact one-sided p is 1/16."""
    assert regression_sim.old_high(4, 0, 100) < 0 <= regression_sim.old_high(2, 2, 100)


def test_the_table_of_real_runs(tmp_path):
    """A run whose second eval passed the bound (2^-13 <= 0.01 / 8) after a first whose interval lay under 0."""
    run = tmp_path / "bad_seed1"
    run.mkdir()
    rows = [{"step": 0, "accuracy": 0.66}]
    for step, lost in ((2, 5), (4, 13)):
        rows.append({"step": step, "accuracy": 0.5, "eval/change": -lost / 100, "eval/change_low": -0.2,
                     "eval/change_high": -0.01, "eval/change_lost": lost, "eval/change_gained": 0,
                     "eval/change_p": 2.0**-lost, "eval/change_items": 100, "eval/regression_bound": 0.01 / 8})
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "bad_seed1.time").write_text("Command exited with non-zero status 6\n14.07 1.19 41.96\n")
    assert regression_sim.runs_table(tmp_path)[2] == (
        "| bad_seed1 | 2 | 4 | 4 | 13 lost, 0 gained, p = 1.2e-04 (step 4) | -0.13 | 0.13 | 14.07 |")
