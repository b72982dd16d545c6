"""train.deterministic: torch's deterministic algorithms, with what they refuse or need on CUDA, at start.

- On CUDA torch has no deterministic cumulative sum of floats (torch.use_deterministic_algorithms lists
  torch.cumsum among the ops that then raise), and top-p sampling takes one over the sorted probabilities
  (transformers' TopPLogitsWarper, vLLM's sampler and vllm_processor.py): a run with rollout.top_p < 1 would
  raise at its first rollout, so it is refused here, in one line, before anything loads.
- cuBLAS is deterministic only with a fixed workspace, which CUBLAS_WORKSPACE_CONFIG sets (torch asks for it in
  deterministic mode on older versions): set to :4096:8 when unset, before the first CUDA matmul.
"""

from __future__ import annotations

import logging
import os

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError

logger = logging.getLogger(__name__)

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"  # torch's documented choice: 8 buffers of 4 MiB (:16:8 is slower and smaller)


def use_deterministic(cfg: Config, cuda: bool) -> None:
    """Turn torch's deterministic algorithms on for train.deterministic (module docstring); ConfigError for
    top-p sampling on CUDA."""
    if not cfg.train.deterministic:
        return
    if cuda and cfg.rollout.top_p < 1.0:
        raise ConfigError("train.deterministic", f"true with rollout.top_p={cfg.rollout.top_p:g} on CUDA: top-p "
                          "sampling takes a cumulative sum of floats, which torch cannot compute deterministically "
                          "on CUDA (it raises at the first rollout); set rollout.top_p=1 or train.deterministic=false")
    if cuda and CUBLAS_ENV not in os.environ:
        os.environ[CUBLAS_ENV] = CUBLAS_WORKSPACE
        logger.info("train.deterministic: %s=%s, the fixed cuBLAS workspace its deterministic matmuls need (it was "
                    "unset)", CUBLAS_ENV, CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
