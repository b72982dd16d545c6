"""A generate call that runs out of memory, redone in smaller calls on the same rows with the same draws.

An hf engine generates a round's prompts in calls of at most rollout.generation_batch_size rows
(`GenerationRows`, whole groups). When a call raises torch.OutOfMemoryError its prompts are decoded again in
calls of half as many groups, from the random state the call began with: keyed draws (dapo.screen_size)
give each row its own seed, which the row keeps; the global stream is set back, so the smaller calls draw
what calls of that size would have drawn from the start. The smaller size stays for the rest of the run
(and in the checkpoint: train/state.py). What earlier calls generated is kept. When one group alone does not
fit a call, nothing is left to halve: DoesNotFit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dapo_train.errors import DoesNotFit
from dapo_train.faults import DECODE_ROWS, out_of_memory_above

logger = logging.getLogger(__name__)

# What cuts generation's memory, named when one group alone does not fit a generate call.
GENERATION_MEMORY_SETTINGS = ("a smaller rollout.group_size", "a shorter rollout.max_new_tokens",
                              "rollout.dtype=bfloat16", "a smaller data.max_prompt_length")


@dataclass
class GenerationRows:
    """The most rows of one generate call in force (rollout.generation_batch_size, halved by an out-of-memory
    call)."""

    limit: int


def random_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_random_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def decode_fitting(decode: Callable, model, chunk: list[torch.Tensor], group_size: int, settings, eos_ids: list[int],
                   pad_id: int, seeds: Sequence[int] | None, rows: GenerationRows) -> list[tuple[list, object]]:
    """decode(model, chunk, ...) -> [(chunk, Decoded)], or after out of memory [(part, Decoded), ...] of the
    chunk's prompts in order, each part at most half the failed call's groups (rows.limit lowered to it)."""
    device = next(model.parameters()).device
    state = random_state(device)
    try:
        out_of_memory_above(DECODE_ROWS, len(chunk) * group_size)  # a test's fault (faults.py); nothing otherwise
        keyed = {} if seeds is None else {"seeds": seeds}
        return [(chunk, decode(model, chunk, group_size, settings, eos_ids, pad_id, **keyed))]
    except torch.OutOfMemoryError:
        if len(chunk) == 1:
            raise DoesNotFit(f"one group alone ({group_size} rows) does not fit a generate call; what cuts "
                             f"generation's memory: {', '.join(GENERATION_MEMORY_SETTINGS)}") from None
    # Out of the handler: the error's frames, and the tensors they held, are gone.
    set_random_state(state, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    half = len(chunk) // 2
    logger.warning("out of memory in a generate call of %d rows: its prompts are decoded again in calls of at most "
                   "%d rows from the same random state (the same completions), and the smaller size stays",
                   len(chunk) * group_size, half * group_size)
    rows.limit = min(rows.limit, half * group_size)
    parts = []
    for start in range(0, len(chunk), half):
        part_seeds = None if seeds is None else seeds[start * group_size : (start + half) * group_size]
        parts += decode_fitting(decode, model, chunk[start : start + half], group_size, settings, eos_ids, pad_id,
                                part_seeds, rows)
    return parts
