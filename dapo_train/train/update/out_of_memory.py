"""Step 3 redone smaller when it runs out of memory, so that nothing the step generated is lost.

The step's rollouts cost most of the step. When a micro-batch's forward or backward raises
torch.OutOfMemoryError (update.MicroBatchOutOfMemory), the step's partial gradients are dropped, memory is
released, the budget is halved (Batching.halved: half the micro-batch that failed) and the same step's
update runs again on the same groups from the weights and optimizer state the step began with. The loss is
an exact token mean however a mini-batch is cut (Eq. 12), so the result equals the step run at the smaller
budget from the start. A step makes several optimizer steps (its mini-batches x dapo.num_iterations), so
before a step of more than one the trainable weights and the optimizer's state are copied to host memory
(`Snapshot`, its buffers reused from step to step, pinned on CUDA); a step of one optimizer step needs no
copy: a micro-batch fails before its only optimizer step moves anything. The smaller budget stays for the
rest of the run and in the checkpoint (state.py), so a resume keeps it. Groups are never split between
steps. When the micro-batch that failed held one completion, nothing is left to halve: DoesNotFit, with the
weights back at the step's start (the loop saves them as the last good step's checkpoint).

One process only: under several, the ranks' collective calls would have to agree on a retry; the run says
at start that an out-of-memory update ends it there (card.py).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import DoesNotFit
from dapo_train.train.records import StepBatch
from dapo_train.train.update.passes import Learner, MicroBatchOutOfMemory, update

logger = logging.getLogger(__name__)

# What cuts the update's memory, named when one completion alone does not fit.
UPDATE_MEMORY_SETTINGS = ("model.gradient_checkpointing=on", "a smaller train.logprob_chunk_mib",
                          "a shorter rollout.max_new_tokens", "LoRA (model.lora.r > 0)",
                          "a smaller rollout.vllm_memory (rollout.engine=vllm)")


def _inner(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


@dataclass
class Snapshot:
    """The trainable weights, the optimizer's state (AdamW's moments and step counts; fp16's loss scale) and
    the optimizer-step counter as a step began, in host memory. The weight buffers are allocated once (pinned
    on CUDA) and refilled at every step that needs them."""

    weights: list[torch.Tensor] = field(default_factory=list)
    optimizer: dict | None = None
    scaler: dict | None = None
    steps: int = 0

    def take(self, learner: Learner) -> None:
        trained = [p for p in learner.model.parameters() if p.requires_grad]
        if [b.shape for b in self.weights] != [p.shape for p in trained]:
            self.weights = [_host_like(p) for p in trained]
        for buffer, parameter in zip(self.weights, trained):
            buffer.copy_(parameter.detach(), non_blocking=True)
        wrapped = learner.optimizer.optimizer
        self.optimizer = _into_host(_inner(wrapped).state_dict(), self.optimizer)
        scaler = getattr(wrapped, "scaler", None)
        self.scaler = None if scaler is None else copy.deepcopy(scaler.state_dict())
        self.steps = learner.optimizer.steps
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies are done before anything moves

    def restore(self, learner: Learner) -> None:
        trained = [p for p in learner.model.parameters() if p.requires_grad]
        with torch.no_grad():
            for buffer, parameter in zip(self.weights, trained):
                parameter.copy_(buffer)
        wrapped = learner.optimizer.optimizer
        # A fresh copy: load_state_dict keeps a tensor already on its parameter's device (all of them on a CPU,
        # AdamW's step counts on CUDA), which the redo would then change in place, under this snapshot.
        _inner(wrapped).load_state_dict(_into_host(self.optimizer, None))
        if self.scaler is not None:
            wrapped.scaler.load_state_dict(self.scaler)
        learner.optimizer.steps = self.steps


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor to copy `tensor` into (pinned when it is on CUDA: the copy runs asynchronously)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


def _into_host(value, previous):
    """An optimizer state_dict copied to host memory (the live one holds references), into the tensors of
    `previous` (the last step's copy) wherever their shapes still match."""
    if isinstance(value, torch.Tensor):
        same = isinstance(previous, torch.Tensor) and previous.shape == value.shape and previous.dtype == value.dtype
        host = previous if same else _host_like(value)
        return host.copy_(value.detach(), non_blocking=True)
    if isinstance(value, dict):
        before = previous if isinstance(previous, dict) else {}
        return {key: _into_host(item, before.get(key)) for key, item in value.items()}
    if isinstance(value, list):
        before = previous if isinstance(previous, list) and len(previous) == len(value) else [None] * len(value)
        return [_into_host(item, old) for item, old in zip(value, before)]
    return copy.deepcopy(value)


@dataclass
class UpdateRetry:
    """Step 3 with its out-of-memory retry (module docstring). enabled: one process."""

    enabled: bool = True
    snapshot: Snapshot = field(default_factory=Snapshot)

    def update(self, learner: Learner, batch: StepBatch, cfg: Config, step: int) -> dict:
        """update.update on the step's batch, redone at half the failing micro-batch until it fits.
        step: the step's number, for the line that says so. Raises DoesNotFit when one completion alone
        does not fit."""
        several = min(cfg.train.updates_per_step, len(batch.groups)) * cfg.dapo.num_iterations > 1
        kept = self.enabled and several
        if kept:
            self.snapshot.take(learner)
        while True:
            try:
                return update(learner, batch, cfg)
            except MicroBatchOutOfMemory as exc:
                if not self.enabled:
                    raise
                completions, tokens = exc.completions, exc.tokens
            # Out of the handler: the error's frames, and the tensors they held, are gone.
            learner.model.zero_grad(set_to_none=True)  # the step's partial gradients
            if kept:
                self.snapshot.restore(learner)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            before, smaller = learner.batching, learner.batching.halved(completions, tokens)
            if smaller is None:
                raise DoesNotFit(f"step {step + 1}'s update: one completion alone ({tokens} positions) does not fit "
                                 f"the card; what cuts the update's memory: {', '.join(UPDATE_MEMORY_SETTINGS)}")
            learner.batching = smaller
            logger.warning("step %d: out of memory in the update (a micro-batch of %d completions, %d positions, "
                           "at %s): redone from the step's start on the same groups at %s, kept for the rest of "
                           "the run; no rollout regenerated", step + 1, completions, tokens, describe(before),
                           describe(smaller))


def describe(batching) -> str:
    """The budget in force, as the config key that sets it."""
    if batching.max_tokens > 0:
        return f"train.micro_batch_tokens={batching.max_tokens}"
    return f"train.micro_batch_size={batching.max_count}"
