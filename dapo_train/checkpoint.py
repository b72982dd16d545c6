"""Checkpoints: atomic save, discovery, pruning and the trainer state needed for exact resume.

A checkpoint_<step>/ folder holds the HF model (safetensors; for a LoRA run the adapter alone,
see lora.py) and tokenizer, the resolved config.yaml, and trainer_state.pt (step, data position,
dynamic-sampling carry-over, RNG states, optimizer and LR schedule). It is written to a
temporary sibling folder and renamed into place, so a crash or kill during a save leaves the
previous checkpoint intact and never a half one.
trainer_state.pt holds only tensors and plain containers: it loads with weights_only=True.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from dapo_train.config import Config, save_config
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


def _weights_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def save_checkpoint(
    run_dir: str | Path, step: int, *, model, tokenizer, cfg: Config, state: dict, keep_last: int = 0
) -> Path:
    """Write checkpoint_<step>/ atomically; returns its path. Refuses NaN/inf weights."""
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint_{step}"
    if not _weights_finite(model):
        raise RuntimeError(f"refusing to save checkpoint_{step}: the model has NaN or inf weights")
    tmp = run_dir / f".tmp_checkpoint_{step}_{os.getpid()}"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / CONFIG_FILE)
        torch.save(state, tmp / STATE_FILE)
        usual_file_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = {errno.ENOSPC: "disk full", errno.EACCES: "permission denied"}.get(exc.errno, exc.strerror or str(exc))
        raise UserError(
            f"could not save checkpoint_{step} in {run_dir}: {reason}; earlier checkpoints are intact"
        ) from None
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
    if keep_last <= 0:
        return
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_state(checkpoint: str | Path) -> dict:
    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        raise UserError(f"{checkpoint} is not a resumable checkpoint: {STATE_FILE} is missing")
    return torch.load(path, map_location="cpu", weights_only=True)
