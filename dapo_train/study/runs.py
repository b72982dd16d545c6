"""Runs read back for a study: a run folder's config.yaml and metrics.jsonl (no model or tokenizer is
loaded; this works while a sweep is still running), a sweep folder's runs, and runs grouped into
points.

A run's own numbers (summarize_metrics), its change from its own step 0 (start_change) and how it ended
(run_status.json) are read here; a point is named by its settings or a run folder (find_point).

A point is a set of settings: runs whose configs agree on everything but seed and the cosmetic keys
(config.keys.COSMETIC_KEYS: output_dir, run_name, the progress bar, trackers, what is logged or kept)
are seeds of one point. The varied keys are the dotted keys whose values differ between
points; tables and legends name only those, by their short labels (key_labels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from dapo_train.config.keys import COSMETIC_KEYS
from dapo_train.config.load import CONFIG_FILE, config_to_dict, flatten_config
from dapo_train.errors import UserError, folder_listing
from dapo_train.evaluation.sampled import SHOWN
from dapo_train.run.eval_items import FINAL, PERIODIC, SAMPLED
from dapo_train.run.folder import saved_run_config
from dapo_train.run.logs import generation_cost, read_metrics, read_status

SWEEP_FILE = "sweep.json"


def key_labels(keys: list[str]) -> dict[str, str]:
    """Short names for dotted keys: the last part (`eps_high`), or the whole key where two keys
    share a last part (`rollout.max_new_tokens`, `eval.max_new_tokens`)."""
    last = [key.rsplit(".", 1)[-1] for key in keys]
    return {key: short if last.count(short) == 1 else key for key, short in zip(keys, last)}

# What makes seeds of one point: everything in the config but these.
PER_RUN_KEYS = ("seed", *COSMETIC_KEYS)
MISSING = "-"


@dataclass(frozen=True)
class RunRecord:
    """One run folder read back. config: flattened dotted config; rows: metrics.jsonl by step; status: how its
    last session ended (run_status.json's status; None for a run from before the record)."""

    path: Path
    config: dict
    rows: list[dict]
    status: str | None = None

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
        """A study script's row of runs (scripts/studies/: ablation.py, policy_losses.py): `row=<name>`."""
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
    status = read_status(path)
    return RunRecord(path, flatten_config(config_to_dict(saved_run_config(path))), rows,
                     status["status"] if status else None)


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


def _per_run(key: str) -> bool:
    """A PER_RUN_KEYS key, or an item of one (flattened lists: logging.trackers.0)."""
    return any(key == name or key.startswith(name + ".") for name in PER_RUN_KEYS)


def group_points(runs: list[RunRecord]) -> tuple[list[str], list[Point]]:
    """-> (varied keys, points in order of first appearance); see the module docstring."""
    groups: dict[tuple, list[RunRecord]] = {}
    for run in runs:
        setting = tuple(sorted((k, _show(v)) for k, v in run.config.items() if not _per_run(k)))
        groups.setdefault(setting, []).append(run)
    keys = list(dict.fromkeys(k for run in runs for k in run.config if not _per_run(k)))
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


def start_change(rows: list[dict]) -> dict | None:
    """A run's change from its own step 0: its end-of-run eval's (final/change) where it made one, else its last
    periodic eval's (eval/change), with the 95% paired interval; None before its first eval after step 0."""
    for kind in (FINAL, PERIODIC):
        row = next((row for row in reversed(rows) if _number(row.get(f"{kind.prefix}change")) is not None), None)
        if row is not None:
            return {"eval": "final" if kind is FINAL else f"step {row['step']}",
                    **{name: _number(row.get(f"{kind.prefix}{key}")) for name, key in
                       (("change", "change"), ("low", "change_low"), ("high", "change_high"))}}
    return None


def summarize_metrics(rows: list[dict]) -> dict[str, float | None]:
    """One run's metrics rows -> its numbers in the compare table (COLUMNS). The final accuracy is
    the end-of-run eval on the whole split (`final_accuracy`, eval.final_full); periodic eval rows
    carry `accuracy` on the fixed subset (step 0 = before training; best counts only steps after
    it); each has its answer accuracy beside it (None for runs from before it); the last sampled eval's
    (eval.samples) pass@1, maj@K and pass@K, each with its change from step 0 (sampled_<name>, None without one);
    training rows are steps >= 1; wall time is training plus every eval's seconds. The tool numbers (rollout.tools) are
    ratios of sums over the steps: calls per completion generated and the share of calls answered with
    an error, and the share of completions that called a tool at the first and last step."""
    evals = [(row["step"], _number(row["accuracy"])) for row in rows if _number(row.get("accuracy")) is not None]
    finals = _values(rows, FINAL.accuracy)
    last_eval = next((row for row in reversed(rows) if _number(row.get("accuracy")) is not None), {})
    last_final = next((row for row in reversed(rows) if _number(row.get(FINAL.accuracy)) is not None), {})
    sampled = next((row for row in reversed(rows) if _number(row.get(SAMPLED.accuracy)) is not None), {})
    train = [row for row in rows if row["step"] > 0]
    entropy = _values(train, "entropy")
    cost = generation_cost(train)
    calls, completions = sum(_values(train, "tool_calls")), sum(_values(train, "completions"))
    tool_use = _values(train, "tool_use_ratio")
    return {
        "final_accuracy": finals[-1] if finals else None,
        "final_answer_accuracy": _number(last_final.get(f"{FINAL.prefix}answer_accuracy")),
        "last_accuracy": evals[-1][1] if evals else None,
        "last_answer_accuracy": _number(last_eval.get(f"{PERIODIC.prefix}answer_accuracy")),
        "best_accuracy": max((acc for step, acc in evals if step > 0), default=None),
        **{f"sampled_{name}{end}": _number(sampled.get(f"{SAMPLED.prefix}{name}{end}")) for name in SHOWN
           for end in ("", "_change")},
        "clip_frac_high": _mean(_values(train, "clip_frac_high")),
        "clip_frac_low": _mean(_values(train, "clip_frac_low")),
        "entropy_first": entropy[0] if entropy else None,
        "entropy_last": entropy[-1] if entropy else None,
        "completion_length": _mean(_values(train, "completion_length_mean")),
        "generated_per_trained_token": cost["generated_per_trained_token"],
        "seconds_generate_per_group": cost["seconds_generate_per_group"],
        "tool_calls_per_completion": calls / completions if completions and _values(train, "tool_calls") else None,
        "tool_error_rate": sum(_values(train, "tool_errors")) / calls if calls else None,
        "tool_use_first": tool_use[0] if tool_use else None,
        "tool_use_last": tool_use[-1] if tool_use else None,
        "steps": float(max((row["step"] for row in rows), default=0)),
        "wall_seconds": sum(_values(train, "seconds_step")) + sum(sum(_values(rows, kind.seconds))
                                                                  for kind in (PERIODIC, SAMPLED, FINAL)),
    }


# --------------------------------------------------------------------------------------------
# Naming a point: compare --baseline's argument.


def _value(text: str) -> object:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def baseline_settings(name: str) -> dict[str, object]:
    """--baseline's KEY=VALUE settings (values read as YAML), checked before any run is read: a name that is
    neither a folder nor settings is said as such, not as a fault of the runs."""
    parts = name.split()
    if parts and all("=" in part for part in parts):
        return {key: _value(value) for key, _, value in (part.partition("=") for part in parts)}
    if "/" in name or name.startswith((".", "~")):  # no hub ids here: any slash is a path
        raise UserError(f"--baseline {name}: no such run or sweep folder; {folder_listing(Path(name))}")
    raise UserError(f"--baseline {name}: neither a run or sweep folder nor KEY=VALUE settings (e.g. eps_high=0.28)")


def find_point(points: list[Point], varied: list[str], name: str, named: set[Path] | None) -> Point:
    """The point `name` names: the one holding a run of a given folder (named: its run folders,
    resolved), else the one whose settings match every KEY=VALUE of name (short or dotted keys, values
    compared as YAML)."""
    if named is not None:
        found = [p for p in points if any(run.path.resolve() in named for run in p.runs)]
    else:
        labels = key_labels(varied)
        by_name = {**{labels[key]: key for key in varied}, **{key: key for key in varied}}
        wanted = {}
        for key, value in baseline_settings(name).items():
            if key not in by_name:
                raise UserError(f"--baseline {name}: {key!r} is not a setting that differs between the points "
                                f"(those are: {', '.join(labels.values()) or 'none'}); or give a run folder")
            wanted[by_name[key]] = value
        found = [p for p in points if all(_value(p.settings[k]) == v for k, v in wanted.items())]
    if len(found) != 1:
        shown = "; ".join(p.label(key_labels(varied)) for p in (found or points))
        narrow = "give one run folder" if named is not None else "name more settings"
        problem = f"matches {len(found)} points ({shown}); {narrow}" if found else f"names none of the points ({shown})"
        raise UserError(f"--baseline {name}: {problem}")
    return found[0]
