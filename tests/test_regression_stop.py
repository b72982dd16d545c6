"""eval.stop_on_regression end to end on the shipped strong start (builtin:tiny-strong, about two thirds of the
eval items right), driven to regress by a learning rate 300 times the demo's (3e-2 against 1e-4): the run stops
at its first eval with exit code 6, its checkpoint saved, the summary naming the best, the verdict said once;
the same run with the setting off says so once and goes on."""

import json

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import RunRegressed, one_line_exits
from dapo_train.run import checkpoint as ckpt
from dapo_train.run.logs import read_status
from dapo_train.train.loop import train

# 2 prompts x G=4, 40 eval items, an eval and a checkpoint every step of 4; lr 3e-2 wrecks the model in a step.
# The bound: 0.01 over 4 evals x 2 accuracies = 1.25e-3, reached at 10 items lost and none gained (2^-10).
REGRESSING = [
    "model.name_or_path=builtin:tiny-strong", "rollout.group_size=4", "rollout.max_new_tokens=48",
    "train.prompts_per_step=2", "train.micro_batch_size=4", "train.updates_per_step=2", "train.num_threads=1",
    "logging.progress_bar=false", "eval.final_full=false", "logging.rollout_groups=0", "eval.every_steps=1",
    "eval.num_items=40", "eval.print_samples=0", "checkpoint.every_steps=1", "checkpoint.keep_best=true",
    "train.learning_rate=3e-2", "train.max_steps=4",
]
VERDICT = "is worse than at step 0"


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_regressing_run_stops_there_says_so_once_and_names_its_best(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    with pytest.raises(RunRegressed, match=r"^step 1: the model is worse than at step 0 on the same 40 eval") as err:
        train(load_config(None, [*REGRESSING, f"output_dir={out}", "eval.stop_on_regression=true"]))
    assert err.value.exit_code == 6
    assert f"its checkpoint {out / 'checkpoint_1'} saved" in str(err.value)
    evals = [row for row in _rows(out) if "accuracy" in row]
    assert [row["step"] for row in evals] == [0, 1]  # stopped at its first eval, step 1 of 4
    last = evals[-1]  # what the verdict read
    assert last["eval/change_p"] <= last["eval/regression_bound"] == pytest.approx(0.01 / 8)
    assert last["eval/change_lost"] >= 10 and f"strict accuracy {last['eval/change_lost']} lost" in str(err.value)
    assert [p.name for p in ckpt.checkpoint_dirs(out)] == ["checkpoint_1"]
    said = capsys.readouterr()
    assert f"regressed {out} at step 1 of 4" in said.out
    assert "best checkpoint (checkpoint.keep_best): checkpoint_" in said.out
    # The verdict once: the exit line (the exception's message), not also a warning before the summary.
    assert (said.out + said.err + caplog.text + str(err.value)).count(VERDICT) == 1
    assert read_status(out) == {"status": "regressed", "step": 1}  # compare's status column (issue 59 item 16)


def test_with_the_setting_off_the_run_says_so_once_and_goes_on(tmp_path, caplog):
    out = train(load_config(None, [*REGRESSING, f"output_dir={tmp_path / 'run'}"]))
    assert max(row["step"] for row in _rows(out)) == 4
    assert caplog.text.count(VERDICT) == 1
    assert "going on (eval.stop_on_regression=false)" in caplog.text
    assert read_status(out) == {"status": "finished", "step": 4}


def test_exit_code_6_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_, one_line_exits(debug=True):  # a verdict, never a traceback
        raise RunRegressed("step 2: worse than at step 0")
    assert exit_.value.code == 6
    assert capsys.readouterr().err == "regressed: step 2: worse than at step 0\n"
