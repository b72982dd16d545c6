"""The card's memory, step by step (CUDA only): what a first real run needs to see how close it came.

Each step's peaks since the step began (torch's caching allocator: reset_peak_memory_stats at its start, then
max_memory_allocated and max_memory_reserved) go into metrics.jsonl as `cuda_peak_allocated_gib` and
`cuda_peak_reserved_gib`; the session's first step also says them in one line, its reserved peak beside the
start-time estimate (update/budget.py's estimated_peak: the memory model at the update's budget) and the card's
size. Neither counts the CUDA context nor memory outside torch's allocator (vLLM's own pool in sleep mode
may be). A step's evals come after its peaks are read. On a CPU nothing is recorded: no zeros stand in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dapo_train.train.memory import GIB

logger = logging.getLogger(__name__)

ALLOCATED, RESERVED = "cuda_peak_allocated_gib", "cuda_peak_reserved_gib"  # metrics.jsonl's keys


@dataclass
class CardMemory:
    """The device a run measures (None: a CPU, nothing measured), the start's estimate and the card's size."""

    device: torch.device | None = None
    estimate: int | None = None  # bytes: the estimated peak at start (None: none was made)
    total: int = 0  # bytes: the card's memory
    said: bool = False  # the first step's line is said

    @classmethod
    def start(cls, device: torch.device, estimate: int | None) -> CardMemory:
        if device.type != "cuda":
            return cls()
        return cls(device, estimate, torch.cuda.mem_get_info(device)[1])

    def begin_step(self) -> None:
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_metrics(self, step: int) -> dict:
        """The step's peaks in GiB ({} on a CPU); the first step's line."""
        if self.device is None:
            return {}
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        if not self.said:
            self.said = True
            estimated = f"{self.estimate / GIB:.1f} GiB estimated at start" if self.estimate is not None else \
                "no estimate at start"
            logger.info("step %d: the card's peak %.1f GiB reserved (%s; %.1f GiB allocated) of %.1f GiB", step,
                        reserved / GIB, estimated, allocated / GIB, self.total / GIB)
        return {ALLOCATED: round(allocated / GIB, 4), RESERVED: round(reserved / GIB, 4)}
