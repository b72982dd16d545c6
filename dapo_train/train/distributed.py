"""Several processes (`accelerate launch`, `torchrun`): who this process is, the few collective
operations the trainer needs, and the model with full weights for generation.

Every helper is the identity, and costs nothing, when there is one process. With N ranks:
- a rank's prompts are its slice of the same global order (`batch[rank::N]`), so prompts_per_step
  stays the step's global batch; rank 0 keeps the run's seed and the others derive theirs from it;
- counts that decide something (kept groups, Eq. 12 normalisers, micro-batch calls) are reduced
  over ranks before the decision, so every rank runs the same rounds, updates and collective ops;
- DDP, FSDP and ZeRO average gradients over ranks, while Eq. 12 wants their sum (each rank's loss
  is already divided by the global count): the update scales each rank's loss by N.
"""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import torch
import torch.distributed as dist

from dapo_train.errors import UserError

logger = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_main() -> bool:
    return rank() == 0


def rank_seed(seed: int, process: int) -> int:
    """Rank 0 keeps the run's seed (one process samples exactly as before); rank r > 0 gets a seed
    drawn from (seed, r), so no two ranks sample the same completions for the same prompt."""
    if process == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**32, process]).generate_state(1)[0])


def _device() -> torch.device:
    """NCCL reduces CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum (or max) over ranks, in float64: token counts stay exact up to 2**53."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=_OPS[op])
    return tensor.tolist()


def gather(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """The main process's `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def interleave(per_rank: list[list]) -> list:
    """Undo `items[rank::N]`: per-rank lists (in rank order) -> the items in their original order."""
    out = []
    for index in range(max((len(items) for items in per_rank), default=0)):
        out += [items[index] for items in per_rank if index < len(items)]
    return out


@contextlib.contextmanager
def gradient_sync(accelerator, model, sync: bool):
    """Backward of one micro-batch: reduce gradients over ranks only when `sync` (the mini-batch's
    last micro-batch); the others accumulate locally (DDP/FSDP no_sync; DeepSpeed steps only when
    accelerator.sync_gradients is set)."""
    if not is_distributed():
        yield
        return
    accelerator.sync_gradients = sync
    try:
        with contextlib.nullcontext() if sync else accelerator.no_sync(model):
            yield
    finally:
        accelerator.sync_gradients = True


def _fsdp2_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _is_fsdp1(model) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def sharded(model) -> bool:
    """True when this rank holds only part of the weights (FSDP version 1 or 2)."""
    return is_distributed() and (_is_fsdp1(model) or bool(_fsdp2_modules(model)))


@contextlib.contextmanager
def full_weights(accelerator, model):
    """The plain model with every weight present on this rank, for generation and no-grad scoring.

    Generation runs a different number of forward passes on each rank (each stops at its own EOS),
    so it must not involve a collective op per forward: DDP's wrapper is removed (its weights are
    the module's own); FSDP gathers the full weights once, before generating, and frees them after.
    """
    unwrapped = accelerator.unwrap_model(model)
    if not is_distributed():
        yield unwrapped
    elif _is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
            yield unwrapped
    elif modules := _fsdp2_modules(model):
        for module in modules:  # gathered now, and kept through every forward until the reshard below
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        try:
            yield unwrapped
        finally:
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(True, recurse=False)
    else:
        yield unwrapped


def fsdp_plugin():
    """accelerate's FSDP plugin for an FSDP launch (None for any other), read from the same environment as its
    own, with FSDP's mixed precision off and the gradients reduced in float32. accelerate's own, under bf16,
    casts to bfloat16 both what FSDP gathers (every forward's weights, and generation's: full_weights) and what
    it reduces; here each weight is gathered in its own dtype (float32 for the master weights that train), the
    reduction is float32, and the forward's bf16 is accelerate's autocast, as on one card."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    from accelerate.utils import FullyShardedDataParallelPlugin

    if os.environ.get("FSDP_VERSION", "1") == "2":  # accelerate's own default is 1
        from torch.distributed.fsdp import MixedPrecisionPolicy as Policy
    else:
        from torch.distributed.fsdp import MixedPrecision as Policy
    return FullyShardedDataParallelPlugin(mixed_precision_policy=Policy(reduce_dtype=torch.float32))


def check_strategy(accelerator) -> None:
    """Refuse what generation cannot run under (ZeRO-3 shards weights without a gather used here), and
    say when accelerate ignored an FSDP or DeepSpeed config (it runs them on GPUs only)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3:
        raise UserError(
            "DeepSpeed ZeRO-3 shards the weights and generation here needs them whole on each rank; use "
            "ZeRO-2 (configs/accelerate/deepspeed-zero2.yaml) or FSDP (configs/accelerate/fsdp.yaml)"
        )
    asked = [name for name in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"]
    if asked and kind not in (DistributedType.FSDP, DistributedType.DEEPSPEED) and is_main():
        logger.warning(
            "the accelerate config asks for %s, which accelerate runs on GPUs only: these %d processes run %s "
            "(plain data parallel) instead", asked[0], accelerator.num_processes, kind.value,
        )


def shards_optimizer(accelerator, model) -> bool:
    """True when each rank holds a different part of the optimizer state (FSDP, ZeRO): then every rank
    saves its own; under DDP they are equal and the main process saves one copy."""
    from accelerate.utils import DistributedType

    return sharded(model) or accelerator.distributed_type == DistributedType.DEEPSPEED


def full_state_dict(model) -> dict | None:
    """The whole model's weights, on the CPU of the main process (an empty dict elsewhere), when they
    are sharded: a collective op, every rank calls it. None when the unwrapped module holds them."""
    if not sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Gathered to the main process's CPU; on CPU ranks every rank keeps its copy (FSDP1's offload
    # of CPU tensors crashes, measured with torch 2.13 and gloo).
    offload = _device().type != "cpu"
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return state_dict if is_main() else {}


class _RankPrefix(logging.Filter):
    def __init__(self, process: int, processes: int) -> None:
        super().__init__()
        self.prefix = f"[rank {process}/{processes}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "rank_prefixed", False):  # one record passes every handler
            record.msg, record.rank_prefixed = self.prefix + str(record.msg), True
        return True


def configure_rank_logging(process: int, processes: int, at_work: str) -> None:
    """Under N ranks every log line names its rank and each rank says once what it does (at_work);
    after that, ranks other than the main one log only warnings (the main process speaks for the run)."""
    if processes <= 1:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(_RankPrefix(process, processes))
    logger.info("%s", at_work)
    if process != 0:
        logging.getLogger("dapo_train").setLevel(logging.WARNING)
