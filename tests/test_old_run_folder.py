"""A run folder saved by the flat package layout of commit f28df1a (tests/fixtures/run_before_layout)
still evaluates and resumes with today's package, and the resumed step is the one that version made
without stopping: config keys, trainer state and checkpoint files are a public interface."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_before_layout"


def _dapo(*args, cwd):
    result = subprocess.run([sys.executable, "-m", "dapo_train", *args], cwd=cwd, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_a_run_saved_before_the_layout_change_evaluates_and_resumes_exactly(tmp_path):
    work = tmp_path / "old"
    shutil.copytree(FIXTURE, work)
    _dapo("eval", "run/checkpoint_2", "--limit", "4", cwd=work)
    report = json.loads((work / "run" / "checkpoint_2" / "eval_test_limit4.json").read_text())
    assert report["metrics"]["num_items"] == 4 and report["target"] == "run/checkpoint_2"
    _dapo("run", "--resume", "run", "train.max_steps=3", cwd=work)
    expected = (FIXTURE / "expected" / "training_losses.txt").read_text().splitlines()
    resumed = (work / "run" / "training_losses.txt").read_text().splitlines()
    assert [row.split(",")[0] for row in resumed] == ["1", "2", "3"]
    assert float(resumed[2].split(",")[1]) == float(expected[2].split(",")[1])  # step 3, made after the resume
    want = load_file(FIXTURE / "expected" / "checkpoint_3.safetensors")
    got = load_file(work / "run" / "checkpoint_3" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)
