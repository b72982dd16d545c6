"""Checkpoints: atomic save, discovery, pruning and the trainer state needed for exact resume.

A checkpoint_<step>/ folder holds the HF model (safetensors; for a LoRA run the adapter alone,
see lora.py) and tokenizer, the resolved config.yaml, and trainer_state.pt (step, data position,
dynamic-sampling carry-over, RNG states (random_state.py), optimizer and LR schedule, `good`: whether its weights
are clean, train/health.py, and `best_checkpoint`: with checkpoint.keep_best, the checkpoint of the best
periodic eval so far; pruning never removes the newest good checkpoint nor that one; `config`: the config saved
beside it, so that a resume can tell an edit of its config.yaml, run/config_changes.py). A run of N processes adds
trainer_state_rank<r>.pt for each rank r > 0 (its RNG states and carry-over, and its optimizer
shard under FSDP/ZeRO). It is written to a temporary sibling folder and renamed into place, so a
crash or kill during a save leaves the previous checkpoint intact and never a half one (the partial folder of
a kill -9 is removed when the run next starts, remove_dead_saves); a write the
disk refuses (full, I/O error, read-only) removes the half one and raises CheckpointNotSaved (which failures
are the disk's, and whether checkpoints fit on it, is run/disk_space.py's). The
state files hold only tensors and plain containers: they load with weights_only=True. Whether
checkpoint.keep_best can rank the checkpoints (keep_best_note) is here.

A checkpoint_<N>/ is the run's only when the run wrote it: the run marks each one it saves (CHECKPOINT_MARKER,
written last, before the rename), and one from before the marker is the run's when its trainer_state.pt is a
trainer state of step N (_older_checkpoint). A folder of the user's under that name (their own
checkpoint_9/trainer_state.pt, a copy under another step's name, checkpoint_007/) is never pruned, and
--overwrite refuses while it is there, naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dapo_train.config.load import CONFIG_FILE, load_config, read_saved_config, save_config
from dapo_train.config.schema import Config
from dapo_train.errors import CheckpointNotSaved, UserError
from dapo_train.run import disk_space
from dapo_train.run.outputs import OutputKind, mark, remove_folder

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"

BEST_KEY = "best_checkpoint"  # trainer_state.pt's record of the best checkpoint (checkpoint.keep_best)
SAVED_CONFIG_KEY = "config"  # trainer_state.pt's copy of the config the checkpoint was saved with (its config.yaml's)
# checkpoint_<step> as the run writes it, the step in decimal without leading zeros (checkpoint_007 is not one)
CHECKPOINT_RE = re.compile(r"^checkpoint_(0|[1-9]\d*)$")
TEMPORARY_RE = re.compile(r"^\.tmp_checkpoint_(\d+)_(\d+)$")  # temporary_dir's: the step, the saving process's pid
CHECKPOINT_MARKER = ".dapo-train-checkpoint"  # written in each checkpoint the run saves: the run wrote it
# checkpoint_<N>/: the model's files as transformers and peft name them (a full model,
# sharded or not, or a LoRA adapter with peft's README.md), the tokenizer's (the names of the tokenizer
# classes transformers ships: one or more of them), our config and trainer state (one per rank); then the
# eval_<what>.json and completions_<what>.jsonl that `dapo-train eval` writes beside them, atomically.
# A save's temporary folder (.tmp_checkpoint_<N>_<pid>/) holds the same files, the marker last.
PARTIAL_CHECKPOINT_KIND = OutputKind(
    "partial checkpoint folder", None,
    names=(CHECKPOINT_MARKER, "config.json", "generation_config.json", "model.safetensors",
           "model.safetensors.index.json", "adapter_config.json", "adapter_model.safetensors", "README.md",
           "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
           "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
           "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", CONFIG_FILE, STATE_FILE),
    patterns=(r"model-\d{5}-of-\d{5}\.safetensors", r"trainer_state_rank\d+\.pt",
              r"eval_[A-Za-z0-9._-]+\.json", r"completions_[A-Za-z0-9._-]+\.jsonl",
              r"\.(eval_[A-Za-z0-9._-]+\.json|completions_[A-Za-z0-9._-]+\.jsonl)\.\d+\.tmp"),
)


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def _weights_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def _not_saved(run_dir: Path, step: int, exc: BaseException) -> CheckpointNotSaved | None:
    """The stop for a write that failed because of the disk, or None: a bug (or a KeyboardInterrupt). Called
    while the partial folder is still there: an error that does not name the disk (torch.save into a path
    reports a full disk as a bare RuntimeError) counts as the disk's when the folder then refuses a small
    write, which it would not once the partial folder's room was given back."""
    if not isinstance(exc, Exception):
        return None
    reason = disk_space.disk_reason(exc) or disk_space.write_refused(run_dir)
    if reason is None:
        return None
    return CheckpointNotSaved(f"could not write checkpoint_{step} in {run_dir} ({reason}); its partial folder was "
                              "removed")


def temporary_dir(run_dir: str | Path, step: int) -> Path:
    """The hidden sibling folder a checkpoint is written into before it is renamed into place; under
    several ranks the others write their rank files into it first (save_rank_state)."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".tmp_checkpoint_{step}_{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise _not_saved(run_dir, step, exc) from None
    return tmp


def _running(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (another user's counts: it cannot be signalled, but it is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:  # no pid is that large
        return False
    return True


def remove_dead_saves(run_dir: str | Path) -> None:
    """Remove the temporary folders (temporary_dir) of saves whose process no longer runs: a kill -9 during a
    save leaves one that nothing else would ever rename or remove (as large as a checkpoint, and hidden from
    `ls`). Only names of that exact form, and never one whose process runs (it may be saving now). Says what it
    removed in one line."""
    run_dir = Path(run_dir)
    dead = [path for path in sorted(run_dir.iterdir()) if (match := TEMPORARY_RE.match(path.name)) and path.is_dir()
            and not path.is_symlink() and not _running(int(match.group(2)))]
    if not dead:
        return
    size = sum(file.lstat().st_size for path in dead for file in path.rglob("*") if file.is_file())
    for path in dead:
        shutil.rmtree(path)
    names = [f"{path.name}/" for path in dead]
    logger.warning("removed %s (%.0f MB) from %s: the partial checkpoint%s of a save whose process no longer runs",
                   ", ".join(names), size / 10**6, run_dir, "s" if len(dead) > 1 else "")


def rank_state_file(rank: int) -> str:
    return f"trainer_state_rank{rank}.pt"


def _save_state(state: dict, path: Path) -> None:
    """torch.save through a Python file: a write the disk refuses then surfaces as the OSError it is (the
    cause of torch's RuntimeError), where torch's own file writer loses the errno."""
    with open(path, "wb") as f:
        torch.save(state, f)


def save_rank_state(tmp: Path, rank: int, state: dict) -> None:
    """Rank r > 0's own trainer state (RNG streams, carry-over; rank 0's is trainer_state.pt)."""
    _save_state(state, tmp / rank_state_file(rank))


def load_rank_state(checkpoint: str | Path, rank: int) -> dict | None:
    """Rank r > 0's saved state, or None when the checkpoint was written by fewer processes."""
    path = Path(checkpoint) / rank_state_file(rank)
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


def save_checkpoint(
    run_dir: str | Path, step: int, *, model, tokenizer, cfg: Config, state: dict, keep_last: int = 0,
    state_dict: dict | None = None, tmp: Path | None = None,
) -> Path:
    """Write checkpoint_<step>/ atomically; returns its path. Refuses NaN/inf weights.

    state_dict: the full weights when `model` holds only a shard (FSDP, ZeRO); tmp: a temporary_dir
    other ranks have already written their files into."""
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint_{step}"
    tmp = temporary_dir(run_dir, step) if tmp is None else tmp
    try:
        if not _weights_finite(model.parameters() if state_dict is None else state_dict.values()):
            raise RuntimeError(f"refusing to save checkpoint_{step}: the model has NaN or inf weights")
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / CONFIG_FILE)
        _save_state(state, tmp / STATE_FILE)
        mark(tmp, CHECKPOINT_KIND)  # last: the run wrote this checkpoint, whole
        usual_file_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as exc:
        stop = _not_saved(run_dir, step, exc)  # before the partial folder goes: it may be what filled the disk
        shutil.rmtree(tmp, ignore_errors=True)  # a kill -9 can still leave it: remove_dead_saves
        if stop is not None:
            raise stop from None
        raise
    _prune(run_dir, keep_last, recorded_best(state))
    return final


def usual_file_modes(folder: Path) -> None:
    """safetensors writes its file with mode 0600; give every file the mode the user's umask gives
    any new file (0644 under the usual 022), so a checkpoint can be shared like the rest of the run."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _prune(run_dir: Path, keep_last: int, best: CheckpointScore | None = None) -> None:
    """Keep the newest `keep_last` checkpoints (0: all), the newest one of good weights wherever it is,
    and the `best` (checkpoint.keep_best)."""
    if keep_last <= 0:
        return
    dirs = [path for path in checkpoint_dirs(run_dir) if written_by_run(path)]  # not one pruned already, nor the user's
    older, kept = [p for p in dirs[:-keep_last] if best is None or p.name != best.name], dirs[-keep_last:]
    if older and not any(_good(path) for path in kept):
        older = [path for path in older if path != next((p for p in reversed(older) if _good(p)), None)]
    for old in older:
        kept = remove_folder(old, CHECKPOINT_KIND)
        if kept:
            logger.warning("pruned %s (checkpoint.keep_last=%d) of the files the run wrote and kept the folder for "
                           "what the run never writes there: %s", old, keep_last, ", ".join(kept))


def holds_good_weights(state: dict) -> bool:
    """A trainer state's `good`: its weights were saved before any optimizer step applied non-finite
    values since the last step that trained (train/health.py). A state from before the flag: good when it
    counted no non-finite step."""
    return bool(state.get("good", not state.get("bad_steps", 0)))


def _good(checkpoint: Path) -> bool:
    try:
        return holds_good_weights(load_state(checkpoint, mmap=True))
    except UserError:  # damaged: not a result to keep
        return False


@dataclass(frozen=True)
class CheckpointScore:
    """checkpoint_<step> and the accuracy of the periodic eval at its step (the fixed subset): the record
    checkpoint.keep_best ranks checkpoints by."""

    step: int
    accuracy: float

    @property
    def name(self) -> str:
        return f"checkpoint_{self.step}"

    def state(self) -> dict:
        return asdict(self)


def recorded_best(state: dict) -> CheckpointScore | None:
    """The best checkpoint a trainer state records (None: the run ran without checkpoint.keep_best)."""
    best = state.get(BEST_KEY)
    return CheckpointScore(int(best["step"]), float(best["accuracy"])) if best else None


def best_checkpoint(run_dir: str | Path) -> tuple[Path, CheckpointScore]:
    """`dapo-train eval RUN --best`: the best checkpoint the run's newest checkpoint records, checked; one
    UserError when there is none to evaluate."""
    run_dir = Path(run_dir)
    newest = latest_checkpoint(run_dir)
    if newest is None:
        raise UserError(f"{run_dir} holds no checkpoint_<step> folder; --best takes a run folder")
    best = recorded_best(load_state(newest, mmap=True))
    if best is None:
        names = ", ".join(p.name for p in checkpoint_dirs(run_dir))
        raise UserError(f"{run_dir} records no best checkpoint: {_why_no_best(newest)}; its checkpoints: {names}; "
                        "name one")
    if not (run_dir / best.name).is_dir():
        raise UserError(f"{run_dir}: its best checkpoint, {best.name} (eval accuracy {best.accuracy:.3f}), is gone; "
                        f"name another: {', '.join(p.name for p in checkpoint_dirs(run_dir))}")
    return run_dir / best.name, best


def _why_no_best(checkpoint: Path) -> str:
    """Why a run's newest `checkpoint` records no best, read in the config saved with it."""
    try:
        cfg = load_config(None, [], base=read_saved_config(checkpoint / CONFIG_FILE, notify=False))
    except UserError:  # no config beside it, or one this version cannot read
        return "it ran without checkpoint.keep_best, or no periodic eval ranked a checkpoint it saved"
    if not cfg.checkpoint.keep_best:
        return "it ran without checkpoint.keep_best"
    return keep_best_note(cfg) if cfg.eval.every_steps <= 0 else (
        f"checkpoint.keep_best ranks a checkpoint saved at a periodic eval's step (eval.every_steps="
        f"{cfg.eval.every_steps}), and none of its checkpoints was saved at one")


def keep_best_note(cfg: Config) -> str | None:
    """Why checkpoint.keep_best cannot act as configured, or ranks only some checkpoints (said at start);
    None when it ranks every one. It ranks a checkpoint by the periodic eval at its step, and the last
    step always has one."""
    every, steps = cfg.eval.every_steps, disk_space.save_steps(cfg, 0)
    if not cfg.checkpoint.keep_best:
        return None
    if every <= 0:
        return "checkpoint.keep_best cannot act: eval.every_steps=0, no periodic eval ranks the checkpoints"
    unranked = [step for step in steps if step % every and step != cfg.train.max_steps]
    if len(steps) - len(unranked) <= 1:
        return (f"checkpoint.keep_best cannot act: checkpoint_{cfg.train.max_steps} is the only checkpoint saved at "
                f"an eval step (checkpoint.every_steps={cfg.checkpoint.every_steps}); set checkpoint.every_steps to a "
                f"multiple of eval.every_steps={every}")
    if unranked:
        shown = ", ".join(f"checkpoint_{step}" for step in unranked[:3]) + (", ..." if len(unranked) > 3 else "")
        return (f"checkpoint.keep_best ranks only the checkpoints saved at an eval step (eval.every_steps={every}): "
                f"{len(steps) - len(unranked)} of {len(steps)} ({shown} {'is' if len(unranked) == 1 else 'are'} not); "
                "set checkpoint.every_steps to a multiple of eval.every_steps to rank them all")
    return None


# What every trainer_state.pt holds (trainer.trainer_state); a file without them is not one.
STATE_KEYS = ("step", "bad_steps", "sampler", "buffer", "rng", "optimizer")


def load_state(checkpoint: str | Path, mmap: bool = False) -> dict:
    """trainer_state.pt, checked: one UserError when it is missing, damaged or not a trainer state.
    mmap=True maps the tensors instead of reading them: a cheap check before anything loads."""
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise UserError(f"{checkpoint} is not a resumable checkpoint: {STATE_FILE} is missing")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no central directory
        raise UserError(f"{path} is damaged (not a whole file of torch.save); resume from another checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, EOFError, ValueError, OSError, pickle.UnpicklingError) as exc:
        said = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise UserError(f"{path} is damaged ({type(exc).__name__}: {said}); resume from another checkpoint") from None
    missing = [key for key in STATE_KEYS if key not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise UserError(f"{path} is not a trainer state (no {', '.join(missing)}); resume from another checkpoint")
    return state


def _older_checkpoint(folder: Path) -> str | None:
    """Why `folder`, a checkpoint_<N>/ without CHECKPOINT_MARKER, is not one a dapo-train from before the marker
    saved (None: it is one): such a checkpoint holds the trainer state of step N."""
    try:
        step = load_state(folder, mmap=True)["step"]
    except UserError:
        return f"its {STATE_FILE} is missing or not a trainer state"
    return None if step == checkpoint_step(folder) else f"its {STATE_FILE} is step {step}'s"


CHECKPOINT_KIND = dataclasses.replace(PARTIAL_CHECKPOINT_KIND, name="checkpoint folder", marker=CHECKPOINT_MARKER,
                                      older=_older_checkpoint)


def checkpoint_step(checkpoint: Path) -> int | None:
    """The step of checkpoint_<step>/, from its name (None: not a name the run writes)."""
    match = CHECKPOINT_RE.match(checkpoint.name)
    return int(match.group(1)) if match else None


def written_by_run(checkpoint: Path) -> bool:
    """Whether the run wrote `checkpoint` (its marker, or a trainer state of its step from before the marker)."""
    return (checkpoint / CHECKPOINT_MARKER).is_file() or _older_checkpoint(checkpoint) is None
