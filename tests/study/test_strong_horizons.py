"""scripts/studies/strong_horizons.py on hand-written runs: each seed's greedy and sampled evals at each horizon
paired with its own step 0 and pooled over the seeds, the training's groups by span, an unfinished run left out.
Every expected number is worked out here from the records."""

import json

import pytest
import strong_horizons

GOLD = "1"


def _greedy(path, correct):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"uid": f"test:{i}", "gold": GOLD, "correct": bool(c)}) + "\n"
                            for i, c in enumerate(correct)))


def _sampled(path, items):
    """K = 2 records per item from (correct, correct) pairs; a wrong sample answers x<k>, so two wrong ones tie
    and the first seen wins (wrong), and a right and a wrong one tie and the first seen wins. A 2 is the right
    answer out of format: wrong strictly, right on the answer alone."""
    lines = [json.dumps({"uid": f"test:{i}", "gold": GOLD, "extracted": GOLD if c else f"x{k}", "correct": c == 1,
                         "answer_correct": c > 0, "sample": k, "length": 10, "truncated": False})
             for i, pair in enumerate(items) for k, c in enumerate(pair)]
    path.write_text("".join(line + "\n" for line in lines))


def _run(study, name, greedy, sampled, legs=("10.0 1.0 20.0", "30.0 1.0 40.0")):
    run = study / name
    for step, correct in greedy.items():
        _greedy(run / "eval_items" / f"step_{step}.jsonl", correct)
    for step, items in sampled.items():
        _sampled(run / "eval_items" / f"sampled_{step}.jsonl", items)
    (run / "config.yaml").write_text("rollout: {group_size: 4}\n")
    # steps 1-4: 4 groups of 4 generated each step, one dropped all right, one all wrong: half could train
    rows = [{"step": 0, "accuracy": 0.5}] + [
        {"step": s, "reward_mean": 0.1 * s, "train_accuracy": 0.5, "completions": 16, "groups_dropped_all_correct": 1,
         "groups_dropped_all_wrong": 1, "groups_dropped_no_variance": 0} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for steps, line in zip((2, 4), legs):
        (study / f"{name}.to{steps}.time").write_text(line + "\n")


@pytest.fixture
def study(tmp_path):
    """Two seeds of lr0.1 on 3 items, horizons 2 and 4; a third seed whose second leg failed."""
    _run(tmp_path, "lr0.1_seed1", {0: [1, 1, 0], 2: [1, 1, 0], 4: [1, 1, 1]},
         {0: [(1, 0), (1, 1), (0, 0)], 2: [(1, 0), (1, 1), (0, 0)], 4: [(1, 1), (1, 1), (1, 0)]})
    _run(tmp_path, "lr0.1_seed2", {0: [1, 1, 0], 2: [1, 0, 0], 4: [1, 1, 1]},
         {0: [(0, 0), (1, 1), (0, 0)], 2: [(0, 0), (1, 1), (0, 0)], 4: [(1, 0), (1, 1), (0, 2)]})
    _run(tmp_path, "lr0.1_seed3", {0: [1, 1, 0]}, {0: [(1, 1)] * 3},
         legs=("10.0 1.0 20.0", "Command exited with non-zero status 1\n5.0 0.1 6.0"))
    return tmp_path


def test_each_horizon_is_paired_with_the_seeds_own_starts(study):
    runs = strong_horizons.load(study)
    assert list(runs) == ["lr0.1"] and sorted(runs["lr0.1"]) == [1, 2]  # seed 3 did not finish
    assert strong_horizons.horizons(study, runs) == [2, 4]
    seeds = [runs["lr0.1"][1], runs["lr0.1"][2]]
    at2, at4 = strong_horizons.changes(seeds, 2), strong_horizons.changes(seeds, 4)
    # greedy: step 0 is 2/3 on both seeds; at 2 seed 1 keeps it, seed 2 loses an item (-1/3): -1/6; at 4 both 1
    assert at2["greedy"].difference == pytest.approx(-1 / 6) and at4["greedy"].difference == pytest.approx(1 / 3)
    # pass@1 per item (share of the 2 right): seed 1 (.5, 1, 0) -> (1, 1, .5): +1/3; seed 2 (0, 1, 0) -> (.5, 1, 0):
    # +1/6; pooled +1/4. pass@k: seed 1 (1, 1, 0) -> (1, 1, 1), seed 2 (0, 1, 0) -> (1, 1, 0): +1/3 each.
    # maj@k (a right-wrong tie goes to the first seen): seed 1 (1, 1, 0) -> (1, 1, 1), seed 2 (0, 1, 0) -> (1, 1, 0).
    assert at4["pass_at_1"].difference == pytest.approx(0.25)
    assert at4["pass_at_k"].difference == pytest.approx(1 / 3) and at4["maj_at_k"].difference == pytest.approx(1 / 3)
    assert at4["samples"] == 2
    # on the answer alone seed 2's third item gains a half more at step 4 (its out-of-format answer): +1/4 + 1/12
    assert at4["answer_pass_at_1"].difference == pytest.approx(0.25 + 1 / 12)
    for name in ("pass_at_1", "maj_at_k", "pass_at_k", "answer_pass_at_1"):
        assert at2[name].difference == 0.0 and (at2[name].low, at2[name].high) == (0.0, 0.0)  # the same records
        assert at4[name].low <= at4[name].difference <= at4[name].high
    table = strong_horizons.change_rows(runs, [2, 4])
    assert table[0].startswith("| recipe | steps | seeds | greedy | Δ greedy [95%] | sampled pass@1 | Δ pass@1")
    assert table[0].endswith("Δ maj@2 [95%] | Δ pass@2 [95%] | Δ answer pass@1 [95%] |")
    assert table[3].startswith("| lr0.1 | 4 | 2 | 1.000 | +0.333 [")


def test_the_training_table_counts_the_groups_that_could_train(study):
    runs = strong_horizons.load(study)
    rows = strong_horizons.training_rows(study, runs, [2, 4])
    # steps 1-2: reward (0.1 + 0.2) / 2 on both seeds; 3-4: 0.35; half the groups trainable, a quarter all right,
    # a quarter all wrong; user seconds 10 + 30 a run
    assert rows[2:] == ["| lr0.1 | 1-2 | 0.150 | 0.500 | 0.500 | 0.250 | 0.250 | 40 |",
                        "| lr0.1 | 3-4 | 0.350 | 0.500 | 0.500 | 0.250 | 0.250 | 40 |"]


def test_the_figure_draws_reward_and_trainable_groups_per_step(study):
    pytest.importorskip("matplotlib")
    reward, trainable = strong_horizons.make_figure(strong_horizons.load(study)).axes
    assert list(reward.lines[0].get_xdata()) == [1, 2, 3, 4]
    assert list(reward.lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3, 0.4])  # both seeds alike
    assert list(trainable.lines[0].get_ydata()) == pytest.approx([0.5] * 4)
    smoothed, _ = strong_horizons.make_figure(strong_horizons.load(study), window=2).axes
    # each step's reward with the one before it: 0.1, (0.1 + 0.2) / 2, (0.2 + 0.3) / 2, (0.3 + 0.4) / 2
    assert list(smoothed.lines[0].get_ydata()) == pytest.approx([0.1, 0.15, 0.25, 0.35])


def test_recipes_are_compared_seed_by_seed_at_the_last_horizon(study):
    """A second recipe on seed 1 only: the comparison pairs it with lr0.1's seed 1 and nothing else."""
    _run(study, "lora_seed1", {0: [1, 1, 0], 2: [1, 1, 0], 4: [0, 1, 1]},
         {0: [(1, 0), (1, 1), (0, 0)], 2: [(1, 0), (1, 1), (0, 0)], 4: [(0, 0), (1, 1), (1, 1)]})
    runs = strong_horizons.load(study)
    rows = strong_horizons.against_rows(runs, 4, "lr0.1")
    assert rows[0] == ("| recipes | steps | seeds | Δ greedy [95%] | Δ pass@1 [95%] | Δ maj@2 [95%] | Δ pass@2 [95%] "
                       "| Δ answer pass@1 [95%] |")
    # lr0.1 seed 1 at step 4: greedy (1, 1, 1), pass@1 (1, 1, .5), maj (1, 1, 1), pass@k (1, 1, 1); lora seed 1:
    # greedy (0, 1, 1) -> -1/3; pass@1 (0, 1, 1) -> -1/6; maj (0, 1, 1) -> -1/3; pass@k (0, 1, 1) -> -1/3
    assert len(rows) == 3 and rows[2].startswith("| lora - lr0.1 | 4 | 1 | -0.333 [")
    cells = [cell.split(" [")[0] for cell in rows[2].strip("| ").split(" | ")[3:]]
    assert cells == ["-0.333", "-0.167", "-0.333", "-0.333", "-0.167"]
