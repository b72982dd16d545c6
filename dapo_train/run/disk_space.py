"""Disk space for a run's checkpoints: one checkpoint's size, how many the run holds at once, and the
free space of output_dir's file system, checked before the first step (check_disk_space: too little
for one is refused, for all of them warned) and reported by preflight for the real model (disk_plan).
The checkpoints themselves, and the steps they are saved at, are run/checkpoint.py's.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.run.checkpoint import save_steps

logger = logging.getLogger(__name__)

GB = 10**9
TOKENIZER_ALLOWANCE = 16 * 10**6  # tokenizer, config and generation_config files (Qwen2.5's: about 11.5 MB)


def checkpoint_bytes(weights: int, trainable: int) -> int:
    """One checkpoint_<step>/ on disk: `weights`, the bytes of the saved weights (every parameter at its
    dtype, or a LoRA run's adapter alone); AdamW's two moments (exp_avg, exp_avg_sq) of every trainable
    parameter at its dtype, twice `trainable` (their bytes); and the tokenizer's allowance."""
    return weights + 2 * trainable + TOKENIZER_ALLOWANCE


def new_checkpoints_at_once(cfg: Config, done_step: int = 0, existing: int = 0) -> int:
    """The most checkpoints a run from `done_step` (with `existing` of them already on disk) adds at once:
    every one with checkpoint.keep_last 0, else keep_last (and the best, checkpoint.keep_best) + 1 in all
    (a new one is written whole before the oldest is pruned), never fewer than one."""
    remaining, keep = len(save_steps(cfg, done_step)), cfg.checkpoint.keep_last
    held = keep + int(cfg.checkpoint.keep_best)  # the best beside the newest keep_last
    return remaining if keep <= 0 else min(remaining, max(1, held + 1 - existing))


def size_text(size: float) -> str:
    return f"{size / GB:.1f} GB" if size >= GB else f"{size / 10**6:.0f} MB"


def _free_bytes(run_dir: str | Path) -> int:
    """The free space of the file system run_dir is (or will be) on."""
    folder = Path(run_dir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def disk_plan(cfg: Config, weights: int, trainable: int) -> str:
    """Preflight's line: one checkpoint (checkpoint_bytes), what the run holds at once, the free space."""
    one, count, free = checkpoint_bytes(weights, trainable), new_checkpoints_at_once(cfg), _free_bytes(cfg.output_dir)
    fits = "fits" if free >= count * one else "does NOT fit: the run warns" if free >= one else \
        "does NOT fit: the run refuses to start"
    every, keep = cfg.checkpoint.every_steps, cfg.checkpoint.keep_last
    return (f"one checkpoint about {size_text(one)} (weights {size_text(weights)}, AdamW state "
            f"{size_text(2 * trainable)}, tokenizer); {count} at once (checkpoint.every_steps={every}, "
            f"checkpoint.keep_last={keep}): {size_text(count * one)}; {size_text(free)} free for output_dir "
            f"{cfg.output_dir}: {fits}")


def check_disk_space(cfg: Config, run_dir: Path, one: int, done_step: int = 0, existing: int = 0,
                     freed: int = 0) -> None:
    """Before the first step: refuse (UserError) when not one checkpoint of `one` bytes fits in the free
    space of run_dir's file system (plus `freed`, what --overwrite is about to remove), warn with the
    numbers when not all the run holds at once do."""
    free, count = _free_bytes(run_dir) + freed, new_checkpoints_at_once(cfg, done_step, existing)
    if free < one:
        raise UserError(
            f"output_dir {run_dir}: {size_text(free)} free, but one checkpoint needs about {size_text(one)} "
            f"({len(save_steps(cfg, done_step))} planned, checkpoint.every_steps={cfg.checkpoint.every_steps}); free "
            "space, or set output_dir=... on a larger disk"
        )
    if free < count * one:
        logger.warning(
            "output_dir %s: %s free, but %d checkpoints of about %s each (checkpoint.every_steps=%d, "
            "checkpoint.keep_last=%d) need %s at once; the run will stop at the first checkpoint that does not fit "
            "(exit code 4)", run_dir, size_text(free), count, size_text(one), cfg.checkpoint.every_steps,
            cfg.checkpoint.keep_last, size_text(count * one),
        )
