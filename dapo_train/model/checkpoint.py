"""Checkpoints: atomic save, discovery, pruning and the trainer state needed for exact resume.

A checkpoint_<step>/ folder holds the HF model (safetensors; for a LoRA run the adapter alone,
see lora.py) and tokenizer, the resolved config.yaml, and trainer_state.pt (step, data position,
dynamic-sampling carry-over, RNG states, optimizer and LR schedule, and `good`: whether its weights
are clean, train/health.py; pruning never removes the newest good checkpoint). A run of N processes adds
trainer_state_rank<r>.pt for each rank r > 0 (its RNG states and carry-over, and its optimizer
shard under FSDP/ZeRO). It is written to a temporary sibling folder and renamed into place, so a
crash or kill during a save leaves the previous checkpoint intact and never a half one. The state
files hold only tensors and plain containers: they load with weights_only=True.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import torch

from dapo_train.config.load import save_config
from dapo_train.config.schema import Config
from dapo_train.errors import UserError

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.yaml"
CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")


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


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (
            np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
            int(np_state[2]), int(np_state[3]), float(np_state[4]),
        ),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _weights_finite(tensors) -> bool:
    return all(torch.isfinite(t).all() for t in tensors if t.is_floating_point())


def _save_failed(run_dir: Path, step: int, exc: OSError) -> UserError:
    reason = {errno.ENOSPC: "disk full", errno.EACCES: "permission denied"}.get(exc.errno, exc.strerror or str(exc))
    return UserError(f"could not save checkpoint_{step} in {run_dir}: {reason}; earlier checkpoints are intact")


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
        raise _save_failed(run_dir, step, exc) from None
    return tmp


def rank_state_file(rank: int) -> str:
    return f"trainer_state_rank{rank}.pt"


def save_rank_state(tmp: Path, rank: int, state: dict) -> None:
    """Rank r > 0's own trainer state (RNG streams, carry-over; rank 0's is trainer_state.pt)."""
    torch.save(state, tmp / rank_state_file(rank))


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
        torch.save(state, tmp / STATE_FILE)
        usual_file_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _save_failed(run_dir, step, exc) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a kill -9 can still leave it: checkpoint_dirs ignores it
        raise
    _prune(run_dir, keep_last)
    return final


def usual_file_modes(folder: Path) -> None:
    """safetensors writes its file with mode 0600; give every file the mode the user's umask gives
    any new file (0644 under the usual 022), so a checkpoint can be shared like the rest of the run."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


def _prune(run_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints (0: all), and the newest one of good weights wherever it is."""
    if keep_last <= 0:
        return
    dirs = checkpoint_dirs(run_dir)
    older, kept = dirs[:-keep_last], dirs[-keep_last:]
    if older and not any(_good(path) for path in kept):
        older = [path for path in older if path != next((p for p in reversed(older) if _good(p)), None)]
    for old in older:
        shutil.rmtree(old, ignore_errors=True)


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
