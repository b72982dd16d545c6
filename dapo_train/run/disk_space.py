"""Disk space for a run's checkpoints: the steps it saves at, one checkpoint's size, how many the run holds
at once, and the free space of output_dir's file system, checked before the first step (check_disk_space: too
little for one is refused, for all of them warned) and reported by preflight for the real model (disk_plan);
and, when a save fails, whether the disk refused the write (disk_reason, write_refused), which stops the run
with its last checkpoint rather than as a bug. The checkpoints themselves are run/checkpoint.py's.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

from dapo_train.config.schema import Config
from dapo_train.errors import UserError

logger = logging.getLogger(__name__)

GB = 10**9
TOKENIZER_ALLOWANCE = 16 * 10**6  # tokenizer, config and generation_config files (Qwen2.5's: about 11.5 MB)
_PROBE_BYTES = 1 << 20  # a failed write is the disk's when the folder then refuses this much too


def save_steps(cfg: Config, done_step: int) -> list[int]:
    """The steps after `done_step` this run saves at: every checkpoint.every_steps and the last."""
    every, last = cfg.checkpoint.every_steps, cfg.train.max_steps
    periodic = range(every, last, every) if every > 0 else range(0)
    return [step for step in [*periodic, last] if step > done_step]


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


# The errnos of a write the disk refused, when one is only the cause of the error raised: no space, over
# quota, an I/O error, a read-only file system, a file past the system's size limit.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG}
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' writer names the errno in its message


def write_refused(folder: Path) -> str | None:
    """Why `folder` refuses a small write now (No space left on device, Read-only file system...), or None."""
    try:
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(b"\0" * _PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def disk_reason(exc: BaseException) -> str | None:
    """Why a failed write was the disk's, read from the error: an OSError, or an error caused by one of the
    disk's (torch.save raises a RuntimeError over the file's OSError; safetensors a SafetensorError naming
    `(os error 28)`). None: the error does not say."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        code = exc.errno if isinstance(exc, OSError) else next(
            (int(found) for found in _RUST_OS_ERROR.findall(str(exc))), None)
        if code in _DISK_ERRNOS:
            return os.strerror(code)
        exc = exc.__cause__ or exc.__context__
    return None
