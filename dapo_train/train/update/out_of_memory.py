"""An out-of-memory error in a step, met where nothing has moved: redone smaller, or the run ends at its last
good step. Nothing is copied: a step that does not fail pays no host memory and no transfer.

A step's rollouts cost most of it, so an out-of-memory error must cost neither them nor a trained weight. Instead
of keeping a copy of the weights and AdamW's state to go back to (17 GiB of host memory for Qwen2.5-1.5B, taken
before every step), the guard makes a step run out of memory, if it does, before its first optimizer step moves a
weight:

- AdamW's state exists before the first step, and on one CUDA card its step is fused (update/optim.py): an
  optimizer step needs no memory that the backward before it did not hold.
- The largest micro-batch the budget in force allows (`largest_micro_batch`: as many completions of
  rollout.max_new_tokens on the longest training prompt as one micro-batch holds, every position in the LM head)
  runs its forward and backward once, its gradient dropped, before the first optimizer step at that budget (the
  run's first step, a step after a budget was halved); a micro-batch that it does not cover (one sequence longer
  than the budget has a micro-batch of its own) runs so before its step's first optimizer step. Every other
  micro-batch is no larger, in positions, row width and LM-head positions, than one that already ran. What this
  costs is in metrics.jsonl per step (update_probes, update_probe_positions): one micro-batch per budget.
- The old-log-prob pass (no gradient, the update's micro-batches) runs before the update moves anything.

Where an out-of-memory error can still come, and what follows:
- the old-log-prob pass, or a micro-batch's move to the card, forward or backward (a probe's too) before the
  step's first optimizer step: the budget is halved (Batching.halved: half the micro-batch that failed), kept for
  the rest of the run and in the checkpoint, and the pass or the update is redone on the same groups, from the
  random state the update began with (dropout draws again what it drew), so the step equals one run at the smaller
  budget from the start; no rollout is regenerated. A micro-batch of one completion leaves nothing to halve.
- the step's first optimizer step, before it changes anything (clipping the gradients): no budget lowers it.
- either after an optimizer step of the step moved a weight: possible only when the allocator's free memory
  fragmented since the probe (or a foreach AdamW step, which changes the weights before it allocates, failed
  inside): nothing of the step's start is kept to redo it from.
The last three end the run, DoesNotFit (exit code 7); `kept` says whether the weights are still the last good
step's (train/loop.py then saves them as its checkpoint, at that step's data position: state.StepStart), or were
moved (the loop keeps the last checkpoint on disk and says which steps that loses).

One process only: under several, the ranks' collective calls would have to agree on a probe and a retry; the run
says at start that an out-of-memory error ends it there (card.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import DoesNotFit
from dapo_train.model.layout import row_limit
from dapo_train.train import ranks
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.update.batching import (
    Batching,
    MicroBatch,
    MicroBatchOutOfMemory,
    TrainSample,
    micro_batch_tokens,
)
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.optim import OptimizerOutOfMemory
from dapo_train.train.update.passes import Learner, micro_batch_backward, update_with_plan

logger = logging.getLogger(__name__)

# What cuts the update's memory, named when one completion alone does not fit.
UPDATE_MEMORY_SETTINGS = ("model.gradient_checkpointing=on", "a smaller train.logprob_chunk_mib",
                          "a shorter rollout.max_new_tokens", "LoRA (model.lora.r > 0)",
                          "a smaller rollout.vllm_memory (rollout.engine=vllm)")
# What cuts an optimizer step's: the training state itself.
OPTIMIZER_MEMORY_SETTINGS = ("LoRA (model.lora.r > 0)", "a smaller model",
                             "FSDP over several cards (docs/multi-gpu.md)")


@dataclass(frozen=True, order=True)
class Shape:
    """What a micro-batch's memory grows with: the positions its forward computes, its rows' width (the packed
    attention mask is rows x width x width) and the positions its LM head scores."""

    positions: int
    width: int
    head: int

    @classmethod
    def of(cls, micro: MicroBatch) -> Shape:
        batch = micro.batch
        return cls(batch.forward_tokens, int(batch.input_ids.shape[-1]), batch.head_tokens)

    def within(self, other: Shape) -> bool:
        return self.positions <= other.positions and self.width <= other.width and self.head <= other.head


def largest_micro_batch(batching: Batching, longest_prompt: int, completion_tokens: int,
                        group_size: int) -> MicroBatch:
    """The largest micro-batch `batching` makes, on the CPU: completions of `completion_tokens` on prompts of
    `longest_prompt` tokens, as many as one micro-batch holds: under train.micro_batch_size that many, in groups
    of `group_size` on a prompt of their own (with shared prefixes a group is a row: the widest); under a token
    budget as many as fit it (at least one), on one prompt (with shared prefixes its rows are the budget's
    widest, and every position but one prompt's per row is the LM head's). Zero advantages: its backward computes
    every gradient, all zero."""
    completion = torch.full((max(1, completion_tokens),), batching.pad_id, dtype=torch.long)

    def prompt(group: int) -> torch.Tensor:
        ids = torch.full((max(1, longest_prompt),), batching.pad_id, dtype=torch.long)
        ids[0] = group  # the groups' prompts told apart, so none is shared between groups
        return ids

    if batching.max_tokens <= 0:
        prompts = [prompt(group) for group in range(-(-batching.max_count // max(1, group_size)))]
        return batching.micro_batches([TrainSample(prompts[i // max(1, group_size)], completion, 0.0, True)
                                       for i in range(batching.max_count)])[0]
    one = TrainSample(prompt(0), completion, 0.0, True)
    count, rows = 1, row_limit(batching.max_tokens)
    while micro_batch_tokens([one] * (count + 1), batching.share_prefix, rows) <= batching.max_tokens:
        count += 1
    return batching.micro_batches([one] * count)[0]


@dataclass
class Probes:
    """What the guard ran to find an out-of-memory error before a weight moved: micro-batches and their positions."""

    count: int = 0
    positions: int = 0

    def metrics(self) -> dict:
        return {"update_probes": self.count, "update_probe_positions": self.positions}


@dataclass
class OutOfMemoryGuard:
    """Steps 2 and 3 (the old log-probs, the update) under the guard of the module docstring. enabled: one
    process. longest_prompt, completion_tokens, group_size: the largest micro-batch's (largest_micro_batch)."""

    enabled: bool = True
    longest_prompt: int = 1
    completion_tokens: int = 1
    group_size: int = 1
    fitted: list[Shape] = field(default_factory=list)  # micro-batches whose forward and backward ran

    def old_logprobs(self, model: torch.nn.Module, groups: list[Group], learner: Learner, step: int) -> int:
        """update/old_policy.record_old_logprobs, redone at half the failing micro-batch until it fits. -> rows
        scored."""
        while True:
            try:
                return record_old_logprobs(model, groups, learner.batching, learner.scorer)
            except MicroBatchOutOfMemory as exc:
                if not self.enabled:
                    raise
                failed = exc
            self._halve(learner, failed, step, "old-log-prob pass")

    def update(self, learner: Learner, batch: StepBatch, cfg: Config, step: int) -> dict:
        """update.update on the step's batch, redone at half the failing micro-batch while no weight has moved.
        step: the step's number before it (for the lines that say so). Raises DoesNotFit (module docstring)."""
        rng = _random_state()
        while True:
            moved_from = learner.optimizer.steps
            try:
                plan = ranks.plan_update(batch, learner.batching, cfg)
                probes = self._probe(learner, plan) if self.enabled else Probes()
                return {**update_with_plan(learner, batch, plan), **probes.metrics()}
            except MicroBatchOutOfMemory as exc:
                if not self.enabled:
                    raise
                failed = exc
            except OptimizerOutOfMemory as exc:
                if not self.enabled:
                    raise
                learner.model.zero_grad(set_to_none=True)
                kept = exc.intact and learner.optimizer.steps == moved_from
                raise DoesNotFit(f"step {step + 1}'s optimizer step: AdamW's step does not fit the card beside the "
                                 f"training state, and no budget lowers it; what cuts it: "
                                 f"{', '.join(OPTIMIZER_MEMORY_SETTINGS)}", kept=kept) from None
            if learner.optimizer.steps != moved_from:  # an optimizer step of this step moved the weights
                learner.model.zero_grad(set_to_none=True)
                raise DoesNotFit(f"step {step + 1}'s update: a micro-batch of {failed.completions} completions "
                                 f"({failed.tokens} positions) after {learner.optimizer.steps - moved_from} of the "
                                 f"step's optimizer steps, where one as large had fitted (the card's free memory "
                                 f"fragmented?); nothing of the step's start is kept to redo it from", kept=False)
            self._halve(learner, failed, step, "update")
            _set_random_state(rng)  # the redo draws what a run at the smaller budget draws

    def _probe(self, learner: Learner, plan) -> Probes:
        """Before the plan's first optimizer step: the largest micro-batch of the budget, if none as large has
        run, and every micro-batch of the plan that it does not cover, forward and backward, gradients dropped,
        the random state as it was (module docstring)."""
        batching = learner.batching
        largest = largest_micro_batch(batching, self.longest_prompt, self.completion_tokens, self.group_size)
        todo = [largest] + [micro for mini in plan.mini_batches for micro in mini.micro_batches]
        probes = Probes()
        for micro in todo:
            shape = Shape.of(micro)
            if any(shape.within(fitted) for fitted in self.fitted):
                continue
            with torch.random.fork_rng(devices=_cuda_devices()):  # dropout's draws are the step's, not the probe's
                try:
                    micro_batch_backward(learner, micro)
                finally:
                    learner.model.zero_grad(set_to_none=True)
            self.fitted = [fitted for fitted in self.fitted if not fitted.within(shape)] + [shape]
            probes.count, probes.positions = probes.count + 1, probes.positions + shape.positions
        return probes

    def _halve(self, learner: Learner, failed: MicroBatchOutOfMemory, step: int, where: str) -> None:
        """The budget at half the micro-batch that failed (its partial gradients dropped, the card's cache
        emptied), said in one line; DoesNotFit when it held one completion."""
        learner.model.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        before, smaller = learner.batching, learner.batching.halved(failed.completions, failed.tokens)
        if smaller is None:
            raise DoesNotFit(f"step {step + 1}'s {where}: one completion alone ({failed.tokens} positions) does not "
                             f"fit the card; what cuts the update's memory: {', '.join(UPDATE_MEMORY_SETTINGS)}")
        learner.batching = smaller
        logger.warning("step %d: out of memory in the %s (a micro-batch of %d completions, %d positions, at %s): "
                       "redone on the same groups at %s, kept for the rest of the run; no weight had moved, no "
                       "rollout regenerated", step + 1, where, failed.completions, failed.tokens, describe(before),
                       describe(smaller))


def describe(batching) -> str:
    """The budget in force, as the config key that sets it."""
    if batching.max_tokens > 0:
        return f"train.micro_batch_tokens={batching.max_tokens}"
    return f"train.micro_batch_size={batching.max_count}"


def guard_note(enabled: bool) -> str:
    """What the guard holds and costs, said at start."""
    if not enabled:
        return "out of memory: several processes, so an out-of-memory error ends the run where it happens"
    return ("out of memory: the guard holds no host memory (no copy of the weights or AdamW's state); the largest "
            "micro-batch of each budget runs once, its gradient dropped, before a weight moves, so an out-of-memory "
            "update is redone smaller from where it began")


def _cuda_devices() -> list[int]:
    return [torch.cuda.current_device()] if torch.cuda.is_available() else []


def _random_state() -> tuple:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in _cuda_devices()]


def _set_random_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    for device, value in zip(_cuda_devices(), state[1]):
        torch.cuda.set_rng_state(value, device)
