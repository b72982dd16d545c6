"""The run folder: --resume RUN_DIR with the run's own config, changes listed key by key, a finished
run left alone, a run without a checkpoint started again, setup failures before the folder exists."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.run.config_changes import warn_config_changes
from dapo_train.run.folder import prepare_run_dir, resume_config
from dapo_train.run.logs import read_metrics
from dapo_train.run.signals import StopRequested
from dapo_train.train import loop

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "eval.every_steps=0", "logging.progress_bar=false",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in tests/run/test_eval_items.py
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 steps (max_steps=2, not the default 40) with checkpoint_1 and checkpoint_2."""
    out = tmp_path_factory.mktemp("runs") / "run"
    return loop.train(load_config(None, [*SMALL, "train.max_steps=2", "checkpoint.every_steps=1",
                                            f"output_dir={out}"]))


def _copy(run: Path, tmp_path: Path) -> Path:
    """A copy whose saved output_dir is the copy (as if it had been trained there)."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for config in copy.rglob("config.yaml"):
        config.write_text(config.read_text().replace(str(run), str(copy)))
    return copy


def _snapshot(folder: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()}


def _no_setup(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("setup (data, model) ran")

    monkeypatch.setattr(loop, "setup", refuse)


# --------------------------------------------------------------------------------------------
# Item 2: the resume hint is a real command, and it resumes with the run's own config.


def test_the_stop_hint_is_the_exact_command():
    line = StopRequested().resume_line(Path("outputs/sig int"))
    assert line == "stopped early; resume with: dapo-train run --resume 'outputs/sig int'"


def test_resume_run_dir_continues_with_the_runs_own_config(finished_run, tmp_path):
    """The interrupted run stopped after step 1 of its 2; resuming it needs no CONFIG and runs to 2,
    not to the default 40 a base config would have set."""
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoint_2")
    saved = (run / "config.yaml").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "dapo_train", "run", "--resume", str(run)], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert [row["step"] for row in read_metrics(run)] == [1, 2]
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    assert (run / "config.yaml").read_text() == saved
    assert "settings changed" not in result.stderr


def test_overrides_with_resume_are_listed_key_by_key(finished_run, tmp_path, caplog):
    checkpoint = finished_run / "checkpoint_1"
    cfg, source = resume_config(str(checkpoint), None, ["train.max_steps=3", "dapo.eps_high=0.5"])
    assert source == checkpoint and cfg.output_dir == str(finished_run)
    assert (cfg.train.max_steps, cfg.dapo.eps_high, cfg.rollout.group_size) == (3, 0.5, 4)  # 4: saved, not 8
    warn_config_changes(cfg, checkpoint)
    assert "settings changed from checkpoint_1's: dapo.eps_high 0.28 -> 0.5, train.max_steps 2 -> 3" in caplog.text


def test_a_config_given_with_resume_only_locates_the_run(finished_run, tmp_path, caplog):
    """`dapo-train run CONFIG output_dir=RUN --resume`: the run keeps its own settings,
    and the warning names each value of CONFIG that was not applied."""
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  max_steps: 40\n")
    cfg, source = resume_config("latest", str(base), [f"output_dir={finished_run}"])
    assert source == finished_run / "checkpoint_2" and cfg.train.max_steps == 2
    assert "train.max_steps (run: 2, base.yaml: 40)" in caplog.text


def test_an_edit_of_the_run_config_is_named_with_the_key_value_that_applies_it(finished_run, tmp_path, caplog):
    """Issue 52 item 8, reproduced: an edit of RUN/config.yaml was dropped without a word (the resume continues with
    the checkpoint's config and rewrites the file). Now each difference is named, and how to apply it."""
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoint_2")
    edited = (run / "config.yaml").read_text().replace("eps_high: 0.28", "eps_high: 0.4")
    (run / "config.yaml").write_text(edited.replace("group_size: 4", "group_size: 8"))
    cfg, source = resume_config(str(run), None, ["rollout.group_size=8"])  # one of the two edits passed as KEY=VALUE
    assert (cfg.dapo.eps_high, cfg.rollout.group_size) == (0.28, 8)
    warn_config_changes(cfg, source)
    assert (f"{run / 'config.yaml'} differs from checkpoint_1/config.yaml, which the resume continues with: "
            "dapo.eps_high 0.4 (checkpoint_1: 0.28) is discarded (config.yaml is replaced by the settings the run "
            f"continues with); to change a setting on resume, pass KEY=VALUE: dapo-train run --resume {source} "
            "dapo.eps_high=0.4") in caplog.text
    assert "rollout.group_size 4 -> 8" in caplog.text  # the KEY=VALUE, applied and listed as before


def test_an_edit_of_the_checkpoints_config_is_named_and_applied(finished_run, tmp_path, caplog):
    """Issue 52 item 8, reproduced: an edit of the checkpoint's own config.yaml changed the run without a word."""
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoint_2")
    config = run / "checkpoint_1" / "config.yaml"
    config.write_text(config.read_text().replace("eps_high: 0.28", "eps_high: 0.4"))
    cfg, source = resume_config(str(run), None, [])
    assert cfg.dapo.eps_high == 0.4
    warn_config_changes(cfg, source)
    assert ("checkpoint_1/config.yaml was edited after the checkpoint was saved, and the resume applies it: "
            "dapo.eps_high 0.28 -> 0.4") in caplog.text
    assert "settings changed from" not in caplog.text  # no KEY=VALUE was given
    assert "discarded" not in caplog.text  # the run folder's config.yaml holds what the checkpoint was saved with


def test_a_resume_removes_the_partial_checkpoint_of_a_killed_save(finished_run, tmp_path, caplog):
    """Issue 52 item 9, reproduced: a kill -9 during the save of checkpoint_2 left .tmp_checkpoint_2_<pid>/ for good
    (hidden from ls, 18.5 GB at Qwen's size). The resume removes a dead process's, says so, and leaves alone the
    one of a process that runs."""
    run = _copy(finished_run, tmp_path)
    shutil.rmtree(run / "checkpoint_2")
    dead = run / f".tmp_checkpoint_2_{_dead_pid()}"
    shutil.copytree(finished_run / "checkpoint_2", dead)  # as far as the killed save got
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    running = run / f".tmp_checkpoint_2_{alive.pid}"
    running.mkdir()
    try:
        cfg, source = resume_config(str(run), None, [])
        loop.train(cfg, resume=source)
    finally:
        alive.kill()
        alive.wait()
    assert not dead.exists() and running.is_dir()
    assert re.search(rf"removed {dead.name}/ \(\d+ MB\) from {re.escape(str(run))}: the partial checkpoint of a "
                     "save whose process no longer runs", caplog.text), caplog.text
    assert (run / "checkpoint_2").is_dir()


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --------------------------------------------------------------------------------------------
# Item 6: resuming a finished run says so and changes nothing.


def test_resuming_a_finished_run_changes_nothing(finished_run, tmp_path, monkeypatch, capsys):
    run = _copy(finished_run, tmp_path)
    (run / "checkpoint_2" / "eval_test.json").write_text("{}\n")  # a `dapo-train eval` result
    before = _snapshot(run)
    _no_setup(monkeypatch)
    cfg, source = resume_config(str(run), None, [])
    assert loop.train(cfg, resume=source) == run
    assert _snapshot(run) == before  # no re-saved checkpoint, no rewritten config or logs, the eval file stays
    out = capsys.readouterr().out
    assert f"{run} is already finished: checkpoint_2 reached train.max_steps=2; nothing was changed." in out
    assert f"dapo-train run --resume {run} train.max_steps=N" in out


# --------------------------------------------------------------------------------------------
# Item 3: a folder without a checkpoint does not block a rerun; setup failures come first.


def test_a_run_that_never_saved_a_checkpoint_is_started_again(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".dapo-train-run").write_text("{}\n")  # what a double Ctrl-C before the first save leaves: the marker,
    (run / "config.yaml").write_text("seed: 1\n")  # a config and a metrics row
    (run / "metrics.jsonl").write_text('{"step": 0, "accuracy": 0.1}\n')
    cfg = load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={run}"])
    with pytest.raises(UserError, match=rf"never saved a checkpoint.*start it again with: dapo-train run {run}/config"):
        prepare_run_dir(cfg, True, overwrite=False)
    loop.train(cfg)  # no --overwrite needed
    assert "never saved a checkpoint; starting it again" in caplog.text
    assert [row["step"] for row in read_metrics(run)] == [1]
    assert (run / "checkpoint_1").is_dir()


def test_a_tracker_that_cannot_start_fails_before_the_folder_exists(tmp_path, monkeypatch):
    """accelerate itself drops a tracker whose package is missing with a debug message; the run
    says so in one line instead, before the folder or the model exists."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_tensorboard_available", lambda: False)
    _no_setup(monkeypatch)
    cfg = load_config(None, [*SMALL, "logging.trackers=[tensorboard]", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match=r"logging.trackers names tensorboard, but tensorboard is not installed: "
                                        r"pip install tensorboard"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# Resuming from an earlier checkpoint (issue 25, defect 1): what came after it moves aside, never lost.


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory):
    """A finished run of 3 steps, a checkpoint after each, evaluated at the end (so metrics carry accuracy)."""
    out = tmp_path_factory.mktemp("runs") / "run3"
    return loop.train(load_config(None, [*SMALL, "train.max_steps=3", "checkpoint.every_steps=1",
                                            "eval.every_steps=3", "eval.num_items=4", f"output_dir={out}"]))


def test_resuming_an_earlier_checkpoint_moves_the_abandoned_trajectory_aside(three_step_run, tmp_path, capsys,
                                                                              caplog):
    import torch

    run = _copy(three_step_run, tmp_path)
    (run / "checkpoint_3" / "eval_test.json").write_text("{}\n")  # a `dapo-train eval` result of the old branch
    old_rows = [row["step"] for row in read_metrics(run)]
    old_config = (run / "config.yaml").read_text()
    cfg, source = resume_config(str(run / "checkpoint_1"), None, ["train.max_steps=2"])
    loop.train(cfg, resume=source)

    (aside,) = run.glob("abandoned_after_step1_*")
    assert sorted(p.name for p in aside.iterdir()) == [
        "accuracy_losses.txt", "checkpoint_2", "checkpoint_3", "config.yaml", "eval_items", "metrics.jsonl",
        "rollouts", "training_losses.txt",
    ]
    assert sorted(p.name for p in (aside / "rollouts").iterdir()) == ["step_2.jsonl", "step_3.jsonl"]
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]  # 2: written again
    assert (aside / "checkpoint_3" / "eval_test.json").is_file()  # moved with its checkpoint
    assert [p.name for p in (aside / "eval_items").iterdir()] == ["step_3.jsonl"]  # the step-3 eval's items
    # The live trajectory's: step 0, and its own last step's eval (the resumed run ends at step 2).
    assert sorted(p.name for p in (run / "eval_items").iterdir()) == ["step_0.jsonl", "step_2.jsonl"]
    assert [row["step"] for row in read_metrics(aside)] == [2, 3]  # the rows the resume cut off, kept
    assert [line.split(",")[0] for line in (aside / "training_losses.txt").read_text().splitlines()] == ["2", "3"]
    assert (aside / "config.yaml").read_text() == old_config  # what the abandoned branch ran with
    assert old_rows == [0, 1, 2, 3] and [row["step"] for row in read_metrics(run)] == [0, 1, 2]  # the live one
    assert sorted(p.name for p in run.glob("checkpoint_*")) == ["checkpoint_1", "checkpoint_2"]
    assert ("moved what came after it (checkpoint_2, checkpoint_3, 2 metrics rows, 1 eval record file, 2 rollout "
            "record files, config.yaml)" in caplog.text)

    out = capsys.readouterr().out
    assert f"checkpoints in {run}: checkpoint_1, checkpoint_2\n" in out
    assert f"next: dapo-train eval {run / 'checkpoint_2'}" in out
    # The summary's time is the run's: the checkpoint it resumed from holds the time before.
    before = torch.load(run / "checkpoint_1" / "trainer_state.pt", weights_only=True)["wall_seconds"]
    after = torch.load(run / "checkpoint_2" / "trainer_state.pt", weights_only=True)["wall_seconds"]
    assert 0 < before < after and re.search(r"finished .*: 2 steps in \d+s \(this session: \d+s\)", out)

    cfg, source = resume_config(str(run), None, [])  # `--resume RUN` follows the live trajectory
    assert source == run / "checkpoint_2" and cfg.train.max_steps == 2


def test_a_resume_refused_by_setup_moves_nothing(three_step_run, tmp_path, monkeypatch):
    run = _copy(three_step_run, tmp_path)
    before = _snapshot(run)
    cfg, source = resume_config(str(run / "checkpoint_1"), None, ["data.prompt_field=nope"])
    with pytest.raises(UserError, match="nope"):
        loop.train(cfg, resume=source)
    assert _snapshot(run) == before and not list(run.glob("abandoned_*"))


def test_a_run_with_an_abandoned_folder_is_one_run(three_step_run, tmp_path):
    """The folder of what was set aside holds checkpoints, but it is not a run of its own."""
    from dapo_train.run.folder import runs_under, set_aside_abandoned

    run = _copy(three_step_run, tmp_path)
    aside = set_aside_abandoned(run, 2)
    assert aside is not None and (aside / "checkpoint_3").is_dir()
    assert list(runs_under(tmp_path)) == [run]
    assert set_aside_abandoned(run, 2) is None  # nothing after step 2 is left: nothing more moves


def test_a_lora_change_on_resume_is_refused_before_the_data_loads(finished_run, monkeypatch):
    pytest.importorskip("peft")
    _no_setup(monkeypatch)
    cfg, source = resume_config(str(finished_run / "checkpoint_1"), None, ["model.lora.r=4"])
    with pytest.raises(UserError, match="it holds full weights, but model.lora.r=4"):
        loop.train(cfg, resume=source)
