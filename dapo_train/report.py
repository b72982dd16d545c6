"""`dapo-train compare` and `dapo-train plot`: read finished (or running) runs back from their
config.yaml and metrics.jsonl, group them into points, and show the points side by side.

A point is a set of settings: runs whose configs agree on everything but seed, output_dir and
run_name are seeds of one point and are aggregated (mean and sample std in the table, a mean line
and a min-max band in the plot). The columns and legends name only the varied keys, the dotted
keys whose values differ between points, so a sweep of eps_high shows eps_high and nothing else.
No model or tokenizer is loaded: this only reads files, and works while a sweep is still running.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from dapo_train.checkpoint import CONFIG_FILE
from dapo_train.config import config_to_dict, flatten_config
from dapo_train.errors import UserError
from dapo_train.eval_items import FINAL, PERIODIC
from dapo_train.metrics import read_metrics
from dapo_train.rundir import saved_run_config, unwritable
from dapo_train.sweep import SWEEP_FILE, key_labels
from dapo_train.table import aligned_table

# What makes seeds of one point: everything in the config but these.
PER_RUN_KEYS = ("seed", "output_dir", "run_name")
MISSING = "-"


@dataclass(frozen=True)
class RunRecord:
    """One run folder read back. config: flattened dotted config; rows: metrics.jsonl by step."""

    path: Path
    config: dict
    rows: list[dict]

    @property
    def seed(self) -> object:
        return self.config.get("seed")


@dataclass(frozen=True)
class Point:
    """Runs of one setting. settings: varied key -> value as text; values: the same as the config
    holds them (numbers, lists; `-` where a run's config lacks the key)."""

    settings: dict[str, str]
    runs: list[RunRecord]
    values: dict[str, object]

    @classmethod
    def row(cls, name: str, runs: list[RunRecord]) -> Point:
        """A study script's row of runs (scripts/ablation.py, scripts/policy_losses.py): `row=<name>`."""
        return cls({"row": name}, runs, {"row": name})

    def label(self, labels: dict[str, str]) -> str:
        named = " ".join(f"{labels[k]}={v}" for k, v in self.settings.items()) or self.runs[0].path.name
        return named if len(self.runs) == 1 else f"{named} ({len(self.runs)} seeds)"


# --------------------------------------------------------------------------------------------
# Finding and reading runs.


def is_run(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / "metrics.jsonl").is_file()


def _sweep_runs(sweep_dir: Path) -> list[Path]:
    """The sweep's run folders in grid order; run_dir is re-rooted at sweep_dir so a moved sweep
    folder still reads. Points not started yet have no run to show."""
    try:
        points = json.loads((sweep_dir / SWEEP_FILE).read_text(encoding="utf-8"))["points"]
        found = [sweep_dir / Path(p["run_dir"]).name for p in points]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{sweep_dir / SWEEP_FILE} is damaged ({exc}); compare its run folders one by one") from None
    return [path for path in found if is_run(path)]


def expand(path: Path) -> list[Path]:
    """A run folder -> itself; a sweep folder -> its runs; a folder of runs or sweeps -> theirs."""
    if path.is_file():
        raise UserError(f"{path} is a file; give a run folder (config.yaml and metrics.jsonl) or a sweep folder")
    if not path.is_dir():
        raise UserError(f"{path}: no such folder")
    if (path / SWEEP_FILE).is_file():
        return _sweep_runs(path)
    if is_run(path):
        return [path]
    children = [c for c in sorted(path.iterdir()) if c.is_dir() and (is_run(c) or (c / SWEEP_FILE).is_file())]
    if not children:
        raise UserError(
            f"{path} is neither a run (config.yaml and metrics.jsonl), a sweep (sweep.json) nor a folder of them"
        )
    return [run for child in children for run in expand(child)]


def load_run(path: Path) -> RunRecord:
    try:
        rows = sorted(read_metrics(path), key=lambda row: row["step"])
    except (ValueError, KeyError) as exc:
        raise UserError(f"{path / 'metrics.jsonl'}: a line is not a metrics row ({exc})") from None
    return RunRecord(path, flatten_config(config_to_dict(saved_run_config(path))), rows)


def load_runs(paths: list[str]) -> list[RunRecord]:
    seen: dict[Path, RunRecord] = {}
    for given in paths:
        for run_dir in expand(Path(given)):
            if run_dir.resolve() not in seen:
                seen[run_dir.resolve()] = load_run(run_dir)
    if not seen:
        raise UserError(f"no run with metrics yet in {', '.join(paths)}")
    return list(seen.values())


def _show(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def group_points(runs: list[RunRecord]) -> tuple[list[str], list[Point]]:
    """-> (varied keys, points in order of first appearance); see the module docstring."""
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        setting = tuple(sorted((k, _show(v)) for k, v in run.config.items() if k not in PER_RUN_KEYS))
        groups.setdefault(setting, []).append(run)
    keys = list(dict.fromkeys(k for run in runs for k in run.config if k not in PER_RUN_KEYS))
    members = list(groups.values())
    varied = [k for k in keys if len({_show(group[0].config.get(k, MISSING)) for group in members}) > 1]
    values = [{k: group[0].config.get(k, MISSING) for k in varied} for group in members]
    points = [Point({k: _show(v) for k, v in value.items()}, group, value) for group, value in zip(members, values)]
    return varied, points


# --------------------------------------------------------------------------------------------
# The comparison table.


def _number(value: object) -> float | None:
    """A metric value as a float; NaN/inf were stored as strings (metrics.json_safe)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _values(rows: list[dict], key: str) -> list[float]:
    return [v for row in rows if (v := _number(row.get(key))) is not None]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_metrics(rows: list[dict]) -> dict[str, float | None]:
    """One run's metrics rows -> its numbers in the compare table (COLUMNS). The final accuracy is
    the end-of-run eval on the whole split (`final_accuracy`, eval.final_full); periodic eval rows
    carry `accuracy` on the fixed subset (step 0 = before training; best counts only steps after
    it); training rows are steps >= 1; wall time is training plus every eval's seconds."""
    evals = [(row["step"], _number(row["accuracy"])) for row in rows if _number(row.get("accuracy")) is not None]
    finals = _values(rows, FINAL.accuracy)
    train = [row for row in rows if row["step"] > 0]
    entropy = _values(train, "entropy")
    return {
        "final_accuracy": finals[-1] if finals else None,
        "last_accuracy": evals[-1][1] if evals else None,
        "best_accuracy": max((acc for step, acc in evals if step > 0), default=None),
        "clip_frac_high": _mean(_values(train, "clip_frac_high")),
        "clip_frac_low": _mean(_values(train, "clip_frac_low")),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_last": entropy[-1] if entropy else None,
        "completion_length": _mean(_values(train, "completion_length_mean")),
        "steps": float(max((row["step"] for row in rows), default=0)),
        "wall_seconds": sum(_values(train, "seconds_step")) + sum(_values(rows, PERIODIC.seconds))
        + sum(_values(rows, FINAL.seconds)),
    }


# Summary key -> (column header, number format).
COLUMNS = {
    "final_accuracy": ("final acc", ".3f"),
    "last_accuracy": ("last acc", ".3f"),
    "best_accuracy": ("best acc", ".3f"),
    "clip_frac_high": ("clip high", ".4f"),
    "clip_frac_low": ("clip low", ".4f"),
    "entropy_first": ("entropy first", ".3f"),
    "entropy_last": ("entropy last", ".3f"),
    "completion_length": ("length", ".1f"),
    "steps": ("steps", ".0f"),
    "wall_seconds": ("wall s", ".0f"),
}


def aggregate(values: list[float | None]) -> dict | None:
    """Across a point's seeds: mean, sample std (n - 1; None for one seed) and n; None if no run has it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    std = statistics.stdev(present) if len(present) > 1 else None
    return {"mean": statistics.fmean(present), "std": std, "n": len(present)}


def compare_rows(runs: list[RunRecord]) -> tuple[list[str], list[dict]]:
    """-> (varied keys, one row per point): what `compare --json` prints."""
    varied, points = group_points(runs)
    return varied, point_rows(points)


def point_rows(points: list[Point]) -> list[dict]:
    """One compare row per point: its settings, seeds, runs and each COLUMNS number over its seeds."""
    rows = []
    for point in points:
        summaries = [summarize_metrics(run.rows) for run in point.runs]
        runs = point.runs
        row = {"point": point.values, "seeds": [r.seed for r in runs], "runs": [str(r.path) for r in runs]}
        row.update({key: aggregate([s[key] for s in summaries]) for key in COLUMNS})
        rows.append(row)
    return rows


def _cell(stat: dict | None, fmt: str) -> str:
    if stat is None:
        return MISSING
    if stat["std"] is None or stat["std"] == 0 or math.isnan(stat["std"]):
        return format(stat["mean"], fmt)
    return f"{stat['mean']:{fmt}} ± {stat['std']:{fmt}}"


def format_compare(varied: list[str], rows: list[dict]) -> str:
    """The rows as an aligned text table; the point's own settings on the left."""
    left = varied or ["run"]
    headers = [*left, "seeds", *(header for header, _ in COLUMNS.values())]
    body = [
        [*(_show(row["point"][k]) if varied else Path(row["runs"][0]).name for k in left), str(len(row["seeds"])),
         *(_cell(row[key], fmt) for key, (_, fmt) in COLUMNS.items())]
        for row in rows
    ]
    table = aligned_table(headers, body, left=len(left))
    table.append("final acc: the whole eval split at the end (eval.final_full); last / best acc: the periodic evals "
                 "of eval.num_items items, best leaving out step 0 (before training)")
    if any(len(row["seeds"]) > 1 for row in rows):
        table.append("mean ± sample std over a point's seeds")
    return "\n".join(table)


def compare(paths: list[str], as_json: bool = False) -> str:
    varied, rows = compare_rows(load_runs(paths))
    return json.dumps(rows, ensure_ascii=False, indent=2) if as_json else format_compare(varied, rows)


# --------------------------------------------------------------------------------------------
# The plot.

# Panel title -> (metric key, line style) drawn in it.
PANELS = {
    "eval accuracy": (("accuracy", "-"),),
    "reward (reward_mean)": (("reward_mean", "-"),),
    "entropy": (("entropy", "-"),),
    "clip fraction (solid high, dashed low)": (("clip_frac_high", "-"), ("clip_frac_low", "--")),
    "completion length (mean)": (("completion_length_mean", "-"),),
    "groups (solid kept, dashed carried)": (("groups_kept", "-"), ("groups_carried", "--")),
    "rollout KL(behaviour || training), k3": (("rollout_kl", "-"),),
    "rollout |log-prob diff| (solid mean, dashed max)": (("rollout_logprob_diff_mean", "-"),
                                                         ("rollout_logprob_diff_max", "--")),
    "rollout IS weight (solid mean, dashed clipped frac)": (("rollout_is_weight_mean", "-"),
                                                            ("rollout_is_clipped_frac", "--")),
}


def seed_band(runs: list[RunRecord], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """-> (steps, mean, min, max) of `key` across runs, at every step some run logged it."""
    by_step: dict[int, list[float]] = {}
    for run in runs:
        for row in run.rows:
            if (value := _number(row.get(key))) is not None:
                by_step.setdefault(row["step"], []).append(value)
    steps = sorted(by_step)
    return (
        steps, [statistics.fmean(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
        [max(by_step[s]) for s in steps],
    )


def make_figure(varied: list[str], points: list[Point]):
    """A panel per PANELS entry over steps, three to a row; one colour per point, its seeds as a mean line
    and a min-max band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    rows = -(-len(PANELS) // 3)
    fig = Figure(figsize=(15, 4.25 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    colours = [f"C{i % 10}" for i in range(len(points))]
    for ax, (title, series) in zip(fig.subplots(rows, 3).flatten(), PANELS.items()):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        for point, colour in zip(points, colours):
            for key, style in series:
                steps, mean, low, high = seed_band(point.runs, key)
                if not steps:
                    continue
                ax.plot(steps, mean, style, color=colour, marker="o" if key == "accuracy" else None, markersize=3)
                if len(point.runs) > 1:
                    ax.fill_between(steps, low, high, color=colour, alpha=0.15, linewidth=0)
        if not ax.lines:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    labels = key_labels(varied)
    handles = [Line2D([], [], color=colour, label=p.label(labels)) for p, colour in zip(points, colours)]
    widest = max(len(handle.get_label()) for handle in handles)
    columns = max(1, min(len(handles), 200 // (widest + 6)))  # about 200 characters fit across at this size
    fig.legend(handles=handles, loc="outside lower center", ncol=columns, fontsize=9)
    seeds = "; line = mean over a point's seeds, shaded band = min-max" if any(len(p.runs) > 1 for p in points) else ""
    fig.suptitle(f"{', '.join(varied) or 'runs'}{seeds}", fontsize=11)
    return fig


def plot(paths: list[str], out: str) -> Path:
    """Write the figure of `paths` to `out`; where it cannot be written is found before anything is read."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("dapo-train plot needs matplotlib: pip install 'dapo-train[plot]'") from None
    target = Path(out)
    problem = f"{target} is a folder" if target.is_dir() else unwritable(target.parent)
    if problem is not None:
        raise UserError(f"-o {out}: {problem}; choose another file")
    fig = make_figure(*group_points(load_runs(paths)))
    supported = fig.canvas.get_supported_filetypes()
    if target.suffix.lstrip(".").lower() not in supported:
        raise UserError(f"-o {out}: unknown image type; end the name in one of .{', .'.join(sorted(supported))}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(target, dpi=110)
    except OSError as exc:
        raise UserError(f"-o {out}: could not write it ({exc.strerror or exc})") from None
    return target
