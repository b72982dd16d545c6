"""train.deterministic on CUDA (train/determinism.py), the device faked: top-p sampling refused at start in one
line (torch has no deterministic float cumsum on CUDA: the first rollout raised), cuBLAS's workspace set when
unset and left when set; on a CPU top-p stays allowed."""

import sys

import pytest
import torch

from dapo_train import cli
from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.train import determinism, session


@pytest.fixture
def turned_on(monkeypatch):
    """torch.use_deterministic_algorithms recorded, not applied (it is process-wide); CUBLAS_WORKSPACE_CONFIG
    unset for the test."""
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kw: calls.append(mode))
    monkeypatch.delenv(determinism.CUBLAS_ENV, raising=False)
    return calls


def test_top_p_under_deterministic_is_refused_on_cuda_only(turned_on):
    cfg = load_config(None, ["train.deterministic=true", "rollout.top_p=0.9"])
    with pytest.raises(ConfigError) as info:
        determinism.use_deterministic(cfg, cuda=True)
    assert info.value.key == "train.deterministic" and "rollout.top_p=0.9 on CUDA" in str(info.value)
    assert turned_on == []
    determinism.use_deterministic(cfg, cuda=False)  # a CPU's cumsum is deterministic
    determinism.use_deterministic(load_config(None, ["rollout.top_p=0.9"]), cuda=True)  # not asked: nothing to refuse
    assert turned_on == [True]


def test_cublas_workspace_is_set_when_unset_and_left_when_set(turned_on, monkeypatch, caplog):
    caplog.set_level("INFO")
    cfg = load_config(None, ["train.deterministic=true"])
    determinism.use_deterministic(cfg, cuda=False)
    assert determinism.CUBLAS_ENV not in determinism.os.environ  # no cuBLAS on a CPU
    determinism.use_deterministic(cfg, cuda=True)
    assert determinism.os.environ[determinism.CUBLAS_ENV] == ":4096:8" and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in \
        caplog.text
    monkeypatch.setenv(determinism.CUBLAS_ENV, ":16:8")  # the user's own choice stays
    determinism.use_deterministic(cfg, cuda=True)
    assert determinism.os.environ[determinism.CUBLAS_ENV] == ":16:8" and turned_on == [True, True, True]


def test_the_run_command_refuses_it_in_one_line_before_anything_loads(turned_on, tmp_path, monkeypatch, capsys):
    """With CUDA faked the run stops at its first check: exit 2, one line, no accelerator, no run folder."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(session, "start_accelerator", lambda *a, **k: pytest.fail("the accelerator started"))
    monkeypatch.setattr(sys, "argv", ["dapo-train", "run", "train.deterministic=true", "rollout.top_p=0.95",
                                      f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: config key 'train.deterministic': true with rollout.top_p=0.95 on CUDA")
    assert not (tmp_path / "run").exists()
