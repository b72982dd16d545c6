"""What each recipe of the strong-start study did to its start (docs/studies.md, "A strong start"), from the
folders scripts/studies/strong_study.sh writes:

    python scripts/studies/strong_table.py outputs/strong_study [--baseline demo]

start/completions_test.jsonl (_tools.jsonl with tools) is the start's greedy eval on all 500 test items;
RECIPE_seedN/eval_items/final_N.jsonl each run's greedy eval on the same items after training. The first table
is each recipe's change from the start, strict and answer accuracy, paired item by item (and the seeds drawn as
one, every run's start being the same model): the project's paired bootstrap over seeds and items
(evaluation/stats.bootstrap_difference). The second is each recipe against the baseline recipe, paired seed by
seed and item by item. The last columns count the runs that warned they made the model worse (the run's own
check at its periodic evals on 100 items, `is worse than at step 0` in its log: the interval below 0 at two evals
in a row in the study's runs, the sign test of train/regression.py since issue 59),
the runs whose own 500-item change from the start has an interval below 0, and the runs that warned although
their own interval holds 0.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from dapo_train.evaluation.stats import bootstrap_difference

NAME = re.compile(r"^(?P<recipe>.+)_seed(?P<seed>\d+)$")
WARNED = "is worse than at step 0"  # train/regression.py's warning line
KEYS = {"strict": "correct", "answer": "answer_correct"}


def _records(path: Path) -> dict[str, dict]:
    return {record["uid"]: record for record in map(json.loads, path.read_text().splitlines())}


def _final(run: Path) -> Path | None:
    finals = sorted((run / "eval_items").glob("final_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    return finals[-1] if finals else None


def load(study: Path) -> tuple[dict[str, dict], dict[str, dict[int, dict]]]:
    """-> (the start's records by uid, recipe -> seed -> {'records': by uid, 'warned': bool, 'seconds': user s})."""
    start = _records(next((study / "start").glob("completions_test*.jsonl")))  # _tools where the config calls them
    runs: dict[str, dict[int, dict]] = {}
    for run in sorted(path for path in study.iterdir() if path.is_dir() and NAME.match(path.name)):
        final, timing = _final(run), study / f"{run.name}.time"
        times = timing.read_text().splitlines()[-1:] if timing.is_file() else []  # written when the run exits
        if final is None or not times or times[0].startswith("Command"):
            print(f"skipped {run.name}: not finished (no final eval or no time line)")
            continue
        match = NAME.match(run.name)
        log = study / f"{run.name}.log"
        runs.setdefault(match["recipe"], {})[int(match["seed"])] = {
            "records": _records(final),
            "warned": log.is_file() and WARNED in log.read_text(errors="replace"),
            "seconds": float(times[0].split()[0]),
        }
    return start, runs


def _table(start: dict, seeds: dict[int, dict], key: str, uids: list[str]) -> np.ndarray:
    return np.array([[float(seeds[s]["records"][uid][key]) for uid in uids] for s in sorted(seeds)])


def cell(diff) -> str:
    return f"{diff.difference:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]"


def changes(start: dict, seeds: dict[int, dict], uids: list[str]) -> dict:
    """A recipe's change from the start over its seeds: {'strict', 'answer': PairedDifference, 'warned': runs
    that warned, 'alone': runs whose own strict change has its interval below 0, 'seconds': mean user s}."""
    found = {}
    for name, key in KEYS.items():
        before = np.array([[float(start[uid][key]) for uid in uids]] * len(seeds))
        found[name] = bootstrap_difference(before, _table(start, seeds, key, uids), seeds_paired=True)
    strict_start = np.array([[float(start[uid]["correct"]) for uid in uids]])
    below = {s: bootstrap_difference(strict_start, _table(start, {s: seeds[s]}, "correct", uids),
                                     seeds_paired=True).high < 0 for s in seeds}
    found["alone"] = sum(below.values())
    found["warned"] = sum(run["warned"] for run in seeds.values())
    found["warned_holding_0"] = sum(run["warned"] and not below[s] for s, run in seeds.items())
    found["seconds"] = float(np.nanmean([run["seconds"] for run in seeds.values()]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--baseline", default="demo")
    args = parser.parse_args()
    start, runs = load(args.study)
    uids = sorted(start, key=lambda uid: int(uid.split(":")[1]))
    print(f"start: strict {np.mean([start[u]['correct'] for u in uids]):.3f}, answer "
          f"{np.mean([start[u]['answer_correct'] for u in uids]):.3f} on {len(uids)} items\n")
    print("| recipe | seeds | final strict | change strict [95%] | change answer [95%] | warned | below 0 alone | "
          "warned, own interval holding 0 | user s / run |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for recipe, seeds in runs.items():
        found, n = changes(start, seeds, uids), len(seeds)
        print(f"| {recipe} | {n} | {found['strict'].accuracy:.3f} | {cell(found['strict'])} | "
              f"{cell(found['answer'])} | {found['warned']}/{n} | {found['alone']}/{n} | "
              f"{found['warned_holding_0']} | {found['seconds']:.0f} |")
    if args.baseline not in runs:
        return
    base = runs[args.baseline]
    print(f"\n| recipe - {args.baseline} | seeds paired | strict [95%] | answer [95%] |")
    print("| --- | --- | --- | --- |")
    for recipe, seeds in runs.items():
        shared = sorted(set(seeds) & set(base))
        if recipe == args.baseline or not shared:
            continue
        cells = [bootstrap_difference(_table(start, {s: base[s] for s in shared}, key, uids),
                                      _table(start, {s: seeds[s] for s in shared}, key, uids), seeds_paired=True)
                 for key in KEYS.values()]
        print(f"| {recipe} | {len(shared)} | {cell(cells[0])} | {cell(cells[1])} |")


if __name__ == "__main__":
    main()
