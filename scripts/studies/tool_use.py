"""Tool use over training, for runs with rollout.tools (the tools study: scripts/studies/tools_study.sh,
docs/studies.md): per window of steps, calls per completion, the share of calls answered with an error and
the share of completions that called a tool, as the mean over a point's seeds with a 95% Student t interval;
then the change from the first window to the last, paired within each run; and, from the rollout records
(logging.rollout_groups), what the calls were: the share whose expression is a bare number (a call that
computes nothing, the cheapest way to look like a tool user) and calls per completion that answered right
and wrong.

    python scripts/studies/tool_use.py outputs/tools_study            # windows of 10 steps
    python scripts/studies/tool_use.py outputs/tools_study --window 5

Reads metrics.jsonl and rollouts/ only (no model): a second or two.
"""

from __future__ import annotations

import argparse
import json
import re

from dapo_train.evaluation.stats import t_interval
from dapo_train.run.rollouts import read_rollouts, saved_rollouts
from dapo_train.study.runs import RunRecord, group_points, load_runs

# A calculator expression that is one number, signed or not, with no operator: it computes nothing.
BARE_NUMBER = re.compile(r"\s*[-+]?\s*\d+(\.\d+)?\s*")


def window_rates(rows: list[dict], first: int, last: int) -> dict[str, float] | None:
    """Steps first..last of one run's metrics -> calls per completion, error share of calls, tool-use share
    (ratios of the window's sums; the use share weighted by completions); None if no step is there."""
    rows = [row for row in rows if first <= row["step"] <= last and row.get("completions")]
    completions = sum(row["completions"] for row in rows)
    if not completions:
        return None
    calls = sum(row.get("tool_calls", 0) for row in rows)
    return {
        "calls_per_completion": calls / completions,
        "error_share": sum(row.get("tool_errors", 0) for row in rows) / calls if calls else float("nan"),
        "use_share": sum(row.get("tool_use_ratio", 0) * row["completions"] for row in rows) / completions,
    }


def record_stats(run: RunRecord) -> dict[str, float]:
    """From the run's rollout records: the share of calls whose expression is a bare number, and calls per
    completion among completions that answered right and wrong."""
    calls = bare = 0
    per_outcome = {True: [0, 0], False: [0, 0]}  # correct -> [calls, completions]
    for path in saved_rollouts(run.path).values():
        for record in read_rollouts(path):
            made = record.get("tool_calls") or []
            per_outcome[bool(record["correct"])][0] += len(made)
            per_outcome[bool(record["correct"])][1] += 1
            for call in made:
                calls += 1
                try:
                    expression = json.loads(call["text"]).get("arguments", {}).get("expression", "")
                except (json.JSONDecodeError, AttributeError):
                    continue
                bare += isinstance(expression, str) and BARE_NUMBER.fullmatch(expression) is not None
    return {
        "bare_share": bare / calls if calls else float("nan"),
        "calls_right": per_outcome[True][0] / per_outcome[True][1] if per_outcome[True][1] else float("nan"),
        "calls_wrong": per_outcome[False][0] / per_outcome[False][1] if per_outcome[False][1] else float("nan"),
    }


def _cell(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v == v]  # NaN: nothing to count in that run
    if not values:
        return "-"
    interval = t_interval(values)
    if interval.low is None:
        return f"{interval.mean:.{digits}f}"
    return f"{interval.mean:.{digits}f} [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"


def report(paths: list[str], window: int) -> str:
    varied, points = group_points(load_runs(paths))
    lines = []
    for point in points:
        if not any(row.get("tool_calls") for run in point.runs for row in run.rows):
            continue
        label = " ".join(f"{k}={v}" for k, v in point.settings.items()) or "runs"
        steps = max(row["step"] for run in point.runs for row in run.rows)
        lines += [f"{label} ({len(point.runs)} seeds): mean [95% t interval over seeds]",
                  f"{'steps':>9}  {'calls/completion':>22}  {'call errors':>22}  {'tool use':>22}"]
        windows = [(start, min(start + window - 1, steps)) for start in range(1, steps + 1, window)]
        rates = {w: [window_rates(run.rows, *w) for run in point.runs] for w in windows}
        for w in windows:
            got = [r for r in rates[w] if r]
            lines.append(f"{w[0]:>4}-{w[1]:<4}  " + "  ".join(
                f"{_cell([r[key] for r in got]):>22}" for key in ("calls_per_completion", "error_share", "use_share")))
        pairs = [(a, b) for a, b in zip(rates[windows[0]], rates[windows[-1]]) if a and b]
        lines.append(f"{'last-first':>9}  " + "  ".join(
            f"{_cell([b[key] - a[key] for a, b in pairs]):>22}" for key in ("calls_per_completion", "error_share",
                                                                              "use_share")))
        records = [record_stats(run) for run in point.runs]
        lines.append(f"rollout records: bare-number calls {_cell([r['bare_share'] for r in records])}; calls per "
                     f"completion right {_cell([r['calls_right'] for r in records], 2)}, wrong "
                     f"{_cell([r['calls_wrong'] for r in records], 2)}")
        lines.append("")
    return "\n".join(lines) if lines else "no run made a tool call"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run or sweep folders")
    parser.add_argument("--window", type=int, default=10, help="steps per window")
    args = parser.parse_args()
    print(report(args.paths, args.window))


if __name__ == "__main__":
    main()
