"""The installed `dapo-train` command as a user runs it (its sys.path[0] is its script's folder, not the
current one, unlike `python -m dapo_train`): a plugin module in the current folder imports, and
--version answers from the package metadata."""

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMAND = Path(sys.executable).parent / "dapo-train"


def console(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if not COMMAND.is_file():
        pytest.skip(f"no {COMMAND}: the package is not installed with its console script (pip install -e .)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, as the tests import it
    return subprocess.run([str(COMMAND), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_reward_module_in_the_current_folder_imports_as_the_docs_show(tmp_path):
    """docs/rewards-and-tasks.md's my_rewards.py, beside the user, named my_rewards:brevity (issue 38)."""
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, answers, *, lengths=None, prompts=None, per_token=0.01):\n"
        "    return [-per_token * n for n in lengths]\n"
    )
    done = console("config", "rewards=[{name: accuracy}, {name: 'my_rewards:brevity', args: {per_token: 0.02}}]",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "name: my_rewards:brevity" in done.stdout
    missing = console("config", "data.correctness=not_here:check", cwd=tmp_path)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip() == (
        "error: config key 'data.correctness': cannot import module 'not_here' (No module named 'not_here'); it is "
        f"looked for in the current folder ({tmp_path}), then PYTHONPATH and the installed packages"
    )


def test_version_comes_from_the_package_metadata(tmp_path):
    done = console("--version", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"dapo-train {version('dapo-train')}\n"
