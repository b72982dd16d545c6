"""What the recipes that kept the strong start do over longer horizons (docs/studies.md, "A strong start over
longer horizons"), from the folders `HORIZONS="40 200 500" scripts/studies/strong_study.sh` writes:

    python scripts/studies/strong_horizons.py outputs/strong_horizons [--figure outputs/strong_horizons.png]

Each RECIPE_seedN is one run trained in legs (to the first horizon, then resumed to each next one);
eval_items/step_<H>.jsonl is its greedy eval at step H and sampled_<H>.jsonl its K samples per item, on the same
items, each paired with the run's own step 0 (step_0.jsonl, sampled_0.jsonl). The first table is each recipe's
change from its start at each horizon: greedy strict accuracy, sampled pass@1, maj@K and pass@K (per item: the
share of the K right, the majority answer right, any of the K right; evaluation/sampled.py), and sampled pass@1
graded on the answer alone (the format's part in a change), pooled over the seeds
by the project's paired bootstrap over seeds and items (evaluation/stats.bootstrap_difference: one draw of the
seeds for both sides, each seed paired with its own start). The second is the training between the horizons: the
mean reward, the training accuracy, and the share of generated groups that could train (neither all right nor all
wrong, Eq. 11) beside those all right and all wrong, and the CPU seconds of a run (user, all legs). The third
compares the recipes at the last horizon: each minus --against's, seed paired with seed. --figure
draws the same per step: each recipe's reward and share of groups that could train, the mean over its seeds,
smoothed by a trailing mean over --window steps.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import yaml

from dapo_train.evaluation.sampled import item_scores, samples_per_item, score_label
from dapo_train.evaluation.stats import bootstrap_difference

from strong_table import NAME, cell

LEG = re.compile(r"\.to(?P<steps>\d+)\.time$")
SCORES = ("pass_at_1", "maj_at_k", "pass_at_k")
ANSWER = "answer_pass_at_1"  # pass@1 graded on the answer alone: the format's share of a change shows beside it


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _finished(time_file: Path) -> bool:
    lines = time_file.read_text().splitlines() if time_file.is_file() else []
    return bool(lines) and not any(line.startswith("Command") for line in lines)


def load(study: Path) -> dict[str, dict[int, Path]]:
    """recipe -> seed -> run folder, for the runs whose every leg finished."""
    runs: dict[str, dict[int, Path]] = {}
    for run in sorted(path for path in study.iterdir() if path.is_dir() and NAME.match(path.name)):
        legs = sorted(study.glob(f"{run.name}.to*.time"))
        if not legs or not all(_finished(leg) for leg in legs):
            print(f"skipped {run.name}: a leg has not finished (no time line)")
            continue
        match = NAME.match(run.name)
        runs.setdefault(match["recipe"], {})[int(match["seed"])] = run
    return runs


def horizons(study: Path, runs: dict[str, dict[int, Path]]) -> list[int]:
    """The steps every run has both evals of (its legs' ends), in order."""
    found = None
    for seeds in runs.values():
        for run in seeds.values():
            steps = {int(LEG.search(leg.name)["steps"]) for leg in study.glob(f"{run.name}.to*.time")}
            found = steps if found is None else found & steps
    return sorted(found or ())


def greedy_table(runs: list[Path], step: int) -> np.ndarray:
    """(seeds, items) strict correctness of each run's greedy eval at `step`, items in step 0's order."""
    order = [r["uid"] for r in _records(runs[0] / "eval_items" / "step_0.jsonl")]
    rows = []
    for run in runs:
        by_uid = {r["uid"]: r for r in _records(run / "eval_items" / f"step_{step}.jsonl")}
        rows.append([float(by_uid[uid]["correct"]) for uid in order])
    return np.array(rows)


def sampled_tables(runs: list[Path], step: int) -> tuple[dict[str, np.ndarray], int]:
    """score -> (seeds, items) of each run's sampled eval at `step` (item_scores), items in step 0's order; K."""
    order, tables, samples = None, {name: [] for name in (*SCORES, ANSWER)}, None
    for run in runs:
        records = _records(run / "eval_items" / f"sampled_{step}.jsonl")
        samples = samples_per_item(records)
        scores = item_scores(records, samples)
        order = order or list(scores)
        for name in tables:
            tables[name].append([scores[key][name] for key in order])
    return {name: np.array(rows) for name, rows in tables.items()}, samples


def start_line(runs: dict[str, dict[int, Path]]) -> str:
    """The start's accuracies: greedy (one model, the same at every seed) and sampled, its mean over every run's
    step-0 draws."""
    folders = [run for seeds in runs.values() for run in seeds.values()]
    greedy = greedy_table(folders[:1], 0)
    sampled, samples = sampled_tables(folders, 0)
    shown = ", ".join(f"{score_label(name, samples)} {sampled[name].mean():.3f}" for name in SCORES)
    return (f"start: greedy {greedy.mean():.3f} on {greedy.shape[1]} items; sampled {shown} (mean over the "
            f"{len(folders)} runs' step-0 draws, {samples} an item)")


def changes(runs: list[Path], step: int) -> dict:
    """The seeds' change from their starts at `step`, each a PairedDifference: 'greedy' (strict accuracy) and the
    sampled SCORES; 'samples': K."""
    start_sampled, samples = sampled_tables(runs, 0)
    later, _ = sampled_tables(runs, step)
    found = {"greedy": bootstrap_difference(greedy_table(runs, 0), greedy_table(runs, step), seeds_paired=True),
             "samples": samples}
    found.update({name: bootstrap_difference(start_sampled[name], later[name], seeds_paired=True)
                  for name in (*SCORES, ANSWER)})
    return found


def change_rows(runs: dict[str, dict[int, Path]], steps: list[int]) -> list[str]:
    """The first table: per recipe and horizon, each accuracy's change from the start over the seeds."""
    lines, samples = [], None
    for recipe, seeds in runs.items():
        for step in steps:
            found = changes([seeds[seed] for seed in sorted(seeds)], step)
            samples = found["samples"]
            lines.append(f"| {recipe} | {step} | {len(seeds)} | {found['greedy'].accuracy:.3f} | "
                         f"{cell(found['greedy'])} | {found['pass_at_1'].accuracy:.3f} | "
                         + " | ".join(cell(found[name]) for name in (*SCORES, ANSWER)) + " |")
    header = ["recipe", "steps", "seeds", "greedy", "Δ greedy [95%]", "sampled pass@1",
              *(f"Δ {score_label(name, samples)} [95%]" for name in SCORES), "Δ answer pass@1 [95%]"]
    return [f"| {' | '.join(header)} |", "|" + " --- |" * len(header), *lines]


def against_rows(runs: dict[str, dict[int, Path]], step: int, baseline: str) -> list[str]:
    """The third table: at `step`, each other recipe minus `baseline`, on the seeds both ran, each seed paired
    with the same seed (the same data order and eval draws), by the same bootstrap."""
    lines, samples = [], None
    for recipe, seeds in runs.items():
        shared = sorted(set(seeds) & set(runs[baseline]))
        if recipe == baseline or not shared:
            continue
        ours, theirs = [runs[baseline][seed] for seed in shared], [seeds[seed] for seed in shared]
        greedy = greedy_table(ours + theirs, step)  # one item order for both sides
        sampled, samples = sampled_tables(ours + theirs, step)
        half = len(shared)
        found = [bootstrap_difference(greedy[:half], greedy[half:], seeds_paired=True)]
        found += [bootstrap_difference(sampled[name][:half], sampled[name][half:], seeds_paired=True)
                  for name in (*SCORES, ANSWER)]
        lines.append(f"| {recipe} - {baseline} | {step} | {half} | " + " | ".join(cell(d) for d in found) + " |")
    header = ["recipes", "steps", "seeds", "Δ greedy [95%]",
              *(f"Δ {score_label(name, samples or 0)} [95%]" for name in SCORES), "Δ answer pass@1 [95%]"]
    return [f"| {' | '.join(header)} |", "|" + " --- |" * len(header), *lines]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _group_size(run: Path) -> int:
    return yaml.safe_load((run / "config.yaml").read_text())["rollout"]["group_size"]


def _group_shares(rows: list[dict], group_size: int) -> tuple[float, float, float]:
    """Over `rows`: the shares of generated groups that could train, were all right, were all wrong."""
    generated = sum(row["completions"] for row in rows) / group_size
    right = sum(row["groups_dropped_all_correct"] for row in rows)
    wrong = sum(row["groups_dropped_all_wrong"] for row in rows)
    dropped = right + wrong + sum(row["groups_dropped_no_variance"] for row in rows)
    return 1 - dropped / generated, right / generated, wrong / generated


def training_rows(study: Path, runs: dict[str, dict[int, Path]], steps: list[int]) -> list[str]:
    """The second table: per recipe and span of steps, means over the steps of all seeds."""
    lines = []
    for recipe, seeds in runs.items():
        metrics = {seed: _metrics(run) for seed, run in seeds.items()}
        group_size = _group_size(next(iter(seeds.values())))
        seconds = np.mean([sum(float(leg.read_text().splitlines()[-1].split()[0])
                               for leg in study.glob(f"{run.name}.to*.time")) for run in seeds.values()])
        for low, high in zip([0, *steps], steps):
            span = [row for rows in metrics.values() for row in rows if low < row["step"] <= high]
            trainable, right, wrong = _group_shares(span, group_size)
            lines.append(f"| {recipe} | {low + 1}-{high} | {np.mean([r['reward_mean'] for r in span]):.3f} | "
                         f"{np.mean([r['train_accuracy'] for r in span]):.3f} | {trainable:.3f} | {right:.3f} | "
                         f"{wrong:.3f} | {seconds:.0f} |")
    header = ["recipe", "steps", "reward", "train acc", "groups that train", "all right", "all wrong", "user s / run"]
    return [f"| {' | '.join(header)} |", "|" + " --- |" * len(header), *lines]


def trailing_mean(values: list[float], window: int) -> np.ndarray:
    """Each value's mean with the window - 1 before it (fewer at the start)."""
    sums = np.cumsum([0.0, *values])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def make_figure(runs: dict[str, dict[int, Path]], window: int = 1):
    """Per step, each recipe's reward and share of generated groups that could train, the mean over its seeds,
    each point the trailing mean over `window` steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    reward, trainable = fig.subplots(1, 2)
    for recipe, seeds in runs.items():
        rows = [[row for row in _metrics(run) if row["step"] > 0] for run in seeds.values()]
        size = _group_size(next(iter(seeds.values())))
        steps = [row["step"] for row in rows[0]]
        rewards = np.mean([[row["reward_mean"] for row in run] for run in rows], axis=0)
        shares = np.mean([[_group_shares([row], size)[0] for row in run] for run in rows], axis=0)
        reward.plot(steps, trailing_mean(rewards, window), label=recipe)
        trainable.plot(steps, trailing_mean(shares, window))
    reward.set_title("training reward")
    trainable.set_title("share of generated groups that could train (not all right or all wrong)")
    fig.suptitle("mean over seeds" + (f", {window}-step trailing mean" if window > 1 else ""))
    for ax in (reward, trainable):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncol=len(runs))
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path)
    parser.add_argument("--figure", type=Path, help="also draw the reward and the groups that could train per step")
    parser.add_argument("--against", default="lr0.1", help="the recipe the others are compared with at the last "
                        "horizon (default lr0.1; none: no such table)")
    parser.add_argument("--window", type=int, default=25, help="the figure's trailing mean, in steps (default 25)")
    args = parser.parse_args()
    runs = load(args.study)
    if not runs:
        raise SystemExit(f"{args.study}: no finished run")
    steps = horizons(args.study, runs)
    print(start_line(runs) + "\n")
    print("\n".join(change_rows(runs, steps)))
    print()
    print("\n".join(training_rows(args.study, runs, steps)))
    if args.against in runs and len(runs) > 1:
        print()
        print("\n".join(against_rows(runs, steps[-1], args.against)))
    if args.figure:
        make_figure(runs, args.window).savefig(args.figure, dpi=110)


if __name__ == "__main__":
    main()
