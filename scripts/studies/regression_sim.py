"""The regression stop's false alarms and detection delay, by simulation and on real runs (docs/studies.md, "The
regression stop"):

    python scripts/studies/regression_sim.py [--runs 2000] [--drop-runs 500]    # both simulated tables
    python scripts/studies/regression_sim.py --runs-dir outputs/regression_runs  # the runs regression_runs.sh made

At the defaults the flat table took 149 s of CPU and the drop table 64 s (2026-12-06, this 2-core machine).

A simulated run: N fixed eval items, each with its own chance q of being answered right, drawn from a Beta law
whose mean is the start's accuracy and whose spread sets `flips`, the share of items an eval of an unchanged
model grades differently from step 0 once its grades are fresh (2 E[q (1 - q)]). Step 0 grades every item once;
at each of the m periodic evals an item keeps its last grade with chance `keep` (one checkpoint resembles the
last) or is graded afresh. A flat run keeps every q; a run made to get worse multiplies every q by (1 - drop /
accuracy) from its first eval on, so its expected accuracy falls by `drop`. Strict and answer accuracy are the
same grades here (the tiny world's format rate is 100%), so the two tests agree and half the bound's factor 2 is
slack. Each eval goes through the code's own statistics and verdict: evaluation/stats.shared_items and
discordant_test (the exact one-sided sign test) and train/regression.Rule and EvalTest.fell (its bound). Beside it,
the rule before issue 59: the 95% paired bootstrap interval (stats.bootstrap_difference, 10,000 replicates, its
fixed seed) under 0 at two evals in a row; the interval is computed once per count of items lost and gained, the
items in a fixed order (the fixed seed gives two evals with the same items flipped the same interval).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dapo_train.evaluation.stats import bootstrap_difference, discordant_test, shared_items, wilson_interval
from dapo_train.train.regression import ACCURACIES, EvalTest, Rule, eval_test

SCHEDULES = (4, 8, 30)  # periodic evals: the demo's 40 steps / 10, twice that, qwen1.5b.yaml's 150 / 5
STARTS = {"tiny": 0.66, "Qwen": 0.73}  # the start's accuracy on its 100 eval items


@dataclass(frozen=True)
class World:
    """A simulated run's eval items (see the module docstring)."""

    items: int
    accuracy: float
    flips: float
    keep: float


@dataclass(frozen=True)
class Outcome:
    """Where each rule first called a simulated run regressed: the eval's index from 1, None when it never did."""

    new: int | None
    old: int | None


def chances(world: World, rng: np.random.Generator) -> np.ndarray:
    """(N,) each item's chance of a right answer: Beta(a k, (1 - a) k), k set so that 2 E[q (1 - q)] = flips."""
    share = world.flips / (2 * world.accuracy * (1 - world.accuracy))  # E[q (1 - q)] = a (1 - a) k / (k + 1)
    spread = share / (1 - share)
    return rng.beta(world.accuracy * spread, (1 - world.accuracy) * spread, size=world.items)


def records(grades: np.ndarray) -> list[dict]:
    """Eval records as the run writes them (the fields the paired statistics read), one per item."""
    return [{"uid": f"sim:{i}", "gold": "0", "correct": bool(g), "answer_correct": bool(g)} for i, g in
            enumerate(grades)]


@functools.cache
def old_high(lost: int, gained: int, items: int) -> float:
    """The upper end of the old rule's 95% interval of the change at these counts (the code's bootstrap)."""
    rest = items - lost - gained
    before = np.array([[1] * lost + [0] * gained + [0] * rest], dtype=float)
    after = np.array([[0] * lost + [1] * gained + [0] * rest], dtype=float)
    return bootstrap_difference(before, after, seeds_paired=True).high


def evals_of(world: World, evals: int, drop: float, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """One run's grades, (N,) bools: step 0's, then each of its `evals` periodic evals'."""
    q = chances(world, rng)
    grades = rng.random(world.items) < q
    yield grades
    later = q * (1 - drop / world.accuracy)
    for _ in range(evals):
        fresh = rng.random(world.items) < later
        grades = np.where(rng.random(world.items) < world.keep, grades, fresh)
        yield grades


def simulate_run(world: World, evals: int, drop: float, rng: np.random.Generator, old: bool = True) -> Outcome:
    """One run of `evals` periodic evals: each rule's first eval that calls it regressed (the old rule's None
    unless `old`)."""
    rule, run = Rule(0.01, evals), evals_of(world, evals, drop, rng)
    start = records(next(run))
    new_at = old_at = None
    below = False  # the last eval's interval lay under 0 (the old rule)
    for index, grades in enumerate(run, start=1):
        shared = shared_items(start, records(grades))
        tests = {name: discordant_test(shared, key) for name, key in zip(ACCURACIES, ("correct", "answer_correct"))}
        if new_at is None and EvalTest(index, tests, world.items, rule.bound).fell():
            new_at = index
        if old:
            now_below = old_high(tests["strict"].lost, tests["strict"].gained, world.items) < 0
            old_at = index if old_at is None and below and now_below else old_at
            below = now_below
        if new_at is not None and (old_at is not None or not old):
            break
    return Outcome(new_at, old_at)


def rate(outcomes: list[Outcome], rule: str) -> str:
    """'0.3% [0.2, 0.5]': the share of runs the rule called regressed, with its 95% Wilson interval."""
    fired = sum(getattr(o, rule) is not None for o in outcomes) / len(outcomes)
    low, high = wilson_interval(fired, len(outcomes))
    return f"{100 * fired:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def delay(outcomes: list[Outcome], rule: str) -> str:
    """'94%, eval 2': the share detected and the median eval of detection (1 = the first after step 0)."""
    found = [getattr(o, rule) for o in outcomes if getattr(o, rule) is not None]
    if not found:
        return "0%"
    return f"{100 * len(found) / len(outcomes):.0f}%, eval {statistics.median(found):g}"


def header(first: list[str]) -> Iterator[str]:
    yield "| " + " | ".join(first + [f"{m} evals: new (old)" for m in SCHEDULES]) + " |"
    yield "|" + " --- |" * (len(first) + len(SCHEDULES))


def flat_table(runs: int, seed: int) -> Iterator[str]:
    """False alarms of flat runs: the share stopped, new rule and (old rule), by start, flips, keep and schedule."""
    yield from header(["start", "items", "flips", "keep"])
    for name, accuracy in STARTS.items():
        for flips in (0.05, 0.10, 0.20):
            for keep in (0.0, 0.5):
                world, cells = World(100, accuracy, flips, keep), []
                for evals in SCHEDULES:
                    rng = np.random.default_rng([seed, evals, int(100 * flips), int(10 * keep), int(100 * accuracy)])
                    outcomes = [simulate_run(world, evals, 0.0, rng) for _ in range(runs)]
                    cells.append(f"{rate(outcomes, 'new')} ({rate(outcomes, 'old')})")
                yield f"| {name} {accuracy:.2f} | 100 | {flips:.2f} | {keep:g} | " + " | ".join(cells) + " |"


def drop_table(runs: int, seed: int) -> Iterator[str]:
    """Runs made to get worse from Qwen's start, a tenth of the items flipping: the share detected and the median
    eval of detection, new rule and (old rule; not on 500 items, where its bootstrap once per count costs hours)."""
    yield from header(["items", "drop", "keep"])
    for items in (100, 500):
        old = items == 100
        for drop in (0.05, 0.10, 0.20, 0.40):
            for keep in (0.0, 0.5):
                world, cells = World(items, STARTS["Qwen"], 0.10, keep), []
                for evals in SCHEDULES:
                    rng = np.random.default_rng([seed, evals, items, int(100 * drop), int(10 * keep), 1])
                    outcomes = [simulate_run(world, evals, drop, rng, old) for _ in range(runs)]
                    cells.append(f"{delay(outcomes, 'new')} ({delay(outcomes, 'old') if old else '-'})")
                yield f"| {items} | {drop:.2f} | {keep:g} | " + " | ".join(cells) + " |"


def run_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def run_line(folder: Path) -> str:
    """One real run: its evals, where the new rule stopped it, where the old one would have, its figures."""
    evals = [row for row in run_rows(folder) if "eval/change_p" in row]
    tests = [eval_test(int(row["step"]), row) for row in evals]
    stopped = next((t.step for t in tests if t.fell()), None)
    old = next((b["step"] for a, b in zip(evals, evals[1:]) if a["eval/change_high"] < 0 and b["eval/change_high"] < 0),
               None)
    least = min(evals, key=lambda row: row["eval/change_p"])
    flips = max((row["eval/change_lost"] + row["eval/change_gained"]) / row["eval/change_items"] for row in evals)
    timing = folder.with_suffix(".time")
    times = timing.read_text().splitlines() if timing.is_file() else []  # its last line once the run ended
    seconds = times[-1].split()[0] if times else "-"
    smallest = (f"{least['eval/change_lost']} lost, {least['eval/change_gained']} gained, p = "
                f"{least['eval/change_p']:.1e} (step {least['step']})")
    return (f"| {folder.name} | {len(evals)} | {'-' if stopped is None else stopped} | {'-' if old is None else old} "
            f"| {smallest} | {evals[-1]['eval/change']:+.2f} | {flips:.2f} | {seconds} |")


def runs_table(directory: Path) -> list[str]:
    lines = ["| run | evals | new rule stopped at step | old rule would have at step | its smallest p (strict) | "
             "last change | most items flipped | user s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    folders = sorted(path for path in directory.iterdir() if (path / "metrics.jsonl").is_file())
    return lines + [run_line(folder) for folder in folders]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="simulated flat runs per cell")
    parser.add_argument("--drop-runs", type=int, default=500, help="simulated runs made to get worse per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tables", nargs="+", choices=("flat", "drop"), default=["flat", "drop"])
    parser.add_argument("--runs-dir", type=Path, help="tabulate the real runs of regression_runs.sh instead")
    args = parser.parse_args()
    if args.runs_dir is not None:
        print("\n".join(runs_table(args.runs_dir)))
        return
    tables = {"flat": flat_table, "drop": drop_table}
    for name in args.tables:
        print(f"\n{name}:", flush=True)
        for line in tables[name](args.runs if name == "flat" else args.drop_runs, args.seed):
            print(line, flush=True)  # a long table: each line as it comes


if __name__ == "__main__":
    main()
