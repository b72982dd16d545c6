"""The sampled eval inside a run (eval.samples, train/evals.py): its metrics and per-item records at every periodic
eval, its change from step 0 (found again on resume), the rollout's distribution, and training left as it was."""

import json
import re

import pytest

from dapo_train.config.load import load_config
from dapo_train.run.eval_items import PERIODIC, SAMPLED, items_path, read_items, saved_evals
from dapo_train.run.logs import read_metrics
from dapo_train.train import evals, loop

# The strong start on 8 fixed items of the shipped task, 2 prompts x G=4 a step, an eval after each step.
SMALL = [
    "model.name_or_path=builtin:tiny-strong", "rollout.group_size=4", "rollout.max_new_tokens=64",
    "train.prompts_per_step=2", "train.micro_batch_size=4", "train.updates_per_step=2", "train.num_threads=1",
    "eval.print_samples=0", "logging.progress_bar=false", "eval.every_steps=1", "eval.num_items=8",
    "eval.final_full=false", "logging.rollout_groups=0",
]
STEP_KEYS = ("reward_mean", "train_accuracy", "loss", "grad_norm", "entropy", "completion_length_mean")
SCORES = ("pass_at_1", "answer_pass_at_1", "maj_at_k", "pass_at_k")


def _train(out, *overrides):
    loop.train(load_config(None, [*SMALL, f"output_dir={out}", *overrides]))
    return {row["step"]: row for row in read_metrics(out)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2 steps with eval.samples=4 and without; the first resumed from its step-1 checkpoint as a third."""
    root = tmp_path_factory.mktemp("sampled")
    on = _train(root / "on", "train.max_steps=2", "eval.samples=4")
    off = _train(root / "off", "train.max_steps=2")
    _train(root / "resumed", "train.max_steps=1", "eval.samples=4")
    loop.train(load_config(None, [*SMALL, f"output_dir={root / 'resumed'}", "train.max_steps=2", "eval.samples=4"]),
               resume=root / "resumed" / "checkpoint_1")
    resumed = {row["step"]: row for row in read_metrics(root / "resumed")}
    return root, on, off, resumed


def test_every_periodic_eval_adds_k_samples_per_item_and_their_scores(runs):
    root, on, _, _ = runs
    assert set(saved_evals(root / "on")) == {(kind, step) for kind in ("step", "sampled") for step in (0, 1, 2)}
    for step in (0, 1, 2):
        records = read_items(items_path(root / "on", SAMPLED, step))
        greedy = read_items(items_path(root / "on", PERIODIC, step))
        # the greedy eval's 8 items, each 4 times in a row, samples 0-3
        assert [r["uid"] for r in records] == [r["uid"] for r in greedy for _ in range(4)]
        assert [r["sample"] for r in records] == [0, 1, 2, 3] * 8
        row = on[step]
        assert (row["eval/sampled/samples"], row["eval/sampled/num_items"]) == (4, 8)
        # pass@1: the share of the 32 completions graded correct (4 per item, so the mean of item means)
        assert row["eval/sampled/pass_at_1"] == pytest.approx(sum(r["correct"] for r in records) / 32)
        right = [sum(r["correct"] for r in records[i : i + 4]) for i in range(0, 32, 4)]
        assert row["eval/sampled/pass_at_k"] == pytest.approx(sum(c > 0 for c in right) / 8)  # any of the 4
        assert row["eval/sampled/pass_at_1"] <= row["eval/sampled/pass_at_k"]
        assert row["seconds_eval_sampled"] > 0
    assert 0 < on[0]["eval/sampled/pass_at_1"] < 1  # the strong start: some right, some wrong
    # every tracker takes the names: MLflow's rule (letters, digits, _ - . space /) is the narrowest
    assert [key for row in on.values() for key in row if not re.fullmatch(r"[/\w.\- ]+", key)] == []
    assert not any(key.endswith("_change") for key in on[0] if key.startswith("eval/sampled/"))  # step 0 is the start
    for step in (1, 2):
        for name in SCORES:
            key = f"eval/sampled/{name}"
            assert on[step][f"{key}_change"] == pytest.approx(on[step][key] - on[0][key])
            assert on[step][f"{key}_change_low"] <= on[step][f"{key}_change"] <= on[step][f"{key}_change_high"]
        assert on[step]["eval/sampled/change_items"] == 8


def test_the_setting_leaves_training_and_the_greedy_eval_as_they_were(runs):
    """The sampled eval draws from its own seeded stream (generate._seeded): every training number and the greedy
    eval's are the same with it on and off; off, no sampled key or file."""
    root, on, off, _ = runs
    for step in (1, 2):
        assert {key: on[step][key] for key in STEP_KEYS} == {key: off[step][key] for key in STEP_KEYS}
    for step in (0, 1, 2):
        assert on[step]["accuracy"] == off[step]["accuracy"]
        assert read_items(items_path(root / "on", PERIODIC, step)) == read_items(items_path(root / "off", PERIODIC,
                                                                                               step))
        assert not any(key.startswith("eval/sampled/") or key == "seconds_eval_sampled" for key in off[step])
    assert {kind for kind, _ in saved_evals(root / "off")} == {"step"}


def test_a_resumed_run_pairs_its_sampled_evals_with_step_0s(runs):
    """The resumed run (1 step, then resumed with train.max_steps raised to 2: a study's legs,
    scripts/studies/strong_study.sh HORIZONS) finds step 0's sampled records again, and its step-2 eval and
    training are the uninterrupted run's, the change from step 0 included."""
    root, on, _, resumed = runs
    sampled = {key: value for key, value in resumed[2].items() if key.startswith("eval/sampled/")}
    assert "eval/sampled/pass_at_1_change" in sampled
    assert sampled == {key: value for key, value in on[2].items() if key.startswith("eval/sampled/")}
    assert {key: resumed[2][key] for key in STEP_KEYS} == {key: on[2][key] for key in STEP_KEYS}


def test_the_sampled_eval_samples_from_the_rollouts_distribution(tmp_path, monkeypatch):
    """rollout.top_k=1 keeps only the most likely token, so every sample is the greedy completion: the setting
    reaches the sampler. Temperature, top_p and the run's seed are passed as configured."""
    calls = []
    real = evals.eval_records
    monkeypatch.setattr(evals, "eval_records", lambda *a, **k: calls.append(k) or real(*a, **k))
    out = tmp_path / "run"
    _train(out, "train.max_steps=1", "eval.samples=3", "rollout.top_k=1", "rollout.temperature=0.7",
           "rollout.top_p=0.9", "seed=5", "dapo.max_gen_rounds=1")
    sampled = [k for k in calls if k.get("samples") == 3]
    assert len(sampled) == 2  # steps 0 and 1
    assert {(k["temperature"], k["top_p"], k["top_k"], k["seed"]) for k in sampled} == {(0.7, 0.9, 1, 5)}
    for step in (0, 1):
        greedy = [r["completion"] for r in read_items(items_path(out, PERIODIC, step))]
        samples = [r["completion"] for r in read_items(items_path(out, SAMPLED, step))]
        assert samples == [text for text in greedy for _ in range(3)]


def test_without_periodic_evals_the_setting_says_it_cannot_act(tmp_path, caplog):
    out = tmp_path / "run"
    _train(out, "train.max_steps=1", "eval.samples=4", "eval.every_steps=0")
    assert "eval.samples cannot act: eval.every_steps=0" in caplog.text
    assert saved_evals(out) == {}
    assert not any("eval/sampled/pass_at_1" in json.dumps(row) for row in read_metrics(out))
