"""The run folder: where a run may start, what `--resume` continues, which run is the latest.

- A fresh start checks, before anything loads or is created, that output_dir can be written and
  that the packages the trackers and LoRA need are installed; it refuses a folder that is not a run
  (run/outputs.py's rule: not empty and no run's marker or files, the current folder, a parent,
  home, the root, or sharing files with the data, the model or a reward model), refuses to replace a
  run that saved a checkpoint unless told (--overwrite, which removes only what a run writes and
  refuses while the folder holds anything else), and starts again over one that never saved any
  (nothing there can be resumed).
- `--resume` continues a run with its own saved config (the checkpoint's config.yaml); KEY=VALUE
  overrides change it and every changed key is listed, old -> new, before the model loads, as is an edit
  of either config.yaml (run/config_changes.py). A
  CONFIG file given with `--resume` only says where the run is (its output_dir).
- A run whose checkpoint already reached train.max_steps is finished: resuming it says so and
  changes nothing (no re-save, no rewritten logs, its checkpoints' eval files stay).
- Resuming from a checkpoint that is not the run's last abandons what came after it: the later
  checkpoints (with their eval files), the log rows past its step, the later steps' eval and rollout
  records and the config they ran with move into abandoned_after_step<N>_<time>/ inside the run
  folder, never deleted, so the run folder, its summary and a later `--resume RUN` follow the live
  trajectory alone.
- The latest run is the one whose training wrote last (metrics.jsonl, checkpoint weights), which
  `dapo-train eval` never touches.
"""

from __future__ import annotations

import logging
import os
import shlex
import tempfile
import time
from pathlib import Path

from dapo_train.config.load import (
    CONFIG_FILE,
    config_from_dict,
    config_to_dict,
    flatten_config,
    load_config,
    read_saved_config,
)
from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError, UserError
from dapo_train.model.lora import check_lora_start, check_resume
from dapo_train.run.checkpoint import (
    STATE_FILE,
    checkpoint_dirs,
    checkpoint_step,
    latest_checkpoint,
    load_state,
)
from dapo_train.run.eval_items import ITEMS_DIR, items_after
from dapo_train.run.layout import ABANDONED_PREFIX, refuse_links, run_kind
from dapo_train.run.lock import check_free
from dapo_train.run.logs import METRICS_FILE, split_logs
from dapo_train.run.outputs import holds_own, local_inputs, mark, remove_own
from dapo_train.run.rollouts import ROLLOUTS_DIR, rollouts_after
from dapo_train.run.trackers import check_trackers

logger = logging.getLogger(__name__)

RUNS_ROOT = Path("outputs")
# Files training writes and eval never does: their times say when a run last trained.
TRAINING_FILES = (METRICS_FILE,)
CHECKPOINT_TRAINING_FILES = ("config.json", STATE_FILE)


def resume_command(run_dir: str | Path) -> str:
    return f"dapo-train run --resume {shlex.quote(str(run_dir))}"


# --------------------------------------------------------------------------------------------
# Starting: checks that cost nothing, before the model loads and before the folder exists.


def unwritable(folder: Path) -> str | None:
    """Why `folder` cannot be created and written in, or None. A real probe (a temporary folder made
    and removed in the nearest existing folder), since permission bits do not tell root, read-only
    mounts or pseudo file systems (/sys, /proc) apart."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} exists and is not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dapo-write-check-", dir=existing))
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror or exc})"
    return None


def check_writable(run_dir: Path) -> None:
    """Fail before anything loads when output_dir cannot be created or written."""
    problem = unwritable(run_dir)
    if problem is not None:
        raise UserError(f"output_dir {run_dir}: {problem}; set output_dir=... to a writable folder")


def check_start(cfg: Config, overwrite: bool, source: Path | None = None) -> bool:
    """A fresh start in output_dir, checked before anything is written or loaded: refused where the
    folder is not empty and not a run, is the current folder, a parent of it, home or the root, or
    shares files with the config's inputs (and the checkpoint `source` a run continued elsewhere starts
    from); with --overwrite, also while the run holds foreign files. -> whether output_dir holds a run."""
    kind, inputs = run_kind(cfg), local_inputs(cfg)
    if source is not None:
        inputs[f"the resume checkpoint {source}"] = source
    return holds_own(Path(cfg.output_dir), kind, option="output_dir", inputs=inputs, replace=overwrite)


def prepare_run_dir(cfg: Config, resume: str | Path | bool | None, overwrite: bool) -> tuple[Path, Path | None]:
    """-> (run dir, checkpoint to resume from). Refuses to clobber a run that saved a checkpoint, and
    any folder that is not a run; with --overwrite the old run's files are only removed later, once
    setup has succeeded."""
    run_dir = Path(cfg.output_dir)
    if resume and overwrite:
        raise UserError("--resume continues the run in output_dir and --overwrite replaces it: give one of them")
    check_free(run_dir, "output_dir")  # a run writing there now: say so, not what its folder looks like meanwhile
    source = _resume_source(run_dir, resume) if resume else None
    if source is not None and source.resolve().parent != run_dir.resolve():  # continued elsewhere: a start there
        check_start(cfg, overwrite=False, source=source)
    held = check_start(cfg, overwrite) if source is None else True
    refuse_links(run_dir, cfg)
    check_writable(run_dir)
    check_trackers(cfg.logging.trackers)
    check_lora_start(cfg)
    if source is not None:
        load_state(source, mmap=True)  # a damaged state fails now, not after the model loaded
        check_resume(cfg, source)  # LoRA on/off, rank and layers cannot change: say so before the data loads
        return run_dir, source
    if held and not overwrite:
        if checkpoint_dirs(run_dir):
            raise UserError(
                f"output_dir {run_dir} already holds a run; continue it with: {resume_command(run_dir)}; or pass "
                "--overwrite to replace it, or set output_dir=... / run_name=..."
            )
        logger.warning("%s holds a run that never saved a checkpoint; starting it again", run_dir)
    return run_dir, None


def open_run_dir(cfg: Config, replace: bool) -> None:
    """The main process, once setup has succeeded: output_dir made and marked as a run's, after removing
    (replace: --overwrite) what the old run wrote there and nothing else."""
    run_dir, kind = Path(cfg.output_dir), run_kind(cfg)
    if replace:
        remove_own(run_dir, kind, "--overwrite: removed what the earlier run wrote")
    mark(run_dir, kind)


def _resume_source(run_dir: Path, resume: str | Path | bool) -> Path:
    source = latest_checkpoint(run_dir) if resume is True else Path(resume)
    if source is None:
        raise UserError(_no_checkpoint(run_dir))
    if not source.is_dir():
        raise UserError(f"--resume: checkpoint not found: {source}")
    return source


def _no_checkpoint(run_dir: Path) -> str:
    if (run_dir / CONFIG_FILE).is_file():
        return (
            f"--resume: {run_dir} holds a run that never saved a checkpoint, so there is nothing to resume; "
            f"start it again with: dapo-train run {shlex.quote(str(run_dir / CONFIG_FILE))}"
        )
    return f"--resume: no checkpoint_<step>/ in {run_dir}; start without --resume"


def finished(cfg: Config, checkpoint: Path) -> bool:
    """True when `checkpoint` already reached train.max_steps: resuming it would train nothing."""
    step = checkpoint_step(checkpoint)
    return step is not None and step >= cfg.train.max_steps


def finished_message(cfg: Config, run_dir: Path, checkpoint: Path) -> str:
    return (
        f"{run_dir} is already finished: {checkpoint.name} reached train.max_steps={cfg.train.max_steps}; "
        "nothing was changed.\n"
        f"  evaluate it: dapo-train eval {shlex.quote(str(checkpoint))}\n"
        f"  train further: {resume_command(run_dir)} train.max_steps=N"
    )


def set_aside_abandoned(run_dir: Path, step: int) -> Path | None:
    """A run resumed at `step`: move what its folder holds from after that step (later checkpoints,
    log rows past it, the per-item records of later evals, the rollout records of later steps, the
    config they ran with) into abandoned_after_step<step>_<time>/, and say what moved in one line.
    -> that folder, or None when nothing came after `step`."""
    later = [c for c in checkpoint_dirs(run_dir) if checkpoint_step(c) > step]
    logs, evals, rollouts = split_logs(run_dir, step), items_after(run_dir, step), rollouts_after(run_dir, step)
    if not later and not evals and not rollouts and not any(rest for _, rest in logs.values()):
        return None
    folder = _new_folder(run_dir, f"{ABANDONED_PREFIX}{step}_{time.strftime('%Y%m%d-%H%M%S')}")
    for checkpoint in later:
        os.replace(checkpoint, folder / checkpoint.name)
    for name, paths in ((ITEMS_DIR, evals), (ROLLOUTS_DIR, rollouts)):
        if paths:
            (folder / name).mkdir()
        for path in paths:
            os.replace(path, folder / name / path.name)
    for name, (kept, rest) in logs.items():
        if rest:
            (folder / name).write_text(rest, encoding="utf-8")
            (run_dir / name).write_text(kept, encoding="utf-8")
    names, moved = [c.name for c in later], []
    if names:
        moved.append(", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)} checkpoints)")
    if rows := logs[METRICS_FILE][1].count("\n"):
        moved.append(f"{rows} metrics rows")
    if evals:
        moved.append(f"{len(evals)} eval record file{'s' if len(evals) > 1 else ''}")
    if rollouts:
        moved.append(f"{len(rollouts)} rollout record file{'s' if len(rollouts) > 1 else ''}")
    if (run_dir / CONFIG_FILE).is_file():
        os.replace(run_dir / CONFIG_FILE, folder / CONFIG_FILE)
        moved.append(CONFIG_FILE)
    logger.warning("resuming %s at step %d, before its end: moved what came after it (%s) to %s", run_dir, step,
                   ", ".join(moved), folder)
    return folder


def _new_folder(parent: Path, name: str) -> Path:
    """parent/name, made now; parent/name_2, _3, ... when it exists (two resumes in one second)."""
    folder, number = parent / name, 1
    while folder.exists():
        number += 1
        folder = parent / f"{name}_{number}"
    folder.mkdir()
    return folder


# --------------------------------------------------------------------------------------------
# Resuming: the run's own config, and every change to it named.


def _find_resumable(resume: str, located: Config | None) -> tuple[Path, Path]:
    """`--resume` [latest | RUN_DIR | CHECKPOINT] -> (run folder, checkpoint); `latest` looks in the
    output_dir of `located` (CONFIG and KEY=VALUE on the defaults)."""
    if resume == "latest":
        run_dir = Path(located.output_dir)
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            hint = "" if run_dir.is_dir() else (
                "; a run's name comes from its config file and overrides, so name the run instead: "
                "dapo-train run --resume RUN_DIR [KEY=VALUE ...]"
            )
            raise UserError(_no_checkpoint(run_dir) + hint)
        return run_dir, checkpoint
    path = Path(resume)
    if checkpoint_step(path) is not None or (path / STATE_FILE).is_file():
        if not path.is_dir():
            raise UserError(f"--resume: checkpoint not found: {path}")
        return path.parent, path
    if not path.is_dir():
        what = "is a file, not a run or checkpoint folder" if path.exists() else "no such run or checkpoint folder"
        raise UserError(f"--resume {resume}: {what}")
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        raise UserError(_no_checkpoint(path))
    return path, checkpoint


def resume_config(resume: str, config_path: str | None, overrides: list[str]) -> tuple[Config, Path]:
    """The config and checkpoint `dapo-train run [CONFIG] [KEY=VALUE] --resume [RUN_DIR|CHECKPOINT]`
    continues: the checkpoint's saved config, with output_dir the run's folder, then the KEY=VALUE
    overrides. CONFIG only locates the run; where it differs from the saved config it says so."""
    located = load_config(config_path, overrides) if resume == "latest" or config_path is not None else None
    run_dir, checkpoint = _find_resumable(resume, located)
    saved = read_saved_config(checkpoint / CONFIG_FILE, notify=False)  # config_changes.warn_config_changes says it
    if Path(saved.get("output_dir") or run_dir).resolve() != run_dir.resolve():
        saved["output_dir"] = str(run_dir)  # the run was moved, or the checkpoint copied: write beside it
    try:
        cfg = load_config(None, overrides, base=saved)
    except ConfigError as exc:
        raise UserError(f"{exc} (in {checkpoint / CONFIG_FILE}{' or KEY=VALUE' if overrides else ''})") from None
    if config_path is not None:
        name = Path(config_path).name
        ignored = config_differences(located, cfg, skip=("output_dir", "run_name"))
        if ignored:
            logger.warning(
                "%s differs from the saved config of %s, which --resume keeps: %s; to change a setting, pass "
                "KEY=VALUE", config_path, run_dir,
                ", ".join(f"{key} (run: {in_run!r}, {name}: {in_file!r})" for key, in_file, in_run in ignored),
            )
    return cfg, checkpoint


def config_differences(old: Config, new: Config, skip: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
    """[(dotted key, value in old, value in new)] for every key whose value differs, by key; a key
    only one side has (a reward the other lacks) pairs with None."""
    before, after = flatten_config(config_to_dict(old)), flatten_config(config_to_dict(new))
    return [(key, before.get(key), after.get(key)) for key in sorted(before.keys() | after.keys())
            if key not in skip and before.get(key) != after.get(key)]


def saved_run_config(run_dir: Path) -> Config:
    """A run folder's config.yaml as this version reads it: retired keys dropped and keys added
    since at their defaults, so an old run and a new one of the same settings compare equal."""
    path = run_dir / CONFIG_FILE
    try:
        return config_from_dict(read_saved_config(path))
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------------------------
# The latest run, for bare checkpoint_N names.


def last_trained(run_dir: Path) -> float | None:
    """When training last wrote to `run_dir` (None: it holds no checkpoint)."""
    checkpoints = checkpoint_dirs(run_dir)
    if not checkpoints:
        return None
    files = [run_dir / name for name in TRAINING_FILES]
    files += [checkpoint / name for checkpoint in checkpoints for name in CHECKPOINT_TRAINING_FILES]
    times = [path.stat().st_mtime for path in files if path.is_file()]
    return max(times) if times else None


def runs_under(root: Path) -> dict[Path, float]:
    """Run folders with checkpoints under `root` (and one level down: sweeps) -> last training time."""
    if not root.is_dir():
        return {}
    candidates = [d for d in root.iterdir() if d.is_dir()]
    candidates += [d for parent in candidates for d in parent.iterdir() if d.is_dir()]
    candidates = [d for d in candidates if not d.name.startswith(ABANDONED_PREFIX)]
    found = {d: last_trained(d) for d in candidates}
    return {d: when for d, when in found.items() if when is not None}


def latest_run(root: Path = RUNS_ROOT) -> Path:
    """The run under `root` whose training wrote last."""
    runs = runs_under(root)
    if not runs:
        raise UserError(f"no run with checkpoints under {root}/; give the checkpoint's path or --run-dir RUN")
    return max(runs, key=runs.get)


def describe_runs(root: Path = RUNS_ROOT, most: int = 8) -> str:
    """'outputs/a (checkpoint_2, checkpoint_4), outputs/b (checkpoint_10)', newest training first."""
    runs = sorted(runs_under(root).items(), key=lambda item: -item[1])
    shown = [f"{run} ({', '.join(p.name for p in checkpoint_dirs(run))})" for run, _ in runs[:most]]
    more = f" and {len(runs) - most} more" if len(runs) > most else ""
    return ", ".join(shown) + more or "none"
