"""`dapo-train plot`: eval accuracy (greedy, and the sampled eval's pass@1, maj@K and pass@K with eval.samples),
reward, entropy, clip fractions, length, groups and what generation cost per trained token and group over steps,
one colour per point (a mean line over its seeds and a min-max band), and the rollout's gap to the training
forward. A point whose rollout IS the training forward (every row's rollout_exact is 1: the CPU float32 decode
loop) has no numeric gap to draw, only float rounding (~1e-13): those panels say "exact by construction" for it
instead of plotting the noise.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from dapo_train.errors import UserError
from dapo_train.run.eval_items import SAMPLED
from dapo_train.run.folder import unwritable
from dapo_train.study.runs import Point, RunRecord, _number, group_points, key_labels, load_runs

# --------------------------------------------------------------------------------------------
# The plot.

# Panel title -> (metric key, line style) drawn in it.
PANELS = {
    "eval accuracy (solid greedy, dashed sampled pass@1)": (("accuracy", "-"), (SAMPLED.accuracy, "--")),
    "reward (reward_mean)": (("reward_mean", "-"),),
    "entropy": (("entropy", "-"),),
    "clip fraction (solid high, dashed low)": (("clip_frac_high", "-"), ("clip_frac_low", "--")),
    "completion length (mean)": (("completion_length_mean", "-"),),
    "groups (solid kept, dashed carried)": (("groups_kept", "-"), ("groups_carried", "--")),
    "rollout KL, k3 (solid numeric gap, dashed truncation)": (("rollout_kl", "-"), ("rollout_kl_truncation", "--")),
    "rollout |log-prob diff| (solid mean, dashed max)": (("rollout_logprob_diff_mean", "-"),
                                                         ("rollout_logprob_diff_max", "--")),
    "rollout IS weight (solid mean, dashed clipped frac)": (("rollout_is_weight_mean", "-"),
                                                            ("rollout_is_clipped_frac", "--")),
    "generated tokens per trained token": (("generated_per_trained_token", "-"),),
    "generation seconds per trained group": (("seconds_generate_per_group", "-"),),
    "sampled eval (solid maj@K, dashed pass@K)": ((f"{SAMPLED.prefix}maj_at_k", "-"),
                                                  (f"{SAMPLED.prefix}pass_at_k", "--")),
}
EVAL_KEYS = ("accuracy", SAMPLED.accuracy, f"{SAMPLED.prefix}maj_at_k", f"{SAMPLED.prefix}pass_at_k")  # marked


# The series that measure the rollout's numeric gap to the training forward: rounding alone for an exact point.
NUMERIC_GAP = ("rollout_kl", "rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_is_weight_mean",
               "rollout_is_clipped_frac")
EXACT = "exact by construction: the rollout is the training forward"


def is_exact(point: Point) -> bool:
    """Every run of the point logged rollout_exact = 1 on every row that has it (and some row has it)."""
    flags = [row["rollout_exact"] for run in point.runs for row in run.rows if "rollout_exact" in row]
    return bool(flags) and all(flag == 1 for flag in flags)


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
    exact = [is_exact(point) for point in points]
    for ax, (title, series) in zip(fig.subplots(rows, 3).flatten(), PANELS.items()):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        skipped = False
        for point, colour, point_exact in zip(points, colours, exact):
            for key, style in series:
                if point_exact and key in NUMERIC_GAP:
                    skipped = True
                    continue
                _draw(ax, point, key, style, colour)
        if skipped:
            note = EXACT if all(exact) else f"{EXACT}\nfor {sum(exact)} of {len(points)} points (not drawn)"
            ax.text(0.5, 0.5 if not ax.lines else 0.9, note, ha="center", va="center", transform=ax.transAxes,
                    fontsize=8 if ax.lines else 9)
        elif not ax.lines:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    labels = key_labels(varied)
    handles = [Line2D([], [], color=colour, label=p.label(labels)) for p, colour in zip(points, colours)]
    widest = max(len(handle.get_label()) for handle in handles)
    columns = max(1, min(len(handles), 200 // (widest + 6)))  # about 200 characters fit across at this size
    fig.legend(handles=handles, loc="outside lower center", ncol=columns, fontsize=9)
    seeds = "; line = mean over a point's seeds, shaded band = min-max" if any(len(p.runs) > 1 for p in points) else ""
    fig.suptitle(f"{', '.join(varied) or 'runs'}{seeds}", fontsize=11)
    return fig


def _draw(ax, point: Point, key: str, style: str, colour: str) -> None:
    """One point's mean line of `key` over its seeds, and with several seeds their min-max band."""
    steps, mean, low, high = seed_band(point.runs, key)
    if not steps:
        return
    ax.plot(steps, mean, style, color=colour, marker="o" if key in EVAL_KEYS else None, markersize=3)
    if len(point.runs) > 1:
        ax.fill_between(steps, low, high, color=colour, alpha=0.15, linewidth=0)


def _unwritable_target(target: Path) -> str | None:
    """Why the figure cannot be written to `target`: a folder, a file already there (the user's: plot never
    replaces one), or a place that refuses a write; None: it can be."""
    if target.is_dir():
        return f"{target} is a folder"
    if target.exists() or target.is_symlink():
        return f"{target} exists, and plot never replaces a file"
    return unwritable(target.parent)


def plot(paths: list[str], out: str) -> Path:
    """Write the figure of `paths` to `out`, a new file (one already there is the user's, never replaced); where it
    cannot be written is found before anything is read."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("dapo-train plot needs matplotlib: pip install 'dapo-train[plot]'") from None
    target = Path(out)
    problem = _unwritable_target(target)
    if problem is not None:
        raise UserError(f"-o {out}: {problem}; choose another file")
    fig = make_figure(*group_points(load_runs(paths)))
    supported = fig.canvas.get_supported_filetypes()
    if target.suffix.lstrip(".").lower() not in supported:
        raise UserError(f"-o {out}: unknown image type; end the name in one of .{', .'.join(sorted(supported))}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(target, "xb") as image:  # created here: a file that appeared since the check is not replaced
            fig.savefig(image, format=target.suffix.lstrip(".").lower(), dpi=110)
    except FileExistsError:
        raise UserError(f"-o {out}: {target} exists, and plot never replaces a file; choose another file") from None
    except OSError as exc:
        raise UserError(f"-o {out}: could not write it ({exc.strerror or exc})") from None
    return target
