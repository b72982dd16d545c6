"""Behaviour policy vs training forward, as pure maths: how far apart they are and the importance-sampling
corrections that bring the loss back to the training policy (tensors in, tensors out, like the rest of algo/).

The rollout samples its tokens from a behaviour policy pi_behav (sampling.behaviour_distribution: its
weights in their dtype, logits / T after top-k / top-p truncation); the ratio of Eq. 10 is taken
against pi_old, the float32 training forward of the weights that sampled. Where the two differ (a
bf16 copy, a compiled cache, truncation, another engine) the policy gradient is taken under the wrong
distribution; TRL and verl reweight each token by pi_old / pi_behav, truncated (TIS) or with the
outliers masked (MIS), per token or per sequence. Shapes: N completions, T completion tokens.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_train.algo.objectives import LOG_RATIO_LIMIT, masked_log_ratio
from dapo_train.plugins import decorator_for

Tensor = torch.Tensor


# A rollout correction: (log_weight (N, T) = log pi_old - log pi_behav, 0 off valid; valid (N, T) bool;
# cap > 1) -> (weight (N, T) float32 on the token losses, masked (N, T) bool: valid tokens taken out of the
# loss and its normaliser, changed (N, T) bool: valid tokens the correction truncated or masked).
RolloutCorrectionFn = Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor, Tensor]]

# Name -> correction; config dapo.rollout_correction names one (a test ties the two).
ROLLOUT_CORRECTIONS: dict[str, RolloutCorrectionFn] = {}


# Decorator: @register_rollout_correction("name") makes the function the correction `name`
# (config dapo.rollout_correction).
register_rollout_correction = decorator_for(ROLLOUT_CORRECTIONS)


@register_rollout_correction("off")
def _uncorrected(log_weight: Tensor, valid: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ones_like(log_weight), torch.zeros_like(valid), torch.zeros_like(valid)


@register_rollout_correction("tis")
def _token_truncated(log_weight: Tensor, valid: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    # Truncated importance sampling per token: min(pi_old / pi_behav, cap); exp of the capped log, so
    # no ratio overflows on the way.
    limit = math.log(cap)
    return torch.exp(log_weight.clamp(max=limit)), torch.zeros_like(valid), valid & (log_weight > limit)


@register_rollout_correction("mis")
def _token_masked(log_weight: Tensor, valid: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    # Masked importance sampling per token: a token whose weight leaves [1/cap, cap] leaves the loss.
    outside = valid & (log_weight.abs() > math.log(cap))
    return torch.ones_like(log_weight), outside, outside


def _sequence_log_weight(log_weight: Tensor) -> Tensor:
    """(N, T) token log-weights -> (N, T): each row's sum, the log of its sequence's product of ratios."""
    return log_weight.sum(dim=-1, keepdim=True).expand_as(log_weight)


@register_rollout_correction("seq-tis")
def _sequence_truncated(log_weight: Tensor, valid: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    return _token_truncated(_sequence_log_weight(log_weight), valid, cap)


@register_rollout_correction("seq-mis")
def _sequence_masked(log_weight: Tensor, valid: Tensor, cap: float) -> tuple[Tensor, Tensor, Tensor]:
    return _token_masked(_sequence_log_weight(log_weight), valid, cap)


@dataclass(frozen=True)
class RolloutCorrection:
    """Importance sampling from the behaviour policy (the distribution the rollout sampled from) to
    pi_old (the training forward of the weights that sampled), as TRL and verl correct a rollout engine
    that differs from the trainer: mode names a ROLLOUT_CORRECTIONS entry, cap > 1 bounds the weight."""

    mode: str = "off"
    cap: float = 2.0

    def __call__(self, old_logprobs: Tensor, behaviour_logprobs: Tensor, valid: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """(N, T) each -> (weight (N, T) float32, 1 off valid; masked (N, T) bool; changed (N, T) bool): see
        RolloutCorrectionFn."""
        if self.mode not in ROLLOUT_CORRECTIONS:
            allowed = ", ".join(ROLLOUT_CORRECTIONS)
            raise ValueError(f"rollout correction: unknown mode {self.mode!r}; allowed: {allowed}")
        if self.cap <= 1.0:
            raise ValueError(f"rollout correction: cap must be > 1, got {self.cap}")
        log_weight = masked_log_ratio(old_logprobs.to(torch.float32), behaviour_logprobs, valid)  # (N, T)
        weight, masked, changed = ROLLOUT_CORRECTIONS[self.mode](log_weight, valid, self.cap)
        return torch.where(valid, weight, 1.0), masked, changed


# The sums rollout_mismatch returns; the step's metrics are rollout_<name> = sum / rollout_tokens.
MISMATCH_SUMS = ("tokens", "kl", "logprob_diff", "is_weight", "is_clipped")


@torch.no_grad()
def rollout_mismatch(training_logprobs: Tensor, behaviour_logprobs: Tensor, valid: Tensor,
                     correction: RolloutCorrection) -> tuple[dict[str, Tensor], Tensor]:
    """How far the behaviour policy is from the training forward on these tokens: (N, T) each ->
    (sums over valid tokens, 0-d float32: tokens; kl, the k3 estimate of KL(behaviour || training),
    expm1(d) - d with d = training - behaviour (samples come from the behaviour policy); logprob_diff,
    |d|; is_weight, exp(d) before any truncation; is_clipped, the tokens `correction` truncates or masks
    (with mode off, those tis would truncate) -- and the largest |d|, 0-d). Log-ratios beyond
    LOG_RATIO_LIMIT are clamped, so every figure is finite."""
    diff = masked_log_ratio(training_logprobs.to(torch.float32), behaviour_logprobs, valid)  # (N, T)
    diff = diff.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    probe = correction if correction.mode != "off" else RolloutCorrection("tis", correction.cap)
    _, _, changed = probe(training_logprobs, behaviour_logprobs, valid)
    sums = {
        "tokens": valid.sum(),
        "kl": torch.where(valid, torch.expm1(diff) - diff, 0.0).sum(),
        "logprob_diff": diff.abs().sum(),
        "is_weight": torch.where(valid, torch.exp(diff), 0.0).sum(),
        "is_clipped": changed.sum(),
    }
    largest = diff.abs().max() if diff.numel() else torch.zeros(())
    return {name: value.to(torch.float32) for name, value in sums.items()}, largest.to(torch.float32)
