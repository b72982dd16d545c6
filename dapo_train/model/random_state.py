"""The random streams a checkpoint holds (Python's, numpy's, torch's CPU stream and one per CUDA device this
process sees), saved as tensors and plain containers so that trainer_state.pt loads with weights_only=True.

A resume may see another count of CUDA devices than the save did (fewer GPUs lent, CUDA_VISIBLE_DEVICES
changed, a CPU checkpoint on a card): torch.cuda.set_rng_state_all would raise an IndexError at the first saved
device past the visible ones, so the streams both have are restored, device by device, and the rest said.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)


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
    _set_cuda_streams(list(state.get("cuda", [])))


def _set_cuda_streams(saved: list[torch.Tensor]) -> None:
    """The first min(saved, visible) devices' streams restored; a count that differs is said in one line."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index, stream in enumerate(saved[:visible]):
        torch.cuda.set_rng_state(stream, index)
    if len(saved) == visible:
        return
    held = (f"the CUDA random streams of {len(saved)} device{'s' if len(saved) > 1 else ''}" if saved
            else "no CUDA random streams (saved without CUDA)")
    if not visible:
        fate = "they are not used"
    elif not saved:
        fate = "it starts fresh" if visible == 1 else "they start fresh"
    else:
        rest = abs(len(saved) - visible)
        fate = f"the first {min(len(saved), visible)} restored, the other {rest} " + \
            ("saved not used" if len(saved) > visible else "start fresh")
    logger.warning("the checkpoint holds %s and this process sees %s: %s", held, visible or "none", fate)
