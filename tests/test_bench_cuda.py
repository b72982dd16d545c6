"""scripts/bench/bench_cuda.sh, the prepared card check, where no card is: it parses, its dry run names every
check without running one, and run for real without CUDA every check still gets a verdict line (the card's
FAIL, the rest SKIP naming why), the summary counts them and the exit status is 1. Before, `set -e` stopped it
at the first failure, with no verdict."""

import re
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench" / "bench_cuda.sh"
VERDICT = re.compile(r"^(PASS|FAIL|SKIP) \S.*$")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def summary(out: str) -> tuple[list[str], str]:
    """The verdict lines after '== summary', and the count line."""
    lines = out.split("== summary\n", 1)[1].strip().splitlines()
    return lines[:-1], lines[-1]


def test_it_parses_and_its_dry_run_names_every_check_and_runs_none():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = run("--dry-run")
    assert done.returncode == 0, done.stderr
    verdicts, counted = summary(done.stdout)
    assert len(verdicts) >= 12 and all(VERDICT.match(line) and line.startswith("SKIP ") for line in verdicts)
    assert "(dry run: card)" in verdicts[0] and counted == f"0 passed, 0 failed, {len(verdicts)} skipped"
    assert run("--bogus").returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a card this is the real check, 10 minutes")
def test_without_a_card_every_check_gets_its_verdict_and_it_exits_1():
    done = run()
    verdicts, counted = summary(done.stdout)
    assert done.returncode == 1, done.stdout[-2000:]
    assert verdicts[0].startswith("FAIL card: nvidia-smi and torch see it (exit ")
    assert all(line.startswith("SKIP ") for line in verdicts[1:]) and len(verdicts) >= 12
    assert counted == f"0 passed, 1 failed, {len(verdicts) - 1} skipped"
    before_summary = done.stdout.split("== summary\n", 1)[0].splitlines()
    assert [line for line in before_summary if VERDICT.match(line)] == verdicts  # each said as it happened
