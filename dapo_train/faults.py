"""Out-of-memory faults for tests only: the update and the hf decode ask here before they allocate, so a CPU
test can make them fail as a card would (train/update/out_of_memory.py and rollout/engines.py redo the work smaller).

Never a config key: an environment variable a test sets, read at each call.
  DAPO_TRAIN_TEST_OOM_UPDATE_TOKENS=N  a micro-batch of more than N positions raises torch.OutOfMemoryError
  DAPO_TRAIN_TEST_OOM_DECODE_ROWS=N    a generate call of more than N rows raises it
"""

from __future__ import annotations

import os

import torch

UPDATE_TOKENS = "DAPO_TRAIN_TEST_OOM_UPDATE_TOKENS"
DECODE_ROWS = "DAPO_TRAIN_TEST_OOM_DECODE_ROWS"


def out_of_memory_above(variable: str, amount: int) -> None:
    """Raise torch.OutOfMemoryError when the test variable `variable` is set and `amount` exceeds it."""
    limit = os.environ.get(variable)
    if limit is not None and amount > int(limit):
        raise torch.OutOfMemoryError(f"{variable}={limit}: {amount} is over it (a fault injected for tests)")
