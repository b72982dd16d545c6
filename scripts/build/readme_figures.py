"""The README's demo figures, from the demo itself: runs `dapo-train run` (the embedded demo, exactly as a
user does, in a fresh folder), reads what it logged, and checks or rewrites the marked block of README.md's
Quick start (accuracy at every eval, the final accuracy with its interval, tokens generated and positions
computed per trained token, trained tokens).

    python scripts/build/readme_figures.py            # check: exit 1 and the difference when they drift
    python scripts/build/readme_figures.py --write    # rewrite the block from this machine's run

About 90 s on the project's 2-core machine. tests/test_readme_figures.py runs the check in CI. The figures
are exact on one kind of machine (the demo trains on one thread, seeded), but another CPU's kernels (torch's
AVX2 against AVX512, another maker's) round differently and part from them after some 30 steps (the 2-core
machine of an earlier session gave 0.326 at the end where this one gives 0.330): the block names the
machine it was written on (`machine()`), and the check compares only on a machine of that name, saying so
elsewhere. The measured wall time, the core count and the date are kept as written: time varies with the
machine's load.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
WARM_START = ROOT / "dapo_train" / "assets" / "tiny" / "model" / "build_info.json"
START = "<!-- demo-figures: scripts/build/readme_figures.py -->"  # the block ends at END, on its last line
END = "<!-- /demo-figures -->"
WIDTH = 104  # characters per line, as the README's prose
# The part of the block that is measured, not reproduced: kept as the README has it when checking.
MEASURED = re.compile(r"(\d+) s\s+with\s+start-up\s+on\s+a\s+(\d+)-core\s+CPU,\s+(\d{4}-\d{2}-\d{2})")


@dataclass(frozen=True)
class Measured:
    seconds: int
    cores: int
    date: str

    def text(self) -> str:
        return f"{self.seconds} s with start-up on a {self.cores}-core CPU, {self.date}"


def machine() -> str:
    """What decides the demo's rounding here: torch's CPU kernels (AVX512, AVX2, ...) and the processor's
    name (its maker's math libraries' paths), e.g. 'AVX512 kernels on an AMD EPYC'."""
    import platform

    import torch

    name = platform.processor() or "a CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:  # no /proc: the platform's name
        pass
    article = "an" if name[:1].upper() in "AEIOU" else "a"
    return f"{torch.backends.cpu.get_cpu_capability()} kernels on {article} {name}"


# The machine the block names (render's "with torch's ... (another CPU's").
STATED_MACHINE = re.compile(r"with\s+torch's\s+(.+?)\s+\(another\s+CPU's", re.DOTALL)


def stated_machine(readme: str) -> str | None:
    """The machine README.md's block was written on, one line."""
    found = STATED_MACHINE.search(block(readme))
    return " ".join(found[1].split()) if found else None


@dataclass(frozen=True)
class Figures:
    """What one demo run logged, as the README states it."""

    kernels: str  # machine(): torch's CPU kernels and the processor: another one rounds differently
    accuracies: tuple[tuple[int, float], ...]  # (step, greedy accuracy on the fixed eval items)
    eval_items: int
    final: float  # on the whole eval split at the end, with its 95% interval
    final_low: float
    final_high: float
    final_items: int
    warm_start: float  # the shipped model's greedy accuracy on the whole split (its build_info.json)
    generated_per_trained: float
    forward_per_trained: float
    padding: float  # share of the update's forward positions that are padding
    head_tokens: int
    trained_tokens: int


def run_demo(folder: Path) -> tuple[Path, Measured]:
    """`dapo-train run` with no argument in `folder` (a fresh clone's demo) -> its run folder, and the time."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dapo_train", "run"], cwd=folder, capture_output=True, text=True)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"the demo failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (run_dir,) = [path.parent for path in (folder / "outputs").glob("*/metrics.jsonl")]
    return run_dir, Measured(round(seconds), os.cpu_count() or 1, datetime.date.today().isoformat())


def read_figures(run_dir: Path) -> Figures:
    from dapo_train.run.logs import generation_cost, read_metrics
    from dapo_train.train.summary import update_work

    rows = read_metrics(run_dir)
    evals = [row for row in rows if "accuracy" in row]
    last, work = rows[-1], update_work(rows)
    return Figures(
        kernels=machine(),
        accuracies=tuple((row["step"], row["accuracy"]) for row in evals),
        eval_items=int(evals[-1]["eval/num_items"]),
        final=last["final_accuracy"], final_low=last["final/accuracy_ci95_low"],
        final_high=last["final/accuracy_ci95_high"], final_items=int(last["final/num_items"]),
        warm_start=json.loads(WARM_START.read_text(encoding="utf-8"))["greedy_accuracy"],
        generated_per_trained=generation_cost(rows)["generated_per_trained_token"],
        forward_per_trained=work["forward_per_token"], padding=work["padding_frac"],
        head_tokens=work["head_tokens"], trained_tokens=work["trained_tokens"],
    )


def _share(value: float) -> str:
    """An accuracy in two decimals where they are exact (23 of 100 items: 0.23), else in three (0.330)."""
    return f"{value:.2f}" if abs(value - round(value, 2)) < 1e-9 else f"{value:.3f}"


def render(fig: Figures, measured: Measured) -> str:
    """The block's paragraph, wrapped as the README's prose is."""
    (first_step, first), *rest = fig.accuracies
    padding = "none of them padding" if fig.padding == 0 else f"{100 * fig.padding:.1f}% of them padding"
    head = (f"its LM head exactly the {fig.trained_tokens:,} trained tokens" if fig.head_tokens == fig.trained_tokens
            else f"its LM head {fig.head_tokens:,} of them for the {fig.trained_tokens:,} trained tokens")
    text = (
        f"`dapo-train run` (seed 0) took {measured.text()} ([benchmarks.md](docs/benchmarks.md#the-demo-cpu)), "
        f"with torch's {fig.kernels} (another CPU's round differently: its figures part from these). "
        f"Greedy accuracy on the {fig.eval_items} fixed eval "
        f"items: {_share(first)} at step {first_step} (the warm start), {' / '.join(_share(a) for _, a in rest)} at "
        f"steps {rest[0][0]}-{rest[-1][0]}; on all {fig.final_items} test items {fig.final:.3f} at the end (95% CI "
        f"{fig.final_low:.3f}-{fig.final_high:.3f}) against {fig.warm_start:.3f} for the warm start. Per trained "
        f"token the run generated {fig.generated_per_trained:.2f} tokens and the update computed "
        f"{fig.forward_per_trained:.2f} positions, {padding}, {head}. `python scripts/build/readme_figures.py` "
        "checks these figures."
    )
    return _wrap(text)


def _wrap(text: str) -> str:
    """Lines of at most WIDTH characters."""
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line])


def block(readme: str) -> str:
    """The text between the markers."""
    if START not in readme or END not in readme:
        raise SystemExit(f"{README}: no block between {START} and {END}")
    return readme.split(START, 1)[1].split(END, 1)[0].strip()


def difference(readme: str, fig: Figures) -> str | None:
    """None when the README's block states `fig` (its measured part aside), else a diff against what it should."""
    found = block(readme)
    said = MEASURED.search(found)
    measured = Measured(int(said[1]), int(said[2]), said[3]) if said else Measured(0, 0, "?")
    expected = render(fig, measured)
    if found == expected:
        return None
    diff = difflib.unified_diff(found.splitlines(), expected.splitlines(), "README.md", "this machine's demo",
                                lineterm="")
    return "\n".join(diff)


def rewrite(readme: str, fig: Figures, measured: Measured) -> str:
    head, rest = readme.split(START, 1)
    text = render(fig, measured)
    end = f" {END}" if len(text.rsplit("\n", 1)[-1]) + 1 + len(END) <= WIDTH else f"\n{END}"
    return f"{head}{START}\n{text}{end}{rest.split(END, 1)[1]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md's block from this machine's run")
    args = parser.parse_args()
    readme, here = README.read_text(encoding="utf-8"), machine()
    if not args.write and stated_machine(readme) != here:
        print(f"the README's demo figures are for {stated_machine(readme)}, and this is {here}: their rounding "
              "differs, so nothing was compared (--write states this machine's)")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        run_dir, measured = run_demo(Path(folder))
        fig = read_figures(run_dir)
    if args.write:
        README.write_text(rewrite(readme, fig, measured), encoding="utf-8")
        print(f"wrote {README}'s demo figures ({measured.text()})")
        return 0
    problem = difference(readme, fig)
    if problem is None:
        print(f"{README}'s demo figures are this machine's demo ({measured.text()})")
        return 0
    print(f"{problem}\nthe README's demo figures drifted; rewrite them: python scripts/build/readme_figures.py --write")
    return 1


if __name__ == "__main__":
    sys.exit(main())
