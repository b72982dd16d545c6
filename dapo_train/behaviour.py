"""Is the rollout the training forward? `dapo.old_logprobs` and `dapo.rollout_correction` resolved once,
at start, from the config and the engine (DESIGN: behaviour policy vs training policy).

The rollout samples from the training forward when it is the decode loop over the training weights
themselves (no copy in another dtype), in float32 without autocast, with no top-k / top-p truncation
and no dropout in the training forward. Then the behaviour log-probs it records are the old
log-probs to float rounding, so `auto` takes them as the old log-probs (no second pass) and corrects
nothing. Anything else (a bf16 copy, the compiled static cache, `generate`, another engine,
truncation) makes the behaviour policy differ from pi_old: `auto` recomputes the old log-probs with
the training forward and applies truncated importance sampling (mismatch.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dapo_train.config import Config
from dapo_train.mismatch import RolloutCorrection

logger = logging.getLogger(__name__)

UNKNOWN_ROLLOUT = ("the rollout engine is not known here",)


@dataclass(frozen=True)
class BehaviourPolicy:
    """How the update treats the distribution the rollout sampled from: dapo.old_logprobs and
    dapo.rollout_correction resolved, and why (`differences`: how the rollout departs from the
    training forward; empty when it is the training forward)."""

    old_from_rollout: bool = False  # the behaviour log-probs are the ratio's old log-probs (no pass)
    correction: RolloutCorrection = RolloutCorrection()
    differences: tuple[str, ...] = UNKNOWN_ROLLOUT


def rollout_differences(cfg: Config, engine, model: torch.nn.Module, cuda: bool) -> tuple[str, ...]:
    """Every way the rollout `engine` samples from something other than the training forward of `model`
    (the unwrapped training model) under `cfg`; empty when it samples from the training forward."""
    from dapo_train.modeling import dropout_fields, mixed_precision
    from dapo_train.rollout import DecodeLoopEngine

    found = []
    if not isinstance(engine, DecodeLoopEngine):
        found.append(f"rollout.engine={cfg.rollout.engine} samples with {type(engine).__name__}, not the decode loop")
    elif engine.copy is not None:
        dtype = str(next(engine.copy.parameters()).dtype).removeprefix("torch.")
        found.append(f"it samples from a {dtype} copy of the weights (rollout.dtype)")
    weights = next(model.parameters()).dtype
    if weights != torch.float32:
        found.append(f"the training weights are {str(weights).removeprefix('torch.')} (model.dtype)")
    if mixed_precision(cfg, cuda) != "no":
        found.append(f"the training forward runs under {mixed_precision(cfg, cuda)} autocast (train.mixed_precision)")
    if cfg.rollout.top_k > 0:
        found.append(f"top-k {cfg.rollout.top_k} truncation (rollout.top_k)")
    if cfg.rollout.top_p < 1.0:
        found.append(f"top-p {cfg.rollout.top_p:g} truncation (rollout.top_p)")
    if cfg.model.keep_dropout and dropout_fields(model.config):
        found.append("dropout in the training forward (model.keep_dropout)")
    if cfg.model.lora.r > 0 and cfg.model.lora.dropout > 0:
        found.append("LoRA dropout in the training forward (model.lora.dropout)")
    return tuple(found)


def resolve(cfg: Config, differences: tuple[str, ...]) -> BehaviourPolicy:
    """dapo.old_logprobs and dapo.rollout_correction with `auto` decided by `differences`."""
    same = not differences
    old = cfg.dapo.old_logprobs
    mode = cfg.dapo.rollout_correction
    if mode == "auto":
        mode = "off" if same else "tis"
    return BehaviourPolicy(old_from_rollout=same if old == "auto" else old == "rollout",
                           correction=RolloutCorrection(mode, cfg.dapo.rollout_correction_cap),
                           differences=differences)


def log_behaviour(policy: BehaviourPolicy, cfg: Config, model: torch.nn.Module) -> None:
    """Say at start what the rollout samples from, where the old log-probs come from, what corrects the
    difference, and which of these settings cannot act."""
    from dapo_train.modeling import dropout_fields

    if policy.differences:
        logger.info("rollout: the behaviour policy is not the training forward: %s", "; ".join(policy.differences))
    else:
        logger.info("rollout: the behaviour policy is the training forward (float32 decode loop over the training "
                    "weights, no truncation)")
    old = "rollout" if policy.old_from_rollout else "recompute"
    logger.info("dapo.old_logprobs=%s: %s", _chosen(cfg.dapo.old_logprobs, old), "the behaviour log-probs the "
                "rollout recorded (no second pass)" if policy.old_from_rollout else "a no-grad pass of the training "
                "forward after collection")
    correction = policy.correction
    logger.info("dapo.rollout_correction=%s%s", _chosen(cfg.dapo.rollout_correction, correction.mode),
                "" if correction.mode == "off" else f" (cap {correction.cap:g})")
    if policy.old_from_rollout and policy.differences:
        logger.warning("dapo.old_logprobs=rollout while the rollout is not the training forward: the ratio is taken "
                       "against the behaviour policy, not the float32 training forward")
    if policy.old_from_rollout and correction.mode != "off":
        logger.warning("dapo.rollout_correction=%s cannot act: with dapo.old_logprobs=rollout pi_old is the "
                       "behaviour policy, so every weight is 1; set dapo.old_logprobs=recompute", correction.mode)
    if cfg.model.keep_dropout:
        if dropout_fields(model.config):
            logger.warning("model.keep_dropout: dropout stays on in the training forwards, so the ratio is noisy "
                           "even at lr 0")
        else:
            logger.warning("model.keep_dropout cannot act: the model has no dropout")


def _chosen(setting: str, resolved: str) -> str:
    return f"auto -> {resolved}" if setting == "auto" else setting
