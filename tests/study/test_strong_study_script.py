"""scripts/studies/strong_study.sh's BASE: the demo's recipe passed before each recipe's change (the strong start's
config ships the horizons study's recipe), or nothing when BASE is set empty. dapo-train is a stub on PATH that
writes each command's arguments; the start's eval is already there, so only the runs are called."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["train.learning_rate=1e-4", "train.max_steps=40", "eval.every_steps=10", "eval.num_items=100",
        "eval.samples=0"]


def _calls(tmp_path: Path, **env: str) -> list[list[str]]:
    stub, log, study = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "study"
    stub.mkdir()
    (stub / "dapo-train").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (stub / "dapo-train").chmod(0o755)
    (study / "start").mkdir(parents=True)
    (study / "start" / "eval_test.json").write_text("{}")
    environ = {**os.environ, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}", "RECIPES": "lr0.1", "SEEDS": "1",
               "JOBS": "1", **env}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "studies" / "strong_study.sh"), str(study)], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "failed" not in done.stdout, done.stdout + done.stderr
    return [line.split() for line in log.read_text().splitlines()]


@pytest.mark.skipif(shutil.which("/usr/bin/time") is None, reason="the script times each run with /usr/bin/time")
def test_the_demos_recipe_comes_before_the_recipes_change(tmp_path):
    (call,) = _calls(tmp_path)
    assert call[:2] == ["run", "configs/tiny-strong-cpu.yaml"] and call[2:7] == DEMO
    assert call[7] == "train.learning_rate=1e-5"  # lr0.1's change, after the base: the later setting wins


@pytest.mark.skipif(shutil.which("/usr/bin/time") is None, reason="the script times each run with /usr/bin/time")
def test_an_empty_base_passes_the_configs_own_recipe(tmp_path):
    (call,) = _calls(tmp_path, BASE="")
    assert call[:3] == ["run", "configs/tiny-strong-cpu.yaml", "train.learning_rate=1e-5"]
    assert not set(DEMO) & set(call)
