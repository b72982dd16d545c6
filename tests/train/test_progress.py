"""What a run says: the eval and step lines by hand, the labelled bar, the end-of-run summary, and
one short real run with the bar off (the setting for server logs and CI)."""

import contextlib
import io
import json
import logging
import re

import pytest

from dapo_train.config.load import load_config
from dapo_train.train.loop import train
from dapo_train.train.progress import Progress, duration, eval_line, step_fields
from dapo_train.train.summary import end_of_run_summary

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "eval.num_items=8", "eval.print_samples=0",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in tests/run/test_eval_items.py
]

STEPS = [
    {"reward_mean": 0.5, "train_accuracy": 0.25, "entropy": 0.6, "clip_frac_high": 0.01, "clip_frac_low": 0.0,
     "seconds_step": 4.0},
    {"reward_mean": 0.7, "train_accuracy": 0.5, "entropy": 0.4, "clip_frac_high": 0.03, "clip_frac_low": 0.002,
     "rollout_kl": 3e-4, "seconds_step": 5.0},
]
EVAL = {"accuracy": 0.28, "eval/accuracy_ci95_low": 0.2, "eval/accuracy_ci95_high": 0.37, "eval/num_items": 100}


def test_step_fields_are_means_over_the_steps_they_cover():
    # reward (0.5 + 0.7) / 2 = 0.6; train acc 0.375; entropy 0.5; clip high 0.02, low 0.001; the rollout's
    # KL of the one step that measured it (the other did not: no mean with a made-up 0); 4.5 s.
    assert step_fields(STEPS) == (
        "reward 0.600, train acc 0.375, entropy 0.500, clip high 0.0200 low 0.0010, rollout kl 3.0e-04, 4.5 s/step"
    )
    # A step that made no update has no entropy or clip fractions: they are left out, not zero.
    assert step_fields([{"reward_mean": 0.0, "train_accuracy": 0.0, "seconds_step": 1.0}]) == (
        "reward 0.000, train acc 0.000, 1.0 s/step"
    )


def test_eval_line_names_step_accuracy_interval_and_what_training_did():
    assert eval_line(10, 40, EVAL, STEPS) == (
        "eval step 10/40: accuracy 0.280 (95% CI 0.200-0.370) on 100 items; since the last eval: "
        "reward 0.600, train acc 0.375, entropy 0.500, clip high 0.0200 low 0.0010, rollout kl 3.0e-04, 4.5 s/step"
    )
    assert eval_line(0, 40, EVAL, []) == (
        "eval step 0/40: accuracy 0.280 (95% CI 0.200-0.370) on 100 items (before training)"
    )


# An eval after step 0 with both accuracies and its change from step 0 (evaluation/stats.change_metrics' keys).
CHANGED = {**EVAL, "eval/answer_accuracy": 0.41, "eval/format_gap": 0.13, "eval/change": 0.07,
           "eval/change_low": 0.04, "eval/change_high": 0.1, "eval/answer_change": -0.02,
           "eval/answer_change_low": -0.05, "eval/answer_change_high": 0.01, "eval/change_items": 100}


def test_eval_line_shows_both_accuracies_and_the_change_from_step_0():
    assert eval_line(10, 40, CHANGED, []) == (
        "eval step 10/40: accuracy 0.280 (95% CI 0.200-0.370) on 100 items, answer accuracy 0.410 (format gap "
        "+0.130); +0.070 [+0.040, +0.100] over step 0 (answer -0.020 [-0.050, +0.010])"
    )


STEP_0 = {**EVAL, "eval/answer_accuracy": 0.3, "eval/format_gap": 0.02, "eval/completion_length_mean": 85.3}


@pytest.mark.parametrize("cut, warned", [(0.0, False), (0.1, False), (0.11, True), (0.5, True)])
def test_step_0_says_how_many_answers_the_budget_cut_and_warns_above_10_percent(caplog, cut, warned):
    """10% cut exactly is not more than 10%: no warning; 11% is."""
    cfg = load_config(None, ["logging.progress_bar=false", "rollout.max_new_tokens=64", "eval.max_new_tokens=80"])
    progress = Progress(cfg, start_step=0)
    with caplog.at_level(logging.INFO):
        progress.log(0, {**STEP_0, "eval/truncated_rate": cut})
    progress.close()
    said = [record.getMessage() for record in caplog.records]
    assert said[0] == (f"eval step 0/{cfg.train.max_steps}: accuracy 0.280 (95% CI 0.200-0.370) on 100 items, answer "
                       f"accuracy 0.300 (format gap +0.020) (before training); {100 * cut:.1f}% of the greedy answers "
                       "cut at the token budget, mean length 85.3 tokens")
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == ([f"step 0: the token budget cut {100 * cut:.1f}% of the greedy eval answers at 80 tokens (more "
                         "than 10%): a cut answer has no final answer to grade or reward; raise rollout.max_new_tokens "
                         "and eval.max_new_tokens"] if warned else [])


def test_the_summary_shows_the_answer_accuracy_and_the_change_from_step_0(tmp_path):
    rows = [{"step": 0, **STEP_0, "accuracy": 0.16}, {"step": 40, **CHANGED}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = end_of_run_summary(tmp_path, 40, 40, 200.0).splitlines()
    assert lines[2:4] == [
        "  answer accuracy (the gold number wherever the final answer is read): first 0.300 -> last 0.410; format gap "
        "(answer - strict) +0.020 -> +0.130",
        "  change from step 0 at step 40: +0.070 [+0.040, +0.100] (answer -0.020 [-0.050, +0.010]), 95% interval, "
        "paired on the 100 eval items",
    ]


# The sampled eval's keys (evaluation/sampled.py) at step 0 and at a later eval with its change from step 0.
SAMPLED_0 = {"eval/sampled/samples": 8, "eval/sampled/pass_at_1": 0.613, "eval/sampled/maj_at_k": 0.655,
             "eval/sampled/pass_at_k": 0.81, "seconds_eval_sampled": 12.34, "seconds_eval": 2.06}
SAMPLED_40 = {"eval/sampled/samples": 8, "eval/sampled/pass_at_1": 0.64, "eval/sampled/maj_at_k": 0.66,
              "eval/sampled/pass_at_k": 0.8, "eval/sampled/change_items": 100,
              **{f"eval/sampled/{name}_change{end}": value for name, values in (
                  ("pass_at_1", (0.027, 0.004, 0.05)), ("maj_at_k", (0.005, -0.03, 0.04)),
                  ("pass_at_k", (-0.01, -0.05, 0.03))) for end, value in zip(("", "_low", "_high"), values)}}


def test_eval_line_shows_the_sampled_eval_and_at_step_0_its_cost():
    assert eval_line(0, 40, {**EVAL, **SAMPLED_0}, []) == (
        "eval step 0/40: accuracy 0.280 (95% CI 0.200-0.370) on 100 items (before training); sampled x8: pass@1 "
        "0.613, maj@8 0.655, pass@8 0.810 (12.3 s beside the greedy eval's 2.1 s)"
    )
    assert eval_line(40, 40, {**CHANGED, **SAMPLED_40}, []) == (
        "eval step 40/40: accuracy 0.280 (95% CI 0.200-0.370) on 100 items, answer accuracy 0.410 (format gap "
        "+0.130); +0.070 [+0.040, +0.100] over step 0 (answer -0.020 [-0.050, +0.010]); sampled x8: pass@1 0.640 "
        "+0.027 [+0.004, +0.050], maj@8 0.660 +0.005 [-0.030, +0.040], pass@8 0.800 -0.010 [-0.050, +0.030] over "
        "step 0"
    )


def test_the_summary_shows_the_sampled_eval_first_to_last_and_its_change(tmp_path):
    rows = [{"step": 0, **STEP_0, **SAMPLED_0}, {"step": 20, **CHANGED}, {"step": 40, **CHANGED, **SAMPLED_40}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = end_of_run_summary(tmp_path, 40, 40, 200.0).splitlines()
    assert lines[4] == (
        "  sampled eval (eval.samples, 8 an item; step 0 -> 40; change from step 0, 95% interval, paired on the 100 "
        "eval items): pass@1 0.613 -> 0.640, +0.027 [+0.004, +0.050]; maj@8 0.655 -> 0.660, +0.005 [-0.030, +0.040]; "
        "pass@8 0.810 -> 0.800, -0.010 [-0.050, +0.030]"
    )
    greedy = [{key: value for key, value in row.items() if "sampled" not in key} for row in rows]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in greedy))
    assert "sampled eval" not in end_of_run_summary(tmp_path, 40, 40, 200.0)  # none without eval.samples' keys


def test_durations():
    assert [duration(s) for s in (7.4, 200, 3725)] == ["7s", "3m20s", "1h02m"]


def test_the_bar_labels_eval_and_train_accuracy_apart():
    cfg = load_config(None, ["logging.progress_bar=true", "train.max_steps=40"])
    progress = Progress(cfg, start_step=0)
    try:
        progress.log(0, dict(EVAL))
        progress.log(1, dict(STEPS[0]))
        fields = dict(part.split("=") for part in progress.bar.postfix.split(", "))
    finally:
        progress.close()
    # Eval and train accuracy under their own names: one `acc` would mean either, depending on the step.
    assert fields == {"reward": "0.500", "train_acc": "0.250", "eval_acc": "0.280", "ent": "0.600"}


def test_the_summary_gives_accuracy_first_best_last_wall_time_checkpoints_and_next(tmp_path):
    rows = [{"step": 0, **EVAL, "accuracy": 0.16}, {"step": 10, **EVAL, "accuracy": 0.30}, {"step": 20, "loss": 0.1},
            {"step": 40, **EVAL, "accuracy": 0.28}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for step in (20, 40):
        (tmp_path / f"checkpoint_{step}").mkdir()
    assert end_of_run_summary(tmp_path, 40, 40, 200.0).splitlines() == [
        f"finished {tmp_path}: 40 steps in 3m20s",
        "  eval accuracy (100 eval items): first 0.160 (step 0) -> best 0.300 (step 10) -> last 0.280 (step 40)",
        "  skipped steps: 0 non-finite (loss or grad norm), 0 without an informative group, of 3",  # rows past 0
        f"  checkpoints in {tmp_path}: checkpoint_20, checkpoint_40",
        f"  next: dapo-train eval {tmp_path / 'checkpoint_40'}   # every item of data.eval_split",
    ]
    without_eval_split = end_of_run_summary(tmp_path, 40, 40, 200.0, eval_split_missing="split 'test' not found "
                                            "in train.jsonl; splits: train (set data.eval_split ...)").splitlines()
    assert without_eval_split[-1] == f"  next: dapo-train eval {tmp_path / 'checkpoint_40'} data.path=EVAL_DATA   # " \
        "split 'test' not found in train.jsonl"  # issue 38: the plain command would fail on the missing split
    stopped = end_of_run_summary(tmp_path, 20, 40, 65.0, "stopped").splitlines()
    assert stopped[0] == f"stopped {tmp_path} at step 20 of 40 in 1m05s"
    assert not any("next:" in line for line in stopped)  # the stop report says how to resume instead


def test_the_summary_counts_the_skipped_steps_of_each_kind(tmp_path):
    rows = [{"step": 1, "skipped_nonfinite": 1}, {"step": 2, "skipped_nonfinite": 0, "loss": 0.2},
            {"step": 3, "skipped_no_groups": 1}, {"step": 4, "skipped_no_groups": 1}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = end_of_run_summary(tmp_path, 4, 50, 9.0, "aborted").splitlines()
    assert lines[0] == f"aborted {tmp_path} at step 4 of 50 in 9s"
    assert "  skipped steps: 1 non-finite (loss or grad norm), 2 without an informative group, of 4" in lines
    assert not any("next:" in line for line in lines)  # the abort's reason says what to do


def test_the_summary_totals_the_updates_work_per_trained_token(tmp_path):
    """Two steps of 1,000 + 800 forward positions (100 + 80 padding), 300 + 200 scored by the head for
    250 + 150 trained tokens: 1,800 positions, 10.0% padding, 500 scored; 1800 / 400 = 4.50 and
    500 / 400 = 1.25 per trained token; the out-of-memory guard's probe at step 1 (120 positions) said apart, in
    none of them. A step without an update adds nothing; no trained token, no line."""
    rows = [{"step": 1, "update_forward_tokens": 1000, "update_padding_tokens": 100, "update_head_tokens": 300,
             "update_trained_tokens": 250, "update_probe_positions": 120},
            {"step": 2, "skipped_no_groups": 1},
            {"step": 3, "update_forward_tokens": 800, "update_padding_tokens": 80, "update_head_tokens": 200,
             "update_trained_tokens": 150}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "  update work: 1,800 forward positions (10.0% padding), 500 scored by the LM head, for 400 trained " \
        "tokens: 4.50 forward and 1.25 head positions per trained token; besides, 120 positions the out-of-memory " \
        "guard ran, its gradient dropped" in end_of_run_summary(tmp_path, 3, 3, 9.0)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert "update work" not in end_of_run_summary(tmp_path, 2, 2, 9.0)


# --------------------------------------------------------------------------------------------
# One real run without the bar.


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    """(log text, stdout, run folder) of 2 steps with an eval every step and the bar off."""
    out = tmp_path_factory.mktemp("progress") / "run"
    cfg = load_config(None, [*SMALL, "train.max_steps=2", "eval.every_steps=1", "logging.progress_bar=false",
                             f"output_dir={out}"])
    stream, stdout = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stdout):
            train(cfg)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return stream.getvalue(), stdout.getvalue(), out


def test_a_run_without_the_bar_logs_every_step_and_every_eval(quiet_run):
    log, _, _ = quiet_run
    lines = log.splitlines()
    steps = [line for line in lines if line.startswith("step ") and not line.startswith("step 0: ")]  # cut answers
    evals = [line for line in lines if line.startswith("eval step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/2", "step 2/2"]
    assert all("reward " in line and "train acc " in line and "s/step" in line for line in steps), steps
    assert [line.split(":")[0] for line in evals] == ["eval step 0/2", "eval step 1/2", "eval step 2/2"]
    assert " on 8 items, answer accuracy " in evals[0] and "(before training); " in evals[0]
    assert all(" over step 0 (answer " in line for line in evals[1:])
    assert all("95% CI" in line for line in evals)
    assert all("since the last eval: reward " in line and "s/step" in line for line in evals[1:]), evals


def test_each_eval_after_training_shows_a_trained_completion_in_two_lines(quiet_run):
    """The latest trained completion of the rollout records: its answer and reward breakdown, then
    the start of its text on one line; none before training."""
    log, _, _ = quiet_run
    lines = log.splitlines()
    shown = [index for index, line in enumerate(lines) if line.startswith("  a trained completion: ")]
    evals = [index for index, line in enumerate(lines) if line.startswith("eval step ")]
    assert shown == [evals[1] + 1, evals[2] + 1], log
    for index in shown:
        assert re.search(r"\(step \d, trained\): gold \S+, got \S+ \((correct|wrong)\), \d+ tokens; reward -?\d\.\d{3} "
                         r"\(accuracy -?\d\.\d{3}, overlong -?\d\.\d{3}\), advantage", lines[index]), lines[index]
        assert lines[index + 1].startswith("    '") and len(lines[index + 1]) <= 200
        assert index + 2 == len(lines) or not lines[index + 2].startswith("    ")  # two lines at most


def test_the_progress_log_points_at_show_when_every_group_is_dropped_or_the_reward_is_flat(caplog, tmp_path):
    cfg = load_config(None, ["logging.progress_bar=false", "train.max_steps=40", f"output_dir={tmp_path}"])
    progress = Progress(cfg, start_step=0)
    dropped = {"reward_mean": -1.0, "train_accuracy": 0.0, "skipped_no_groups": 1, "gen_rounds": 4,
               "groups_dropped_all_wrong": 7, "groups_dropped_all_correct": 1}
    with caplog.at_level(logging.WARNING):
        for step in range(1, 7):
            progress.log(step, dict(dropped))
    progress.close()
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings[0] == (f"step 1: every group dropped in 4 rounds (all correct 1, all wrong 7, no variance 0); "
                           f"update skipped; see them: dapo-train show {tmp_path} --step 1 --where dropped")
    flat = [message for message in warnings if "has not moved" in message]
    assert flat == [f"step 5: the reward has not moved in 5 steps (mean -1.000); see what the model writes: "
                    f"dapo-train show {tmp_path} --step 5"]  # once, when the streak reaches 5 steps
    assert len(warnings) == 6 + 1
    quiet = Progress(load_config(None, ["logging.progress_bar=false", "logging.rollout_groups=0"]), start_step=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        quiet.log(1, dict(dropped))
    quiet.close()
    assert caplog.records[-1].getMessage().endswith("update skipped; no rollout records to show them "
                                                    "(logging.rollout_groups=0)")


def test_the_summary_points_at_show(tmp_path):
    from dapo_train.run.rollouts import write_rollouts

    rows = [{"step": step, "reward_mean": 0.5, "skipped_no_groups": 1} for step in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert "dapo-train show" not in end_of_run_summary(tmp_path, 5, 5, 10.0)  # no records: no pointer
    write_rollouts(tmp_path, 5, [])
    lines = end_of_run_summary(tmp_path, 5, 5, 10.0).splitlines()
    assert lines[-2:] == [
        f"  5 of 5 steps dropped every group (first: step 1); see them: dapo-train show {tmp_path} --step 1 --where "
        "dropped",
        f"  the reward did not move in the last 5 steps (mean 0.500); see what the model writes: dapo-train show "
        f"{tmp_path} --step 5",
    ]


def test_a_run_ends_with_a_summary(quiet_run):
    _, stdout, out = quiet_run
    lines = stdout.splitlines()
    assert lines[0].startswith(f"finished {out}: 2 steps in ")
    assert lines[1].startswith("  eval accuracy (8 eval items): first ") and " -> best " in lines[1]
    assert lines[2].startswith("  answer accuracy (the gold number wherever the final answer is read): first ")
    change = r"[-+]\d\.\d{3} \[[-+]\d\.\d{3}, [-+]\d\.\d{3}\]"
    assert re.fullmatch(rf"  change from step 0 at step 2: {change} \(answer {change}\), 95% interval, paired on the 8 "
                        r"eval items", lines[3]), lines[3]
    lines = lines[:2] + lines[4:]
    assert re.fullmatch(r"  generation: [\d,]+ tokens for [\d,]+ trained \(\d+\.\d\d per trained token; [\d,]+ on "
                        r"dropped groups\), \d+\.\d\d s per trained group", lines[3]), lines[3]
    # The head scores exactly the trained tokens (no overlong filtering): 1.00 head position per trained token.
    assert lines[4].startswith("  update work: ") and " 1.00 head positions per trained token; besides, " in lines[4]
    assert lines[4].endswith(" positions the out-of-memory guard ran, its gradient dropped")  # at step 1 only
    assert lines[2:3] + lines[5:] == [
        "  skipped steps: 0 non-finite (loss or grad norm), 0 without an informative group, of 2",
        f"  checkpoints in {out}: checkpoint_2",
        f"  next: dapo-train eval {out / 'checkpoint_2'}   # every item of data.eval_split",
        f"  rollouts (what the model wrote, and each reward): dapo-train show {out}",
    ]


def test_each_split_logs_its_row_counts_once(quiet_run):
    log, _, _ = quiet_run
    assert log.count("4000 rows") == 1 and log.count("500 rows") == 1, log


def test_a_step_whose_prompts_were_all_screened_out_says_so():
    """Screening (dapo.screen_size) rules prompts out before Eq. 11 sees a group: the line counts them,
    else it would read 'all correct 0, all wrong 0, no variance 0' for a step that generated 14 screens."""
    from dapo_train.train.progress import all_dropped_line

    line = all_dropped_line(3, {"gen_rounds": 4, "groups_screened_all_wrong": 14, "groups_screened_all_right": 1}, "x")
    assert line == ("step 3: every group dropped in 4 rounds (all correct 0, all wrong 0, no variance 0; screened out: "
                    "all right 1, all wrong 14); update skipped; x")
    assert "screened" not in all_dropped_line(3, {"gen_rounds": 4, "groups_dropped_all_wrong": 8}, "x")
