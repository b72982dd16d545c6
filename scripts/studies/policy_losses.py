"""The policy objectives side by side on the embedded task: DAPO's decoupled clip, GSPO, CISPO and
Dr. GRPO's normaliser, every configs/policy_losses/ row x every seed, then one table, one JSON file
and one plot (docs/policy_losses.md reads them).

    flock /tmp/dapo_study.lock python scripts/studies/policy_losses.py   # 4 rows x seeds 1,2,3, two runs at a time
    python scripts/studies/policy_losses.py --seeds 1 --rows dapo,gspo --set train.max_steps=2   # a quicker look

Why not `dapo-train sweep`: a sweep is a grid over keys, and these rows differ in different keys
(GSPO also takes the paper's per-sequence mean; Dr. GRPO changes the advantage and the reduction,
not the objective). So, as in scripts/studies/ablation.py (whose runner this uses), a row holds only its own
settings and is laid over the demo's config (configs/tiny-cpu.yaml), every run evaluates greedily on
the whole 500-item test split at steps 0, 10, 20, 30 and 40 (the last is also its final eval), and
runs go to OUT/<row>_seed<N>/, two at a time; running the command again skips finished runs and
resumes interrupted ones.

Per row the table gives, mean ± sample std over seeds, the final accuracy with its paired difference
to the dapo row (item by item and seed by seed, 95% interval: `dapo-train compare --baseline`'s
pairing), the best accuracy, the clip fractions, the entropy of the first and last steps (the last
also paired with dapo's), the completion length and the wall time. The plot is `dapo-train plot` of
the runs: accuracy, reward, entropy, clip fractions, length and groups over steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dapo_train.study.compare import format_delta, paired_comparison, point_rows
from dapo_train.study.plot import plot
from dapo_train.study.runs import Point

from ablation import ROOT, TASKS, run_rows

ROWS_DIR = ROOT / "configs" / "policy_losses"
ROWS = ("dapo", "gspo", "cispo", "dr_grpo")  # dapo first: the baseline of the paired differences
SCHEDULE = ["eval.every_steps=10"]  # on top of the ablation's: the whole split, at every 10th step
# Compare-table key -> (header, format) of the columns after the final accuracy and its difference.
SHOWN = {
    "best_accuracy": ("best acc", ".3f"),
    "clip_frac_high": ("clip high", ".4f"), "clip_frac_low": ("clip low", ".4f"),
    "entropy_first": ("entropy first", ".3f"), "entropy_last": ("entropy last", ".3f"),
    "completion_length": ("length", ".1f"), "wall_seconds": ("wall s", ".0f"),
}


def _stat(stat: dict | None, fmt: str) -> str:
    if stat is None:
        return "-"
    return f"{stat['mean']:{fmt}}" if not stat["std"] else f"{stat['mean']:{fmt}} ± {stat['std']:{fmt}}"


def study_table(points: dict[str, Point]) -> tuple[str, dict]:
    """-> (the markdown table, each row's pairing against the first row)."""
    names, baseline = list(points), next(iter(points.values()))
    paired = {name: paired_comparison(baseline, point, {"row": "row"}) for name, point in list(points.items())[1:]}
    headers = ["row", "seeds", "final acc", f"Δ final vs {names[0]} [95% CI]", *(h for h, _ in SHOWN.values()),
               f"Δ entropy last vs {names[0]} [95% CI]"]
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for name, row in zip(names, point_rows(list(points.values()))):
        pair = paired.get(name)
        entropy = None if pair is None else pair["run_outcomes"].get("entropy_last")
        cells = [name, str(len(row["seeds"])), _stat(row["final_accuracy"], ".3f"), format_delta(pair),
                 *(_stat(row[key], fmt) for key, (_, fmt) in SHOWN.items()), format_delta(entropy)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), paired


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="Comma list of rows; the first is the baseline.")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--jobs", type=int, default=2, help="Runs at a time (one torch thread each).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Override for every run.")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "policy_losses")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "policy_losses.png")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    if unknown := sorted(set(rows) - set(ROWS)):
        parser.error(f"--rows: no row {', '.join(unknown)} (the rows are {', '.join(ROWS)})")
    seeds, started = [int(s) for s in args.seeds.split(",")], time.monotonic()
    by_row = run_rows(TASKS["tiny"], ROWS_DIR, rows, seeds, args.out, [*SCHEDULE, *args.set], args.jobs)
    text, paired = study_table({row: Point.row(row, runs) for row, runs in by_row.items()})
    elapsed = time.monotonic() - started
    text += f"\n\n{len(rows) * len(seeds)} runs, {args.jobs} at a time: {elapsed / 60:.1f} minutes"
    print(text, flush=True)
    (args.out / "policy_losses.md").write_text(text + "\n")
    (args.out / "policy_losses.json").write_text(json.dumps({"paired": paired, "elapsed_s": elapsed}, indent=1))
    plot([str(run.path) for runs in by_row.values() for run in runs], str(args.png))
    print(f"wrote {args.out / 'policy_losses.md'}, {args.out / 'policy_losses.json'} and {args.png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
