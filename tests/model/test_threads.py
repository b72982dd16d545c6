"""Issue 59 item 9: train.num_threads above the CPUs this process may use. `train.num_threads=1000` was
handed to torch as it was and brought a 2-core machine to a load of 230 without finishing a step; it is
capped at the usable CPUs, with one line that says so, wherever the trainer, eval and preflight set it."""

import dataclasses
import logging
import shutil
from pathlib import Path

import torch

from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.model import threads

ROOT = Path(__file__).resolve().parents[2]


def test_more_threads_than_cpus_are_capped_and_said(monkeypatch, caplog):
    chosen = []
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    assert threads.set_cpu_threads(1000) == 2
    assert chosen == [2]
    assert "train.num_threads=1000 is more than the 2 CPUs this process may use: torch runs 2 threads" in caplog.text
    caplog.clear()
    assert threads.set_cpu_threads(2) == 2 and threads.set_cpu_threads(1) == 1  # within the CPUs: as asked
    assert chosen == [2, 2, 1] and not caplog.text
    assert threads.set_cpu_threads(0) is None and chosen == [2, 2, 1]  # 0: torch's own default, untouched


def test_the_usable_cpus_are_a_positive_count():
    assert 1 <= threads.usable_cpus() <= (torch.get_num_threads() + 10_000)


def test_eval_caps_the_threads_before_the_model_loads(tmp_path, monkeypatch, caplog):
    """The eval command set torch's threads to train.num_threads as given (1000 here)."""
    chosen = []
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("output_dir: out\n")
    shutil.copytree(ROOT / "dapo_train" / "assets" / "tiny" / "model", tmp_path / "model")
    options = EvalOptions(config_path="tiny.yaml", limit=1, max_new_tokens=2, split="train")
    with caplog.at_level(logging.WARNING):
        run_eval([str(tmp_path / "model")], dataclasses.replace(options, overrides=("train.num_threads=1000",)))
    assert chosen == [2]
    assert "train.num_threads=1000 is more than the 2 CPUs" in caplog.text
