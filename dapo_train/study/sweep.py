"""`dapo-train sweep CONFIG KEY=V1,V2 ...`: a grid of runs of one config, trained one after another.

Why in this process and in sequence: one card (or a few CPU cores) trains one run at a time anyway,
and one process gives the whole sweep one Ctrl-C handler: the run in progress saves a checkpoint and
the sweep stops before the next point. Every point's Config is built and checked first, so a typo in
the last value fails in a second, not after hours of runs.

SWEEP_DIR/sweep.json records each point's status and is rewritten (atomically) at every change, so
running the same command again skips finished points, resumes an interrupted one from its latest
checkpoint and starts over a run that never saved one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dapo_train.config.load import CONFIG_FILE, is_override, load_config
from dapo_train.config.schema import Config
from dapo_train.errors import DoesNotFit, RunRegressed, TaskSolved, TrainingAborted, UserError
from dapo_train.rewards.scoring import rewards_from_config
from dapo_train.run.checkpoint import latest_checkpoint
from dapo_train.run.files import write_json_atomic
from dapo_train.run.folder import check_start, config_differences, saved_run_config
from dapo_train.run.lock import hold_folder
from dapo_train.run.outputs import OutputKind, holds_own, local_inputs, mark
from dapo_train.run.signals import StopRequested
from dapo_train.study.runs import SWEEP_FILE, key_labels


def _sweep_record(path: Path) -> tuple[dict[str, str], str | None]:
    """A sweep.json read: point name -> status, and why it is not one a sweep wrote (None: it is one, an
    object with its varied_keys and "points" that each have a name and a status)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        statuses = {point["name"]: point["status"] for point in record["points"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return {}, f"{type(exc).__name__}: {exc}"
    return statuses, None if "varied_keys" in record else "no varied_keys"


def _older_sweep(folder: Path) -> str | None:
    """Why `folder`, without the sweep marker, is not a sweep an older dapo-train wrote (None: it is one): such
    a sweep wrote its sweep.json."""
    path = folder / SWEEP_FILE
    if not path.is_file():
        return f"no {SWEEP_FILE}"
    problem = _sweep_record(path)[1]
    return None if problem is None else f"{SWEEP_FILE} is not one a sweep wrote ({problem})"


# What a sweep writes at the top of its folder (run/outputs.py): sweep.json, and a run folder per point
# (each checked as a run's before the first point trains). A sweep replaces nothing itself.
SWEEP_KIND = OutputKind("dapo-train sweep folder", ".dapo-train-sweep", names=(SWEEP_FILE,), older=_older_sweep)
# The sweep sets these itself for every run; --seeds is how seeds vary.
RESERVED_KEYS = ("output_dir", "run_name")

_OPENERS, _CLOSERS = "[{(", "]})"


def split_top_level(value: str) -> list[str]:
    """'0.1,0.5' -> ['0.1', '0.5']; commas inside brackets or YAML quotes do not split, so
    "[{name: a}, {name: b}]" stays one value. A quote opens only where a YAML scalar can start
    (so the apostrophe in `it's` is a letter); '' inside single quotes and \\" inside double quotes
    are escapes."""
    parts, current, depth, quote = [], [], 0, None
    i = 0
    while i < len(value):
        char = value[i]
        if quote == "'" and value.startswith("''", i):
            current.append("''")
            i += 2
            continue
        if quote == '"' and char == "\\":
            current.append(value[i : i + 2])
            i += 2
            continue
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"" and "".join(current).strip()[-1:] in ("", ",", ":", *_OPENERS):
            quote = char
        elif char in _OPENERS:
            depth += 1
        elif char in _CLOSERS:
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            i += 1
            continue
        current.append(char)
        i += 1
    parts.append("".join(current).strip())
    return parts


def parse_seeds(text: str | None) -> list[int] | None:
    """'1,2,3' -> [1, 2, 3]; None -> None (each point runs once with the config's own seed)."""
    if text is None:
        return None
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise UserError(f"--seeds {text!r}: expected integers separated by commas, e.g. --seeds 1,2,3") from None
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: a seed is given twice")
    return seeds


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "-", text)


def default_sweep_name(config_path: str, varied: dict[str, list[str]], plain: list[str]) -> str:
    """`sweep_<config>_<key>=<v1>-<v2>[_<key>=<value> ...]` (`sweep_<config>` for seeds alone): the grid and
    the fixed overrides, so two sweeps of one config differ in folder unless they run the same grid (seeds
    aside: more seeds of a grid belong with it). A name past 100 characters is cut and ends in a hash of the
    whole."""
    fixed = dict(item.split("=", 1) for item in plain)
    labels = key_labels([*varied, *fixed])
    parts = [f"{labels[k]}={','.join(v)}" for k, v in varied.items()] + [f"{labels[k]}={v}" for k, v in fixed.items()]
    name = _safe("_".join(["sweep", Path(config_path).stem, *parts]))  # the commas become -
    if len(name) > 100:
        name = f"{name[:90]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
    return name


@dataclass
class SweepPoint:
    """One run of the grid. overrides: varied key -> value text; cfg: the run's full Config."""

    name: str
    overrides: dict[str, str]
    seed: int
    cfg: Config
    # pending / running / done / solved (exit 5 of the run: a result) / regressed (exit 6, eval.stop_on_regression: a
    # result) / interrupted / failed
    status: str = "pending"
    reason: str = ""  # why a failed point stopped (its TrainingAborted or DoesNotFit line)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    def finished(self) -> bool:
        final = self.run_dir / f"checkpoint_{self.cfg.train.max_steps}"
        return self.status in ("solved", "regressed") or (self.status == "done" and final.is_dir())


@dataclass
class Sweep:
    """The whole grid and its folder; every status change goes to sweep.json at once, so a killed
    sweep leaves a record that the next run of the same command (and `compare`) can read."""

    config_path: str
    sweep_dir: Path
    varied_keys: list[str]
    plain_overrides: list[str]
    seeds: list[int] | None
    points: list[SweepPoint] = field(default_factory=list)

    def set_status(self, point: SweepPoint, status: str, reason: str = "") -> None:
        point.status, point.reason = status, reason
        self.save()

    def save(self) -> None:
        """Write sweep.json, unless it already says the same (a finished sweep run again changes nothing)."""
        path = self.sweep_dir / SWEEP_FILE
        data = {
            "config": self.config_path,
            "varied_keys": self.varied_keys,
            "overrides": self.plain_overrides,
            "seeds": self.seeds,
            "points": [
                {"name": p.name, "overrides": p.overrides, "seed": p.seed, "run_dir": str(p.run_dir),
                 "status": p.status, **({"reason": p.reason} if p.reason else {})}
                for p in self.points
            ],
        }
        if not (path.is_file() and json.loads(path.read_text(encoding="utf-8")) == data):
            write_json_atomic(path, data)


def _split_args(args: list[str], seeds: list[int] | None) -> tuple[dict[str, list[str]], list[str]]:
    """-> (varied key -> its values, plain overrides); every input mistake is a UserError."""
    varied: dict[str, list[str]] = {}
    plain: list[str] = []
    seen: set[str] = set()
    for arg in args:
        key, sep, value = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"'{arg}' is not KEY=VALUE or KEY=V1,V2 (e.g. dapo.eps_high=0.1,0.5)")
        if key in seen:
            raise UserError(f"{key} is given twice; give all its values in one KEY=V1,V2")
        if key in RESERVED_KEYS:
            raise UserError(f"{key} is set by the sweep for each run; choose the sweep folder with --dir")
        seen.add(key)
        values = split_top_level(value)
        if key == "seed" and (seeds is not None or len(values) > 1):
            raise UserError("vary seeds with --seeds 1,2,3 (compare then averages over them), not with seed=")
        if len(values) > 1:
            if "" in values or len(set(values)) != len(values):
                raise UserError(f"{arg}: a value is empty or given twice")
            varied[key] = values
        else:
            plain.append(arg)
    if not varied and len(seeds or []) < 2:
        given = f"; --seeds {','.join(map(str, seeds))} is one" if seeds else ""
        raise UserError("nothing to sweep: give at least one KEY=V1,V2 (values split on commas outside brackets and "
                        f"quotes), or two or more seeds (--seeds 1,2,3){given}")
    return varied, plain


def plan_sweep(config_path: str, args: list[str], seeds_text: str | None = None, sweep_dir: str | None = None) -> Sweep:
    """Build and check every point's Config (and rewards) before anything trains; merge the
    statuses an earlier run of this sweep left in sweep.json."""
    if is_override(config_path):
        raise UserError(f"sweep needs a CONFIG file first (e.g. configs/tiny-cpu.yaml), got '{config_path}'")
    seeds = parse_seeds(seeds_text)
    varied, plain = _split_args(args, seeds)
    labels = key_labels(list(varied))
    base = load_config(config_path, plain)  # the plain overrides checked once; its seed is the default
    folder = Path(sweep_dir or Path("outputs") / default_sweep_name(config_path, varied, plain))
    holds_own(folder, SWEEP_KIND, option="--dir", inputs=local_inputs(base))
    sweep = Sweep(config_path, folder, list(varied), plain, seeds)
    for values in itertools.product(*varied.values()):
        chosen = dict(zip(varied, values))
        for seed in seeds if seeds is not None else [base.seed]:
            name = "_".join([*(_safe(f"{labels[k]}={v}") for k, v in chosen.items()), f"seed{seed}"])
            run_dir = folder / name
            cfg = load_config(config_path, [
                *(f"{k}={v}" for k, v in chosen.items()), *plain, f"seed={seed}", f"output_dir={run_dir}",
                f"run_name={name}",
            ])
            rewards_from_config(cfg)  # the checks `run` does before loading a model
            if latest_checkpoint(run_dir) is None:
                check_start(cfg, overwrite=True)  # what run_sweep's train will replace is a run's, and only that
            sweep.points.append(SweepPoint(name, chosen, seed, cfg))
    names = [p.name for p in sweep.points]
    shared = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if shared is not None:
        raise UserError(f"two points would share the run folder {shared}; make the values differ in letters or digits")
    _merge_earlier(sweep)
    return sweep


def _merge_earlier(sweep: Sweep) -> None:
    """Carry statuses over from sweep.json, and refuse a run folder that holds a run of other settings
    (skipping or resuming it would mix two experiments under one name)."""
    earlier = _earlier_statuses(sweep.sweep_dir)
    for point in sweep.points:
        point.status = earlier.get(point.name, "pending")
        if not (point.run_dir / CONFIG_FILE).is_file():
            continue
        changed = config_differences(saved_run_config(point.run_dir), point.cfg, skip=("output_dir",))
        if changed:
            raise UserError(
                f"{point.run_dir} holds a run with other settings ({', '.join(key for key, _, _ in changed)}); "
                "use another --dir, or delete that folder to run this point again"
            )


def _earlier_statuses(sweep_dir: Path) -> dict[str, str]:
    """Point name -> status from the sweep.json an earlier run of the sweep left ({} if none). plan_sweep
    checked the folder first (holds_own): a sweep.json there without the sweep's marker is one a sweep
    wrote, so one that does not read as one sits beside the marker and is damaged; it is left as it is."""
    path = sweep_dir / SWEEP_FILE
    if not path.is_file():
        return {}
    statuses, problem = _sweep_record(path)
    if problem is not None:
        raise UserError(f"{path} is damaged ({problem}); delete it (the runs stay) and run the sweep again")
    return statuses


def run_sweep(sweep: Sweep, stop: StopRequested) -> int:
    """Train every unfinished point in order. -> exit code: 0, TrainingAborted.exit_code (3) when a point
    stopped on its own, diverged or out of memory with nothing left to halve (the others still ran; sweep.json
    says why; running the sweep again tries it again), or stop.exit_code when a signal stopped the sweep (the
    run in progress saved)."""
    with hold_folder(sweep.sweep_dir, "--dir"):  # a second sweep into this folder refuses until this one ends
        mark(sweep.sweep_dir, SWEEP_KIND)
        sweep.save()
        return _run_points(sweep, stop)


def _run_points(sweep: Sweep, stop: StopRequested) -> int:
    """run_sweep's points, in order, in the folder it holds. -> its exit code."""
    from dapo_train.train.loop import train  # here: compare and plot import this module, not the trainer's stack

    total, labels = len(sweep.points), key_labels(sweep.varied_keys)
    for index, point in enumerate(sweep.points, 1):
        if stop.requested:
            return _stopped(sweep, stop)
        head = f"[{index}/{total}] " + " ".join([*(f"{labels[k]}={v}" for k, v in point.overrides.items()),
                                                  f"seed={point.seed}"])
        if point.finished():
            print(f"{head}: done, skipped", flush=True)
            continue
        resume = latest_checkpoint(point.run_dir) is not None
        print(f"{head} -> {point.run_dir}{' (resuming)' if resume else ''}", flush=True)
        sweep.set_status(point, "running")
        try:
            train(point.cfg, resume=True if resume else None, overwrite=not resume, stop=stop)
        except (TrainingAborted, DoesNotFit) as exc:  # this point's own end: the next may fit, or not diverge
            sweep.set_status(point, "failed", str(exc))
            print(f"{head}: {exc.verdict}: {exc}", file=sys.stderr, flush=True)
            continue
        except (TaskSolved, RunRegressed) as exc:  # a result, kept: its last checkpoint
            sweep.set_status(point, exc.verdict, str(exc))
            print(f"{head}: {exc.verdict}: {exc}", flush=True)
            continue
        except KeyboardInterrupt:
            sweep.set_status(point, "interrupted")
            raise
        except BaseException:
            sweep.set_status(point, "failed")
            raise
        if stop.requested:
            sweep.set_status(point, "interrupted")
            return _stopped(sweep, stop)
        sweep.set_status(point, "done")
    failed = [p.name for p in sweep.points if p.status == "failed"]
    summary = f"{len(failed)} failed ({', '.join(failed)}); " if failed else ""
    print(f"sweep finished: {total - len(failed)} of {total} runs done; {summary}"
          f"compare them with: dapo-train compare {sweep.sweep_dir}", flush=True)
    return TrainingAborted.exit_code if failed else 0


def _stopped(sweep: Sweep, stop: StopRequested) -> int:
    print(
        f"sweep stopped; run the same command again to continue it ({sweep.sweep_dir / SWEEP_FILE})",
        file=sys.stderr, flush=True,
    )
    return stop.exit_code
