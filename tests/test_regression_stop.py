"""eval.stop_on_regression end to end on the shipped tiny model, driven to regress by a learning rate 300
times the demo's (3e-2 against 1e-4): the run says so at the second eval below step 0, stops there with
exit code 6, its checkpoint saved, the summary naming the best; the same run with the setting off only
says so."""

import json

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import RunRegressed, one_line_exits
from dapo_train.run import checkpoint as ckpt
from dapo_train.run.logs import read_status
from dapo_train.train.loop import train

# 2 prompts x G=4, 40 eval items (at the warm start's accuracy of about 0.1, enough right items that losing
# them all puts the paired interval below 0), a checkpoint every step; lr 3e-2 wrecks the model in a step.
REGRESSING = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "logging.progress_bar=false", "eval.final_full=false",
    "logging.rollout_groups=0", "eval.every_steps=1", "eval.num_items=40", "eval.print_samples=0",
    "checkpoint.every_steps=1", "checkpoint.keep_best=true", "train.learning_rate=3e-2", "train.max_steps=4",
]


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_regressing_run_stops_there_and_names_its_best(tmp_path, capsys, caplog):
    out = tmp_path / "run"
    with pytest.raises(RunRegressed, match=r"^step 2: the model is worse than at step 0 at 2 evals in a row") as err:
        train(load_config(None, [*REGRESSING, f"output_dir={out}", "eval.stop_on_regression=true"]))
    assert err.value.exit_code == 6
    assert f"its checkpoint {out / 'checkpoint_2'} saved" in str(err.value)
    evals = [row for row in _rows(out) if "accuracy" in row]
    assert [row["step"] for row in evals] == [0, 1, 2]  # stopped at step 2 of 4
    assert all(row["eval/change_high"] < 0 for row in evals[1:])  # what the verdict read, below 0 twice
    assert [p.name for p in ckpt.checkpoint_dirs(out)] == ["checkpoint_1", "checkpoint_2"]
    summary = capsys.readouterr().out
    assert f"regressed {out} at step 2 of 4" in summary
    assert "best checkpoint (checkpoint.keep_best): checkpoint_" in summary
    assert "change from step 0 at step 2: -" in summary
    assert "stopping (eval.stop_on_regression)" in caplog.text
    assert read_status(out) == {"status": "regressed", "step": 2}  # compare's status column (issue 59 item 16)


def test_with_the_setting_off_the_run_says_so_once_and_goes_on(tmp_path, caplog):
    out = train(load_config(None, [*REGRESSING, f"output_dir={tmp_path / 'run'}"]))
    assert max(row["step"] for row in _rows(out)) == 4
    assert caplog.text.count("the model is worse than at step 0") == 1
    assert "going on (eval.stop_on_regression=false)" in caplog.text
    assert read_status(out) == {"status": "finished", "step": 4}


def test_exit_code_6_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_, one_line_exits(debug=True):  # a verdict, never a traceback
        raise RunRegressed("step 2: worse than at step 0")
    assert exit_.value.code == 6
    assert capsys.readouterr().err == "regressed: step 2: worse than at step 0\n"
