"""`dapo-train compare`: points side by side, and with `--baseline POINT` every other point against one,
item by item.

The table aggregates each point's seeds (mean and sample std) over the columns of COLUMNS. With a
baseline, each point is compared on the per-item records both kept (run/eval_items.py): the final
eval on the whole split when every run of both has one, else the latest periodic eval step they all
have. The accuracy difference gets a 95% interval from a paired bootstrap over items and seeds, and
two single runs McNemar's test (evaluation/stats.py); the per-run outcomes (the last step's entropy,
generated tokens per trained token, wall time) are paired seed by seed where both points have the same
seeds. Records of different items (another
split, subset or task) cannot be paired: that is refused in one line, as is a point whose runs kept
no records.

The baseline is named by a run folder (the point it belongs to) or by its settings: KEY=VALUE for
the settings that differ between the points, with the short key of the plot legend or the dotted
key of the table (`eps_high=0.28` or `dapo.eps_high=0.28`; several separated by spaces).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np

from dapo_train.errors import UserError
from dapo_train.evaluation.stats import bootstrap_difference, mcnemar, t_interval
from dapo_train.evaluation.table import aligned_table
from dapo_train.run.eval_items import FINAL, PERIODIC, read_items, saved_evals
from dapo_train.study.runs import (
    MISSING,
    Point,
    RunRecord,
    _show,
    baseline_settings,
    expand,
    find_point,
    group_points,
    key_labels,
    load_runs,
    start_change,
    summarize_metrics,
)

# Summary key -> (column header, number format).
COLUMNS = {
    "final_accuracy": ("final acc", ".3f"),
    "final_answer_accuracy": ("final answer", ".3f"),
    "last_accuracy": ("last acc", ".3f"),
    "last_answer_accuracy": ("last answer", ".3f"),
    "best_accuracy": ("best acc", ".3f"),
    "sampled_pass_at_1": ("sampled pass@1", ".3f"),
    "sampled_pass_at_1_change": ("Δ pass@1", ".3f"),
    "sampled_maj_at_k": ("maj@K", ".3f"),
    "sampled_maj_at_k_change": ("Δ maj@K", ".3f"),
    "sampled_pass_at_k": ("pass@K", ".3f"),
    "sampled_pass_at_k_change": ("Δ pass@K", ".3f"),
    "clip_frac_high": ("clip high", ".4f"),
    "clip_frac_low": ("clip low", ".4f"),
    "entropy_first": ("entropy first", ".3f"),
    "entropy_last": ("entropy last", ".3f"),
    "completion_length": ("length", ".1f"),
    "generated_per_trained_token": ("gen tok/trained", ".2f"),
    "seconds_generate_per_group": ("gen s/group", ".2f"),
    "tool_calls_per_completion": ("calls/completion", ".2f"),
    "tool_error_rate": ("call errors", ".3f"),
    "tool_use_first": ("tool use first", ".3f"),
    "tool_use_last": ("tool use last", ".3f"),
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
        row = {"point": point.values, "seeds": [r.seed for r in runs], "runs": [str(r.path) for r in runs],
               "status": [r.status for r in runs], "change_from_start": [start_change(r.rows) for r in runs]}
        row.update({key: aggregate([s[key] for s in summaries]) for key in COLUMNS})
        rows.append(row)
    return rows


def _cell(stat: dict | None, fmt: str) -> str:
    if stat is None:
        return MISSING
    if stat["std"] is None or stat["std"] == 0 or math.isnan(stat["std"]):
        return format(stat["mean"], fmt)
    return f"{stat['mean']:{fmt}} ± {stat['std']:{fmt}}"


# Columns left out of the text table where no point made a tool call (runs without rollout.tools log zeros).
TOOL_COLUMNS = ("tool_calls_per_completion", "tool_error_rate", "tool_use_first", "tool_use_last")


# Columns left out of the text table where no run logged an answer accuracy (runs from before it), or no run
# logged a sampled eval (eval.samples).
ANSWER_COLUMNS = ("final_answer_accuracy", "last_answer_accuracy")
SAMPLED_COLUMNS = tuple(key for key in COLUMNS if key.startswith("sampled_"))


def shown_columns(rows: list[dict]) -> dict[str, tuple[str, str]]:
    """COLUMNS less the tool columns, unless some point's runs called a tool, and less the answer accuracy's and
    the sampled eval's, unless some run logged them."""
    tools = any((row["tool_calls_per_completion"] or {}).get("mean") for row in rows)
    shown = {group: any(row[key] for row in rows for key in group) for group in (ANSWER_COLUMNS, SAMPLED_COLUMNS)}
    return {key: column for key, column in COLUMNS.items()
            if (tools or key not in TOOL_COLUMNS) and all(shown[group] or key not in group for group in shown)}


def _status_cell(statuses: list[str | None]) -> str:
    """'finished', or for several runs their counts: '2 finished, 1 regressed'; '-' for a run without a record."""
    counts = {status or MISSING: statuses.count(status) for status in statuses}
    if len(statuses) == 1:
        return next(iter(counts))
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def _change_cell(changes: list[dict | None]) -> str:
    """One run's change with its interval, '+0.050 [-0.010, +0.110]'; several runs' mean ± sample std."""
    if len(changes) == 1 and changes[0] is not None:
        one = changes[0]
        return f"{one['change']:+.3f} [{one['low']:+.3f}, {one['high']:+.3f}]"
    stat = aggregate([change["change"] if change else None for change in changes])
    if stat is None:
        return MISSING
    return f"{stat['mean']:+.3f}" + (f" ± {stat['std']:.3f}" if stat["std"] else "")


def format_compare(varied: list[str], rows: list[dict]) -> str:
    """The rows as an aligned text table; the point's own settings on the left, then its seeds, their status
    and change from start where some run has them, then COLUMNS."""
    left = varied or ["run"]
    columns = shown_columns(rows)
    status = any(any(row["status"]) for row in rows)
    change = any(any(row["change_from_start"]) for row in rows)
    headers = [*left, "seeds", *(["status"] if status else []), *(["Δ from start"] if change else []),
               *(header for header, _ in columns.values())]
    body = [
        [*(_show(row["point"][k]) if varied else Path(row["runs"][0]).name for k in left), str(len(row["seeds"])),
         *([_status_cell(row["status"])] if status else []),
         *([_change_cell(row["change_from_start"])] if change else []),
         *(_cell(row[key], fmt) for key, (_, fmt) in columns.items())]
        for row in rows
    ]
    table = aligned_table(headers, body, left=len(left))
    if change or status:
        table.append("Δ from start: each run's last eval (its final one where it made one) against its own step 0 on "
                     "the same items, with the 95% paired interval; status: how its last session ended "
                     "(run_status.json; running: not ended, or killed)")
    table.append("final acc: the whole eval split at the end (eval.final_full); last / best acc: the periodic evals "
                 "of eval.num_items items, best leaving out step 0 (before training)")
    if "last_answer_accuracy" in columns:
        table.append("acc is strict (the answer block, as the reward grades); answer: the gold number wherever the "
                     "final answer is read (the answer block, else the last \\boxed{}, else the last number); their "
                     "gap is format")
    if "sampled_pass_at_1" in columns:
        table.append("sampled pass@1, maj@K, pass@K: the last periodic eval's K samples an item (eval.samples); Δ: "
                     "its change from step 0 on the same items")
    if any(len(row["seeds"]) > 1 for row in rows):
        table.append("mean ± sample std over a point's seeds")
    if "tool_use_last" in columns:
        table.append("calls/completion, call errors: over all steps' completions and calls; tool use first / last: "
                     "the share of completions that called a tool at the first and the last step")
    return "\n".join(table)


def compare(paths: list[str], as_json: bool = False) -> str:
    varied, rows = compare_rows(load_runs(paths))
    return json.dumps(rows, ensure_ascii=False, indent=2) if as_json else format_compare(varied, rows)

# Per-run outcomes (summarize_metrics keys) paired seed by seed -> their column header: what a setting
# does to entropy, to tool use (rollout.tools), and what it costs (generation per trained token, wall time).
RUN_OUTCOMES = {"entropy_last": "entropy last", "tool_calls_per_completion": "calls/completion",
                "tool_error_rate": "call errors", "generated_per_trained_token": "gen tok/trained",
                "wall_seconds": "wall s"}


# --------------------------------------------------------------------------------------------
# Which eval, which items.


def run_evals(run: RunRecord) -> dict[str, Path]:
    """'final' (its end-of-run eval, at the run's last step) and 'step N' -> per-item file."""
    last = max((row["step"] for row in run.rows), default=0)
    found = {}
    for (kind, step), path in saved_evals(run.path).items():
        if kind == PERIODIC.name:
            found[f"step {step}"] = path
        elif kind == FINAL.name and step == last:
            found["final"] = path
    return found


def common_eval(runs: list[RunRecord]) -> str | None:
    """The final eval if every run has one, else the latest step every run has records of."""
    shared = set.intersection(*(set(run_evals(run)) for run in runs))
    if "final" in shared:
        return "final"
    steps = [int(name.split()[1]) for name in shared]
    return f"step {max(steps)}" if steps else None


def item_table(point: Point, eval_name: str, key: str = "correct") -> tuple[list, list[str], dict[str, str],
                                                                         np.ndarray | None]:
    """-> (seeds, uids in file order, uid -> gold, (seeds, items) of the records' `key`: correct, or
    answer_correct; None when a run's records predate it), runs sorted by seed."""
    runs = sorted(point.runs, key=lambda run: str(run.seed))
    seeds, uids, golds, rows = [], None, None, []
    for run in runs:
        records = read_items(run_evals(run)[eval_name])
        these = {r["uid"]: r["gold"] for r in records}
        if golds is not None and these != golds:
            raise UserError(f"{run.path}: its {eval_name} eval covers other items than {runs[0].path}'s")
        uids, golds = uids or [r["uid"] for r in records], these
        correct = {r["uid"]: float(r[key]) for r in records if key in r}
        seeds.append(run.seed)
        rows.append([correct.get(uid) for uid in uids])
    missing = any(value is None for row in rows for value in row)
    return seeds, uids, golds, None if missing else np.array(rows)


# --------------------------------------------------------------------------------------------
# One point against the baseline.


def paired_comparison(baseline: Point, other: Point, labels: dict[str, str]) -> dict:
    """other - baseline, item by item (and seed by seed): the JSON `compare --baseline` prints."""
    name, base_name = other.label(labels), baseline.label(labels)
    eval_name = common_eval(baseline.runs + other.runs)
    if eval_name is None:
        raise UserError(
            f"compare --baseline: {name} and the baseline {base_name} share no eval with per-item records "
            "(eval_items/; runs made before dapo-train kept them have none): compare them without --baseline"
        )
    base_seeds, uids, base_golds, base_table = item_table(baseline, eval_name)
    seeds, other_uids, golds, table = item_table(other, eval_name)
    if golds != base_golds:
        raise UserError(
            f"compare --baseline: {name} and the baseline {base_name} were evaluated on different items "
            f"({eval_name}: {len(other_uids)} vs {len(uids)} items, other uids or gold answers); paired "
            "differences need the same items (the same data, split and eval.num_items)"
        )
    column = {uid: index for index, uid in enumerate(other_uids)}
    order = [column[uid] for uid in uids]  # the baseline's item order
    seeds_paired = sorted(map(str, seeds)) == sorted(map(str, base_seeds)) and len(set(map(str, seeds))) == len(seeds)
    result = bootstrap_difference(base_table, table[:, order], seeds_paired=seeds_paired)
    row = {"eval": eval_name, **dataclasses.asdict(result), "seeds": seeds, "baseline_seeds": base_seeds}
    base_answers, answers = (item_table(point, eval_name, "answer_correct")[3] for point in (baseline, other))
    row["answer"] = None if base_answers is None or answers is None else dataclasses.asdict(
        bootstrap_difference(base_answers, answers[:, order], seeds_paired=seeds_paired))
    row["mcnemar"] = None
    if len(seeds) == 1 and len(base_seeds) == 1:
        b = int(((base_table[0] == 1) & (table[0] == 0)).sum())
        c = int(((base_table[0] == 0) & (table[0] == 1)).sum())
        row["mcnemar"] = dataclasses.asdict(mcnemar(b, c))
    row["run_outcomes"] = _run_outcomes(baseline, other) if seeds_paired else {}
    return row


def _run_outcomes(baseline: Point, other: Point) -> dict:
    """RUN_OUTCOMES paired by seed: mean difference and Student t interval over the seed pairs."""
    base = {str(run.seed): summarize_metrics(run.rows) for run in baseline.runs}
    mine = {str(run.seed): summarize_metrics(run.rows) for run in other.runs}
    outcomes = {}
    for key in RUN_OUTCOMES:
        pairs = [(mine[s][key], base[s][key]) for s in sorted(mine) if s in base and mine[s][key] is not None
                 and base[s][key] is not None]
        if key in TOOL_COLUMNS and not any(a or b for a, b in pairs):
            pairs = []  # neither point called a tool
        outcomes[key] = dataclasses.asdict(t_interval([a - b for a, b in pairs])) if pairs else None
    return outcomes


def paired_rows(varied: list[str], points: list[Point], baseline: Point) -> list[dict]:
    labels = key_labels(varied)
    return [{"is_baseline": True} if point is baseline else paired_comparison(baseline, point, labels)
            for point in points]


# --------------------------------------------------------------------------------------------
# The text.


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def _interval(low: float | None, high: float | None) -> str:
    return MISSING if low is None else f"[{low:+.3f}, {high:+.3f}]"


def format_delta(paired: dict | None) -> str:
    """A paired difference as one table cell, `+0.020 [-0.016, +0.055]` (a study script's tables); `-`
    without an interval. paired: a paired_comparison result, or an outcome of its run_outcomes."""
    if paired is None or paired["low"] is None:
        return MISSING
    return f"{_signed(paired['difference'] if 'difference' in paired else paired['mean'])} " \
           f"{_interval(paired['low'], paired['high'])}"


def format_paired(varied: list[str], points: list[Point], rows: list[dict], baseline: Point) -> str:
    """The paired table under the compare table: one line per point, the baseline marked."""
    left = varied or ["run"]
    tests = any(row.get("mcnemar") for row in rows)
    outcomes = [key for key in RUN_OUTCOMES if any((row.get("run_outcomes") or {}).get(key) for row in rows)]
    answers = any(row.get("answer") for row in rows)
    headers = [*left, "eval", "items", "seeds", "accuracy", "Δ accuracy", "95% CI"]
    headers += ["answer", "Δ answer", "95% CI"] if answers else []
    headers += ["b/c", "McNemar p"] if tests else []
    headers += [cell for key in outcomes for cell in (f"Δ {RUN_OUTCOMES[key]}", "95% CI")]
    pairs = [row for row in rows if not row.get("is_baseline")]
    body = []
    for point, row in zip(points, rows):
        names = [point.settings.get(k) or point.runs[0].path.name for k in left]
        if row.get("is_baseline"):
            one_eval = len({pair["eval"] for pair in pairs}) == 1  # then the baseline's accuracy is one number
            shown = [pairs[0]["eval"], str(pairs[0]["items"]), str(len(point.runs)),
                     f"{pairs[0]['baseline_accuracy']:.3f}"] if one_eval else ["", "", str(len(point.runs)), ""]
            body.append([*names, *shown, "baseline", *[""] * (len(headers) - len(left) - 5)])
            continue
        count = len(row["seeds"])
        seeds = f"{count} paired" if row["seeds_paired"] else f"{count} vs {len(row['baseline_seeds'])}"
        cells = [*names, row["eval"], str(row["items"]), seeds, f"{row['accuracy']:.3f}", _signed(row["difference"]),
                 _interval(row["low"], row["high"])]
        answer = row.get("answer")
        cells += ([f"{answer['accuracy']:.3f}", _signed(answer["difference"]), _interval(answer["low"], answer["high"])]
                  if answer else [MISSING] * 3) if answers else []
        test = row["mcnemar"]
        cells += ([f"{test['baseline_only']}/{test['other_only']}", f"{test['p']:.3g} {test['method']}"] if test
                  else [MISSING, MISSING]) if tests else []
        for key in outcomes:
            stat = row["run_outcomes"].get(key)
            cells += [_signed(stat["mean"]), _interval(stat["low"], stat["high"])] if stat else [MISSING, MISSING]
        body.append(cells)
    notes = [
        f"Δ = point - baseline ({baseline.label(key_labels(varied))}), on the same items; accuracy interval: "
        "paired bootstrap, 10,000 draws of the items and, independently, the seeds (one draw for both where "
        "the seeds are the same)",
    ]
    if answers:
        notes.append("answer: the answer accuracy (the gold number wherever the final answer is read), paired the "
                     "same way; accuracy is strict (the answer block, as the reward grades)")
    if tests:
        notes.append("b/c: items only the baseline / only the point got right; McNemar's test on them "
                     "(exact binomial below 25 discordant items)")
    if outcomes:
        notes.append("per-run outcomes paired seed by seed: mean difference, Student t interval")
    return "\n".join([*aligned_table(headers, body, left=len(left)), *notes])


def compare_with_baseline(paths: list[str], baseline: str, as_json: bool = False) -> str:
    """`dapo-train compare PATHS --baseline POINT`: the compare table, then every point against it."""
    given = Path(baseline).is_dir()
    named = {run.resolve() for run in expand(Path(baseline))} if given else None
    if not given:
        baseline_settings(baseline)  # a baseline that names nothing, before the runs are read
    runs = load_runs(paths + ([baseline] if given else []))  # a baseline outside PATHS joins them
    varied, points = group_points(runs)
    if len(points) < 2:
        raise UserError("compare --baseline needs at least two points (settings that differ) to compare")
    base = find_point(points, varied, baseline, named)
    rows = paired_rows(varied, points, base)
    table = point_rows(points)
    if as_json:
        return json.dumps([{**row, "paired": paired} for row, paired in zip(table, rows)], ensure_ascii=False, indent=2)
    return f"{format_compare(varied, table)}\n\n{format_paired(varied, points, rows, base)}"
