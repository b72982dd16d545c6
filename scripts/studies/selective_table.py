"""What each run of a selective-rollout study did, summed over its steps, and each setting against a
baseline seed by seed (docs/studies.md, "Selective rollouts: history, the long task, round sizing").

    python scripts/studies/selective_table.py outputs/selective_study/history --baseline off

A study folder holds runs named SETTING_seedN (scripts/studies/selective_study.sh) with, beside each,
SETTING_seedN.time: the `/usr/bin/time -f '%U %S %e'` line (user, system and wall seconds). The first
table is mean +- sample std over a setting's seeds; the second the mean difference from the baseline
over the seeds both ran, with its Student t 95% interval, and the relative change of the means.
Accuracy at equal time pairs the baseline run's last periodic eval with the setting's last periodic
eval made within the baseline run's training seconds (the sum of seconds_step: evals left out).
Intervals here are over seeds only; `dapo-train compare` gives accuracy's paired bootstrap over items
and seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from dapo_train.evaluation.stats import t_interval
from dapo_train.run.logs import generation_cost

NAME = re.compile(r"^(?P<setting>.+)_seed(?P<seed>\d+)$")
# column -> what it is, in the paired table
COLUMNS = {
    "gen/trained": "generated tokens per trained token",
    "generated": "tokens generated",
    "trained": "tokens trained",
    "groups": "groups trained",
    "drawn": "prompts drawn",
    "skipped": "prompts skipped on their history",
    "screened out": "prompts ruled out by their screen",
    "rounds": "generation rounds",
    "short": "groups short (steps not filled)",
    "gen s": "generation seconds",
    "CPU s": "CPU seconds (user + system)",
    "wall s": "wall seconds",
    "final acc": "final accuracy (whole eval split)",
    "last acc": "accuracy at the last step (the periodic eval's items)",
}
# Paired only: the setting's last periodic eval made within the baseline run's training seconds.
EQUAL_TIME = "accuracy at the baseline's training seconds (periodic eval's items)"


def _time(path: Path) -> tuple[float, float] | None:
    """(CPU s, wall s) from the .time file's last line, or None for a run that did not finish."""
    if not path.is_file():
        return None
    lines = path.read_text().split("\n")
    fields = [line for line in lines if line.strip()]
    if not fields or any(line.startswith("Command") for line in lines):
        return None
    user, system, wall = (float(x) for x in fields[-1].split())
    return user + system, wall


def run_outcomes(run: Path) -> dict[str, float] | None:
    timed = _time(run.with_name(run.name + ".time"))
    metrics = run / "metrics.jsonl"
    if timed is None or not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [row for row in rows if "generated_tokens" in row]

    def total(key: str) -> float:
        return float(sum(row.get(key) or 0 for row in steps))

    screened = total("groups_screened_all_wrong") + total("groups_screened_all_right")
    dropped = total("groups_dropped_all_wrong") + total("groups_dropped_all_correct")
    kept = total("groups_kept")
    finals = [row["final_accuracy"] for row in rows if row.get("final_accuracy") is not None]
    evals, seconds = [], 0.0  # (training seconds so far, accuracy) at each periodic eval
    for row in rows:
        seconds += row.get("seconds_step") or 0.0
        if row.get("accuracy") is not None:
            evals.append((seconds, row["accuracy"]))
    cost = generation_cost(steps)  # the run's own end-of-run figures
    return {
        "gen/trained": cost["generated_per_trained_token"],
        "generated": cost["generated_tokens"],
        "trained": cost["trained_tokens"],
        "groups": kept,
        # every prompt a round started: trained, left in the carry-over buffer, dropped, ruled out or skipped
        "drawn": kept + float(steps[-1].get("buffer_size") or 0) + dropped + screened + total("prompts_skipped"),
        "skipped": total("prompts_skipped"),
        "screened out": screened,
        "rounds": total("gen_rounds"),
        "short": total("batch_short"),
        "gen s": total("seconds_generate"),
        "CPU s": timed[0],
        "wall s": timed[1],
        "final acc": finals[-1] if finals else float("nan"),
        "last acc": evals[-1][1] if evals else float("nan"),
        "train s": seconds,
        "evals": evals,
    }


def accuracy_within(outcomes: dict, seconds: float) -> float:
    """The run's last periodic eval made within `seconds` of training (step 0's, made before any)."""
    return [acc for spent, acc in outcomes["evals"] if spent <= seconds + 1e-9][-1]


def load(folder: Path) -> dict[str, dict[int, dict[str, float]]]:
    settings: dict[str, dict[int, dict[str, float]]] = {}
    for run in sorted(folder.iterdir()):
        found = NAME.match(run.name)
        if not run.is_dir() or not found:
            continue
        outcomes = run_outcomes(run)
        if outcomes is not None:
            settings.setdefault(found["setting"], {})[int(found["seed"])] = outcomes
    return settings


def _cell(values: list[float], digits: int) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):,.{digits}f} ± {spread:,.{digits}f}"


def _digits(column: str) -> int:
    return {"final acc": 3, "last acc": 3, "gen/trained": 2, "short": 1}.get(column, 0)


def tables(settings: dict[str, dict[int, dict[str, float]]], baseline: str) -> str:
    out = ["| setting | seeds | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for name, runs in settings.items():
        cells = [_cell([r[c] for r in runs.values()], _digits(c)) for c in COLUMNS]
        out.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    if baseline not in settings:
        return "\n".join(out)
    base = settings[baseline]
    out += ["", f"paired against {baseline} seed by seed: mean difference [Student t 95%], relative change",
            "", "| outcome | " + " | ".join(n for n in settings if n != baseline) + " |",
            "|---" * len(settings) + "|"]
    for column in [*COLUMNS, EQUAL_TIME]:
        cells = []
        for name, runs in settings.items():
            if name == baseline:
                continue
            seeds = sorted(set(runs) & set(base))
            if column == EQUAL_TIME:
                diffs = [accuracy_within(runs[s], base[s]["train s"]) - base[s]["last acc"] for s in seeds]
            else:
                diffs = [runs[s][column] - base[s][column] for s in seeds]
            if len(diffs) < 2:
                cells.append("-")
                continue
            got = t_interval(diffs)
            accuracy = column in (EQUAL_TIME, "final acc", "last acc")
            digits = 3 if accuracy else _digits(column) + 1
            mean_base = 0.0 if accuracy else statistics.fmean(base[s][column] for s in seeds)
            relative = f" ({got.mean / mean_base:+.1%})" if mean_base else ""
            cells.append(f"{got.mean:+,.{digits}f} [{got.low:+,.{digits}f}, {got.high:+,.{digits}f}]{relative}")
        out.append(f"| {COLUMNS.get(column, column)} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a study folder of SETTING_seedN runs")
    parser.add_argument("--baseline", default="off", help="the setting the others are paired against")
    args = parser.parse_args()
    print(tables(load(args.folder), args.baseline))


if __name__ == "__main__":
    main()
