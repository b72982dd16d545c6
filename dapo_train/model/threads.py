"""torch's CPU threads (train.num_threads), capped at the CPUs this process may use.

More threads than cores never computes faster: they take turns on the same cores, and at 1000 threads on
2 cores a step never finished. So a request above the usable CPUs (the affinity mask where the system has
one: a container's or taskset's share, not the machine's) runs that many threads, said in one line.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_cpu_threads(requested: int) -> int | None:
    """Set torch's threads to train.num_threads, at most usable_cpus(); returns the count set, None for 0
    (torch's own default, left as it is)."""
    if requested <= 0:
        return None
    cpus = usable_cpus()
    chosen = min(requested, cpus)
    if chosen < requested:
        logger.warning("train.num_threads=%d is more than the %d CPUs this process may use: torch runs %d threads",
                       requested, cpus, chosen)
    torch.set_num_threads(chosen)
    return chosen
