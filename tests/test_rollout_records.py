"""Rollout records end to end on the shipped tiny model: every field of every record of a short run
recomputed independently (the configured rewards called on the recorded text, Eq. 9 from the
recorded rewards, the fates against the step's metrics, the ratios against the update's), a resume
that moves later records aside and writes the same ones again, and a run whose reward never varies
pointing at `dapo-train show`."""

import shutil
import statistics
from collections import Counter, defaultdict

import pytest

from dapo_train.config.load import load_config
from dapo_train.rewards import rewards_from_config
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import RECORD_KEYS, read_rollouts, saved_rollouts
from dapo_train.study.show import show
from dapo_train.task.answers import answer_check
from dapo_train.train.loop import train

SMALL = [
    "model.name_or_path=builtin:tiny", "rollout.group_size=4", "rollout.max_new_tokens=48",
    "train.prompts_per_step=2", "train.micro_batch_size=4", "train.updates_per_step=2", "eval.every_steps=0",
    "train.deterministic=true", "train.num_threads=1", "logging.progress_bar=false", "eval.final_full=false",
    "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 16}}]",
]
# Seed 5 (under the CPU's inverse-CDF draw): step 3 keeps a third informative group, which step 4 trains (a
# carried group); step 1 keeps one group only.
EVERY = [*SMALL, "seed=5", "logging.rollout_groups=-1", "train.max_steps=4", "checkpoint.every_steps=1"]


@pytest.fixture(scope="module")
def every_group(tmp_path_factory):
    """4 steps recording every group: (config, run folder, metrics rows, step -> records)."""
    cfg = load_config(None, [*EVERY, f"output_dir={tmp_path_factory.mktemp('rollouts') / 'run'}"])
    run = train(cfg)
    records = {step: read_rollouts(path) for step, path in saved_rollouts(run).items()}
    return cfg, run, {row["step"]: row for row in read_metrics(run)}, records


def _groups(records: list[dict]) -> dict[tuple, list[dict]]:
    groups = defaultdict(list)
    for record in records:
        groups[(record["round"], record["group"])].append(record)
    return groups


def test_every_completion_of_every_step_is_recorded_once(every_group):
    cfg, _, rows, records = every_group
    assert list(records) == [1, 2, 3, 4]
    for step, step_records in records.items():
        assert all(list(record) == list(RECORD_KEYS) and record["step"] == step for record in step_records)
        places = [(r["round"], r["group"], r["sample"]) for r in step_records]
        assert len(places) == len(set(places))
        # Each round draws prompts_per_step prompts, each a group of G completions.
        assert len(step_records) == rows[step]["gen_rounds"] * cfg.train.prompts_per_step * cfg.rollout.group_size


def test_the_rewards_answers_and_advantages_are_what_the_recorded_text_earns(every_group):
    """The configured reward functions called again on each record's text and length, the task's check
    on it, and Eq. 9 recomputed from the group's recorded totals (population std, eps 1e-6)."""
    cfg, _, _, records = every_group
    reward_set, check = rewards_from_config(cfg), answer_check(cfg.data.correctness)
    for step_records in records.values():
        for record in step_records:
            values = {r.key: r.fn([record["completion"]], [record["gold"]], lengths=[record["length"]],
                                  prompts=None)[0] for r in reward_set.rewards}
            assert record["rewards"] == pytest.approx(values)
            assert record["reward"] == pytest.approx(sum(r.weight * values[r.key] for r in reward_set.rewards))
            assert record["correct"] == check.is_correct(record["completion"], record["gold"])
            assert record["extracted"] == check.extract(record["completion"])
            assert isinstance(record["behaviour_logprob_mean"], float) and record["behaviour_logprob_mean"] < 0
        for group in _groups(step_records).values():
            totals = [r["reward"] for r in group]
            mean, std = statistics.fmean(totals), statistics.pstdev(totals)
            assert [r["advantage"] for r in group] == pytest.approx([(t - mean) / (std + 1e-6) for t in totals],
                                                                    abs=1e-5)
            assert len({r["fate"] for r in group}) == 1 and len({r["uid"] for r in group}) == 1


def test_the_fates_are_the_steps_group_counts(every_group):
    """Dropped groups as counted in groups_dropped_*; trained ones are the groups kept this step less
    those carried in from earlier steps; carried ones are what this step added to the buffer."""
    _, _, rows, records = every_group
    carried_in = 0
    for step, step_records in records.items():
        row = rows[step]
        fates = Counter(group[0]["fate"] for group in _groups(step_records).values())
        for reason in ("all_correct", "all_wrong", "no_variance"):
            assert fates[f"dropped_{reason}"] == row[f"groups_dropped_{reason}"], (step, reason)
        assert fates["trained"] == row["groups_kept"] - row["groups_carried"]
        assert fates["carried"] == row["buffer_size"] - (carried_in - row["groups_carried"])
        carried_in = row["buffer_size"]
    assert any(row["groups_kept"] for row in rows.values()) and any(row["groups_carried"] for row in rows.values())


def test_a_trained_completions_ratios_average_to_the_steps(every_group):
    """Only trained records have ratios; over a step that trained no carried-over group, their
    means weighted by tokens are the step's ratio_mean and clip_frac."""
    _, _, rows, records = every_group
    checked = 0
    for step, step_records in records.items():
        trained = [r for r in step_records if r["fate"] == "trained"]
        assert all(r["ratio_mean"] is None and r["clip_frac"] is None for r in step_records if r not in trained)
        assert all(r["ratio_mean"] > 0 and 0 <= r["clip_frac"] <= 1 for r in trained)
        if trained and rows[step]["groups_carried"] == 0:
            tokens = sum(r["length"] for r in trained)
            for key in ("ratio_mean", "clip_frac"):
                weighted = sum(r[key] * r["length"] for r in trained) / tokens
                assert weighted == pytest.approx(rows[step][key], rel=1e-5, abs=1e-7), (step, key)
            checked += 1
    assert checked


def test_a_resume_moves_later_records_aside_and_writes_the_same_ones_again(every_group, tmp_path):
    _, run, _, records = every_group
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    train(load_config(None, [*EVERY, f"output_dir={copy}"]), resume=copy / "checkpoint_1")
    (aside,) = copy.glob("abandoned_after_step1_*")
    later = {step: records[step] for step in (2, 3, 4)}
    assert {step: read_rollouts(path) for step, path in saved_rollouts(aside).items()} == later
    assert {step: read_rollouts(path) for step, path in saved_rollouts(copy).items()} == records  # one file per step


def test_a_reward_that_never_varies_drops_every_group_and_says_where_to_look(tmp_path, capsys, caplog):
    """`digit` on the tiny task: every completion writes a number in its answer block (checked at seed 1: the
    reward's std is 0 in every step), so every group is dropped; at train.max_starved_steps one warning says
    the reward does not tell the completions apart (nothing says the run is broken: it goes on); the
    records show the dropped groups, and the progress log and the summary point at `dapo-train show`. Two
    groups per step are recorded."""
    run = tmp_path / "digit"
    train(load_config(None, [*SMALL, "rewards=[{name: digit}]", "dapo.filter_metric=total",
                             "rollout.max_new_tokens=96", "dapo.max_gen_rounds=2", "logging.rollout_groups=2",
                             "train.max_steps=5", "seed=1", f"output_dir={run}"]))
    assert caplog.text.count("dapo.filter_metric=total was alike within each of the 20 groups") == 1
    rows = read_metrics(run)
    assert all(row["reward_std"] == 0.0 and row["reward_mean"] == 0.5 and row["groups_kept"] == 0 for row in rows)
    steps = saved_rollouts(run)
    assert list(steps) == [1, 2, 3, 4, 5]
    for path in steps.values():
        step_records = read_rollouts(path)
        assert len(step_records) == 2 * 4 and all(r["fate"].startswith("dropped_") for r in step_records)
    shown = show(str(run), where="dropped")
    assert shown.startswith("step 5: 8 completions of 2 sampled groups") and "reward 0.500 (digit 0.500)" in shown
    command = f"dapo-train show {run} --step 1 --where dropped"
    assert "step 1: every group dropped in 2 rounds" in caplog.text and command in caplog.text
    assert f"step 5: the reward has not moved in 5 steps (mean 0.500); see what the model writes: dapo-train show " \
           f"{run} --step 5" in caplog.text
    summary = capsys.readouterr().out
    assert f"  5 of 5 steps dropped every group (first: step 1); see them: {command}\n" in summary
    assert "  the reward did not move in the last 5 steps (mean 0.500)" in summary
