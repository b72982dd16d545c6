"""Issue 59, item 14: a command whose result is what it prints fails when the print fails. `compare RUN --json >
/dev/full`, `show RUN > /dev/full` and `config >&-` ended 0 having written nothing (the console's forgiveness,
run/console.py, is for a run, whose record is its run.log; a printed result has no other copy). Now: exit 2 and
one line on stderr naming standard output, for a full device and for a stdout closed before the start."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.train import loop

FULL = Path("/dev/full")
SMALL = [
    "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=8",
    "train.updates_per_step=1", "train.num_threads=1", "eval.every_steps=0", "eval.final_full=false",
    "logging.progress_bar=false", "train.max_steps=1",
]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A one-step run with its rollout records (what show prints) and metrics (what compare prints)."""
    return loop.train(load_config(None, [*SMALL, f"output_dir={tmp_path_factory.mktemp('runs') / 'run'}"]))


def dapo(args: list[str], stdout, cwd: Path) -> subprocess.CompletedProcess:
    """The command with its stdout on `stdout`: an open file, or None for a stdout closed at start (`>&-`)."""
    closed = (lambda: os.close(1)) if stdout is None else None
    return subprocess.run([sys.executable, "-m", "dapo_train", *args], stdout=stdout, stderr=subprocess.PIPE,
                          preexec_fn=closed, cwd=cwd, text=True, timeout=300)


def assert_refused(result: subprocess.CompletedProcess) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "standard output" in lines[0], result.stderr


def commands(run: Path) -> dict[str, list[str]]:
    return {"config": ["config"], "config --keys": ["config", "--keys", "seed"], "--version": ["--version"],
            "compare --json": ["compare", str(run), "--json"], "compare": ["compare", str(run)],
            "show": ["show", str(run)], "show --json": ["show", str(run), "--json"]}


@pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("command", ["config", "config --keys", "--version", "compare --json", "compare", "show",
                                     "show --json"])
def test_a_result_printed_to_a_full_device_is_an_error(real_run, tmp_path, command):
    with FULL.open("w") as full:
        assert_refused(dapo(commands(real_run)[command], full, tmp_path))


@pytest.mark.parametrize("command", ["config", "compare --json", "show"])
def test_a_result_printed_to_a_closed_stdout_is_an_error(real_run, tmp_path, command):
    assert_refused(dapo(commands(real_run)[command], None, tmp_path))


def test_a_result_that_is_printed_still_ends_0(real_run, tmp_path):
    """The check does not cost the ordinary case its output or its exit code."""
    result = subprocess.run([sys.executable, "-m", "dapo_train", "compare", str(real_run), "--json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.lstrip().startswith("["), result.stderr
