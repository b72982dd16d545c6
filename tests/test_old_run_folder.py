"""A run folder saved by the flat package layout of commit f28df1a (tests/fixtures/run_before_layout)
still evaluates and resumes with today's package, and the resumed step is the one that version made
without stopping (to the last bits, which another CPU's kernels may change: far below one step's change):
config keys, trainer state and checkpoint files are a public interface."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "run_before_layout"
# expected/ was written on another CPU: one thread both times (train.num_threads=1 in run/config.yaml), but the
# float32 kernels (SIMD width, summation order) differ between machines, so the resumed weights may differ in
# the last bits (1,322 of 17,696 embedding values by up to 1.1e-8 on one machine). One step of this run moves
# every weight by 2.6e-7 to 2.0e-3 (99.97% of them by more than 1e-6), and a wrong resume lands far outside ATOL:
# measured by editing checkpoint_2/trainer_state.pt, the step-3 weights were up to 2.5e-3 off with Adam's moments
# zeroed, 3.0e-3 with the torch RNG reseeded, 1.9e-3 with the sampler one prompt ahead.
ATOL = 1e-6
LOSS_RTOL = 1e-6


# The fixture sampled with Gumbel-max; the CPU's inverse-CDF draw that came later (rollout/sampling.py) draws
# from the same distribution with another random stream, so the resume samples as that version did.
AS_BEFORE = ("import sys; from dapo_train.rollout import sampling; sampling.FULL_VOCABULARY_DRAWS.clear(); "
             "from dapo_train.cli import main; sys.argv[0] = 'dapo-train'; main()")


def _dapo(*args, cwd):
    result = subprocess.run([sys.executable, "-c", AS_BEFORE, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_a_run_saved_before_the_layout_change_evaluates_and_resumes_to_the_same_step(tmp_path):
    work = tmp_path / "old"
    shutil.copytree(FIXTURE, work)
    _dapo("eval", "run/checkpoint_2", "--limit", "4", cwd=work)
    report = json.loads((work / "run" / "checkpoint_2" / "eval_test_limit4.json").read_text())
    assert report["metrics"]["num_items"] == 4 and report["target"] == "run/checkpoint_2"
    _dapo("run", "--resume", "run", "train.max_steps=3", cwd=work)
    expected = (FIXTURE / "expected" / "training_losses.txt").read_text().splitlines()
    resumed = (work / "run" / "training_losses.txt").read_text().splitlines()
    assert [row.split(",")[0] for row in resumed] == ["1", "2", "3"]
    losses = [float(row.split(",")[1]) for row in expected]
    assert float(resumed[2].split(",")[1]) == pytest.approx(losses[2], rel=LOSS_RTOL, abs=0)  # step 3, after the resume
    assert abs(losses[2] - losses[1]) > 1e4 * LOSS_RTOL * losses[2]  # another step's loss would not pass
    want = load_file(FIXTURE / "expected" / "checkpoint_3.safetensors")
    got = load_file(work / "run" / "checkpoint_3" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0)
    # The tolerance still catches a wrong resume: the step-2 weights (a resume that did nothing, or reloaded
    # checkpoint_2's weights after training) are more than 1,000 x ATOL away in every tensor, and almost every
    # single weight is more than ATOL away.
    before = load_file(FIXTURE / "run" / "checkpoint_2" / "model.safetensors")
    moved = {name: (want[name] - before[name]).abs() for name in want}
    assert min(step.max().item() for step in moved.values()) > 1000 * ATOL
    assert torch.cat([step.flatten() for step in moved.values()]).gt(ATOL).float().mean() > 0.99
