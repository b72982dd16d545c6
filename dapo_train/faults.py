"""Out-of-memory faults for tests only: each stage of a step asks here where a card would raise, so a CPU test
can make it fail as a card would (train/update/out_of_memory.py, rollout/fitting.py and rewards/model.py redo the
work smaller; train/loop.py ends the run at its last good step where nothing can be redone).

Never a config key: an environment variable a test sets, read at each call.
  DAPO_TRAIN_TEST_OOM_UPDATE_TOKENS=N      a micro-batch of more than N positions raises torch.OutOfMemoryError
                                           before its forward
  DAPO_TRAIN_TEST_OOM_BACKWARD_TOKENS=N    the same, inside autograd's backward (partial gradients left behind)
  DAPO_TRAIN_TEST_OOM_OLD_LOGPROB_TOKENS=N the old-log-prob pass's micro-batch of more than N positions
  DAPO_TRAIN_TEST_OOM_OPTIMIZER_STEP=N     the run's optimizer step number N (0-based), before it moves a weight
  DAPO_TRAIN_TEST_OOM_SYNC_STEP=N          the rollout engine's weight sync after step N
  DAPO_TRAIN_TEST_OOM_DECODE_ROWS=N        a generate call of more than N rows
  DAPO_TRAIN_TEST_OOM_REWARD_ROWS=N        a reward model's scoring batch of more than N texts
"""

from __future__ import annotations

import contextlib
import os

import torch

UPDATE_TOKENS = "DAPO_TRAIN_TEST_OOM_UPDATE_TOKENS"
BACKWARD_TOKENS = "DAPO_TRAIN_TEST_OOM_BACKWARD_TOKENS"
OLD_LOGPROB_TOKENS = "DAPO_TRAIN_TEST_OOM_OLD_LOGPROB_TOKENS"
OPTIMIZER_STEP = "DAPO_TRAIN_TEST_OOM_OPTIMIZER_STEP"
SYNC_STEP = "DAPO_TRAIN_TEST_OOM_SYNC_STEP"
DECODE_ROWS = "DAPO_TRAIN_TEST_OOM_DECODE_ROWS"
REWARD_ROWS = "DAPO_TRAIN_TEST_OOM_REWARD_ROWS"


def out_of_memory_above(variable: str, amount: int) -> None:
    """Raise torch.OutOfMemoryError when the test variable `variable` is set and `amount` exceeds it."""
    limit = os.environ.get(variable)
    if limit is not None and amount > int(limit):
        raise torch.OutOfMemoryError(f"{variable}={limit}: {amount} is over it (a fault injected for tests)")


def out_of_memory_at(variable: str, count: int) -> None:
    """Raise torch.OutOfMemoryError when the test variable `variable` is set to `count`."""
    at = os.environ.get(variable)
    if at is not None and count == int(at):
        raise torch.OutOfMemoryError(f"{variable}={at} (a fault injected for tests)")


@contextlib.contextmanager
def out_of_memory_in_backward(variable: str, amount: int, model: torch.nn.Module):
    """While a forward of `model` runs in this context: when the test variable `variable` is set and `amount`
    exceeds it, the backward raises torch.OutOfMemoryError at the gradient of the forward's first output that
    requires one (the embeddings', or with LoRA the first adapted layer's), about the last the backward reaches,
    so the layers after it have left their weights' gradients by then."""
    limit = os.environ.get(variable)
    if limit is None or amount <= int(limit):
        yield
        return
    attached = []

    def fail(grad):
        raise torch.OutOfMemoryError(f"{variable}={limit}: {amount} is over it, in the backward (a fault injected "
                                     "for tests)")

    def attach(module, inputs, output):
        output = output[0] if isinstance(output, tuple) and output else output
        if not attached and isinstance(output, torch.Tensor) and output.requires_grad:
            attached.append(output.register_hook(fail))

    handles = [module.register_forward_hook(attach) for module in model.modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
