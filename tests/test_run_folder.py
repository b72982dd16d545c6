"""The run folder: --resume RUN_DIR with the run's own config, changes listed key by key, a finished
run left alone, a run without a checkpoint started again, setup failures before the folder exists."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train import trainer
from dapo_train.config import load_config
from dapo_train.errors import UserError
from dapo_train.metrics import read_metrics
from dapo_train.rundir import prepare_run_dir, resume_config, warn_config_changes
from dapo_train.signals import StopRequested

SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
    "train.updates_per_step=2", "train.num_threads=1", "eval.every_steps=0", "logging.progress_bar=false",
    "eval.final_full=false",  # the end-of-run eval on all 500 items is tested in test_eval_items.py
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run of 2 steps (max_steps=2, not the default 40) with checkpoint_1 and checkpoint_2."""
    out = tmp_path_factory.mktemp("runs") / "run"
    return trainer.train(load_config(None, [*SMALL, "train.max_steps=2", "checkpoint.every_steps=1",
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

    monkeypatch.setattr(trainer, "setup", refuse)


# --------------------------------------------------------------------------------------------
# Item 2: the resume hint is a real command, and it resumes with the run's own config.


def test_the_stop_hint_is_the_exact_command(capsys):
    StopRequested().report(Path("outputs/sig int"))
    assert capsys.readouterr().err.strip() == "stopped early; resume with: dapo-train run --resume 'outputs/sig int'"


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


# --------------------------------------------------------------------------------------------
# Item 6: resuming a finished run says so and changes nothing.


def test_resuming_a_finished_run_changes_nothing(finished_run, tmp_path, monkeypatch, capsys):
    run = _copy(finished_run, tmp_path)
    (run / "checkpoint_2" / "eval_test.json").write_text("{}\n")  # a `dapo-train eval` result
    before = _snapshot(run)
    _no_setup(monkeypatch)
    cfg, source = resume_config(str(run), None, [])
    assert trainer.train(cfg, resume=source) == run
    assert _snapshot(run) == before  # no re-saved checkpoint, no rewritten config or logs, the eval file stays
    out = capsys.readouterr().out
    assert f"{run} is already finished: checkpoint_2 reached train.max_steps=2; nothing was changed." in out
    assert f"dapo-train run --resume {run} train.max_steps=N" in out


# --------------------------------------------------------------------------------------------
# Item 3: a folder without a checkpoint does not block a rerun; setup failures come first.


def test_a_run_that_never_saved_a_checkpoint_is_started_again(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 1\n")  # what a double Ctrl-C before the first save leaves
    (run / "metrics.jsonl").write_text('{"step": 0, "accuracy": 0.1}\n')
    cfg = load_config(None, [*SMALL, "train.max_steps=1", f"output_dir={run}"])
    with pytest.raises(UserError, match=rf"never saved a checkpoint.*start it again with: dapo-train run {run}/config"):
        prepare_run_dir(cfg, True, overwrite=False)
    trainer.train(cfg)  # no --overwrite needed
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
        trainer.train(cfg)
    assert not (tmp_path / "run").exists()
