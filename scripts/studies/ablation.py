"""The DAPO ablation (the paper's Table 1) on the embedded tasks: every configs/ablation/*.yaml row x
every seed on each task, then per task one table, one JSON file and one plot.

    python scripts/studies/ablation.py                          # both tasks, 6 rows x seeds 1-5, two runs at a time
    python scripts/studies/ablation.py --tasks tiny --seeds 1   # a quicker look
    python scripts/studies/ablation.py --tasks tiny --seeds 1 --rows 1-grpo,6-dapo --set train.max_steps=2

A row holds only its techniques' settings and is laid over the task's config (TASKS), so both tasks
run the same six rows in their own regime; every run gets the same eval schedule (EVAL_SCHEDULE:
the whole eval split at steps 0, 20 and 40, whose last is also the run's final eval). Runs go to
OUT/<task>/<row>_seed<N>/ through `dapo-train run`, two processes at a time on two cores (one torch
thread each, as the demo). Running the command again skips finished runs and resumes interrupted ones.

Per row the table gives the final greedy accuracy on the whole eval split (mean +- sample std over
seeds), its paired difference to the previous row and to row 1 with a 95% interval (item by item and
seed by seed, the machinery of `dapo-train compare --baseline`: dapo_train/study/compare.py), the generated
completions (dynamic sampling generates more for the same optimizer steps), how often the soft
overlong punishment fired, the truncated share, and the wall time. The plot shows eval accuracy
against both optimizer steps and generated completions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dapo_train.config.load import config_to_dict, load_config, save_config
from dapo_train.config.schema import Config
from dapo_train.run.checkpoint import checkpoint_dirs
from dapo_train.study.compare import format_delta, paired_comparison
from dapo_train.study.runs import Point, RunRecord, load_run, summarize_metrics

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"tiny": ROOT / "configs" / "tiny-cpu.yaml", "long": ROOT / "configs" / "tiny-long-cpu.yaml"}
EVAL_SCHEDULE = ["eval.every_steps=20", "eval.num_items=0", "eval.print_samples=0"]


def row_config(task: Path, row: Path, overrides: list[str]) -> Config:
    """The task's resolved config <- the row's techniques <- the eval schedule <- overrides."""
    base = config_to_dict(load_config(str(task), ["run_name=ablation", "output_dir=ablation"]))
    return load_config(str(row), [*EVAL_SCHEDULE, *overrides], base=base)


def run_one(task: Path, row: Path, seed: int, out: Path, extra: list[str]) -> Path:
    """Train one row and seed unless it already finished; a run with checkpoints resumes."""
    run_dir = out / f"{row.stem}_seed{seed}"
    cfg = row_config(task, row, [*extra, f"seed={seed}", f"output_dir={run_dir}", f"run_name={run_dir.name}"])
    if (run_dir / f"checkpoint_{cfg.train.max_steps}").is_dir():
        return run_dir
    out.mkdir(parents=True, exist_ok=True)
    config = out / f"{run_dir.name}.yaml"
    save_config(cfg, config)
    command = ["dapo-train", "run", str(config), "logging.progress_bar=false"]
    if checkpoint_dirs(run_dir):
        command = ["dapo-train", "run", "--resume", str(run_dir), "logging.progress_bar=false"]
    with open(out / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed (exit {done.returncode}); see {out / run_dir.name}.log")
    print(f"done {run_dir}", flush=True)
    return run_dir


def run_rows(task: Path, rows_dir: Path, rows: list[str], seeds: list[int], out: Path, extra: list[str],
             jobs: int) -> dict[str, list[RunRecord]]:
    """Every row (rows_dir/<row>.yaml) x seed of a study on `task`, `jobs` runs at a time, every config
    built and checked before the first run starts. -> each row's runs, read once, in seed order."""
    for row in rows:
        row_config(task, rows_dir / f"{row}.yaml", extra)
    pairs = [(row, seed) for seed in seeds for row in rows]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        run_dirs = list(pool.map(lambda job: run_one(task, rows_dir / f"{job[0]}.yaml", job[1], out, extra), pairs))
    return {row: [load_run(run) for (name, _), run in zip(pairs, run_dirs) if name == row] for row in rows}


def summarize(run: RunRecord) -> dict:
    """One run's numbers: accuracy and wall time as `compare` reads them (report.summarize_metrics), and
    what only this table shows (generated completions, the accuracy curve, overlong and truncation)."""
    rows, cfg = run.rows, run.config
    shared = summarize_metrics(rows)
    per_step = cfg["train.prompts_per_step"] * cfg["rollout.group_size"]
    optimizer_steps = cfg["train.updates_per_step"] * cfg["dapo.num_iterations"]
    completions, curve = 0, []
    for r in rows:
        if r["step"] > 0:
            completions += r.get("gen_rounds", 1) * per_step
        if "accuracy" in r:
            curve.append((r["step"] * optimizer_steps, completions, r["accuracy"]))
    train_rows = [r for r in rows if r["step"] > 0]
    fired = [r["rewards/overlong/mean"] != 0 for r in train_rows if "rewards/overlong/mean" in r]
    final = shared["final_accuracy"]
    return {
        "final": shared["last_accuracy"] if final is None else final,
        "best": shared["best_accuracy"],
        "completions": completions,
        "wall": shared["wall_seconds"],
        "length_max": max(r["completion_length_max"] for r in train_rows),
        "truncated": statistics.mean(r["truncated_ratio"] for r in train_rows),
        "overlong_steps": (sum(fired) / len(fired)) if fired else None,
        "curve": curve,
    }


def paired_to(rows: dict[str, list[RunRecord]]) -> dict[str, dict]:
    """Each row's final accuracy against the previous row and against row 1, item by item and seed
    by seed (pairing.paired_comparison): the difference, its 95% interval and the rest."""
    points = {row: Point.row(row, runs) for row, runs in rows.items()}
    names, labels = list(points), {"row": "row"}
    out = {}
    for i, row in enumerate(names[1:], start=1):
        previous = paired_comparison(points[names[i - 1]], points[row], labels)
        first = previous if i == 1 else paired_comparison(points[names[0]], points[row], labels)
        out[row] = {"vs_previous": previous, "vs_first": first}
    return out


def _mean_std(values: list[float], digits: int) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(results: dict[str, list[dict]], paired: dict[str, dict], items: int) -> str:
    lines = [
        f"| row | seeds | final acc ({items}) | Δ vs previous row [95% CI] | Δ vs row 1 [95% CI] | completions | "
        "steps with overlong penalty | truncated | longest completion | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, runs in results.items():
        fired = [r["overlong_steps"] for r in runs if r["overlong_steps"] is not None]
        against = paired.get(row, {})
        lines.append(
            f"| {row} | {len(runs)} | {_mean_std([r['final'] for r in runs], 3)} | "
            f"{format_delta(against.get('vs_previous'))} | {format_delta(against.get('vs_first'))} | "
            f"{_mean_std([r['completions'] for r in runs], 0)} | {_mean_std(fired, 2) if fired else '-'} | "
            f"{_mean_std([r['truncated'] for r in runs], 3)} | {max(r['length_max'] for r in runs)} | "
            f"{_mean_std([r['wall'] for r in runs], 0)} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for row, runs in results.items():
        for axis, index, label in ((axes[0], 0, "optimizer steps"), (axes[1], 1, "generated completions")):
            xs = [statistics.mean(point[index] for point in points) for points in zip(*(r["curve"] for r in runs))]
            accs = list(zip(*([point[2] for point in r["curve"]] for r in runs)))
            axis.plot(xs, [statistics.mean(a) for a in accs], marker="o", label=row)
            axis.fill_between(xs, [min(a) for a in accs], [max(a) for a in accs], alpha=0.15)
            axis.set_xlabel(label)
            axis.grid(alpha=0.3)
    axes[0].set_ylabel("greedy accuracy, whole eval split")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"DAPO ablation on the {task} task: mean over seeds, band = min-max")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run_task(task: str, rows: list[Path], seeds: list[int], args: argparse.Namespace) -> None:
    """All runs of one task, then its table (printed and ablation.md), ablation.json and the plot."""
    out, started = args.out / task, time.monotonic()
    jobs = [(row, seed) for seed in seeds for row in rows]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        run_dirs = list(pool.map(lambda job: run_one(TASKS[task], job[0], job[1], out, args.set), jobs))
    by_row: dict[str, list[RunRecord]] = {row.stem: [] for row in rows}
    for (row, _), run_dir in zip(jobs, run_dirs):
        by_row[row.stem].append(load_run(run_dir))  # each run's files read once, for both tables
    results = {row: [summarize(run) for run in runs] for row, runs in by_row.items()}
    paired = paired_to(by_row)
    items = next(iter(paired.values()))["vs_first"]["items"] if paired else 0
    elapsed = time.monotonic() - started
    text = f"{table(results, paired, items)}\n\n{len(jobs)} runs, {args.jobs} at a time: {elapsed / 60:.1f} minutes"
    print(f"\n{task} task\n{text}", flush=True)
    (out / "ablation.md").write_text(text + "\n")
    (out / "ablation.json").write_text(json.dumps({"runs": results, "paired": paired, "elapsed_s": elapsed}, indent=1))
    png = args.png_dir / f"ablation_{task}.png"
    plot(results, png, task)
    print(f"wrote {out / 'ablation.md'}, {out / 'ablation.json'} and {png}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="tiny,long", help=f"Comma list of {', '.join(TASKS)}.")
    parser.add_argument("--configs", type=Path, default=ROOT / "configs" / "ablation")
    parser.add_argument("--rows", default=None, help="Comma list of row names (default: every row).")
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--jobs", type=int, default=2, help="Runs at a time (one torch thread each).")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Override for every run.")
    parser.add_argument("--out", type=Path, default=Path("outputs") / "ablation")
    parser.add_argument("--png-dir", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    rows = sorted(args.configs.glob("*.yaml"))
    if args.rows is not None:
        wanted = args.rows.split(",")
        unknown = sorted(set(wanted) - {row.stem for row in rows})
        if unknown:
            parser.error(f"--rows: no row {', '.join(unknown)} in {args.configs}")
        rows = [row for row in rows if row.stem in wanted]
    tasks = args.tasks.split(",")
    for task in tasks:
        if task not in TASKS:
            parser.error(f"--tasks: unknown task {task!r}; the tasks are {', '.join(TASKS)}")
        if not TASKS[task].is_file():
            parser.error(f"--tasks {task}: {TASKS[task]} is missing")
        for row in rows:  # every run's config is built (and checked) before the first run starts
            row_config(TASKS[task], row, args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    for task in tasks:
        run_task(task, rows, seeds, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
