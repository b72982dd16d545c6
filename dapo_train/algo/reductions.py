"""Loss reductions: how an objective's per-token losses become one loss (DAPO Eq. 12 and its variants),
as pure functions of tensors.

A reduction is a sum in its own units and a count of those units. The loss of a micro-batch is its
sum divided by the units of the WHOLE optimizer step (loss_normalizer, counted before the
micro-batch loop and over all ranks), so any split into micro-batches or ranks adds up to exactly
the loss and gradient of one batch. A sequence masked out entirely (overlong filtering) adds nothing
and is no unit.

- token (DAPO Eq. 12): every valid token of the step weighs the same.
- sample (GRPO, and the GSPO paper's per-sequence mean): each sequence's mean token loss, averaged
  over sequences; a long sequence's tokens weigh less.
- constant (Dr. GRPO, arXiv 2503.20783): the paper drops GRPO's 1/|o_i| and sums every token's term;
  as in its code and TRL's dr_grpo, the sum is divided by sequences x L_max (rollout.max_new_tokens),
  a denominator that no completion's length changes, so a token's weight has no length bias.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossReduction:
    """How per-token losses become a loss.

    total(token_loss (N, T), valid (N, T) bool) -> scalar: this batch's sum in the reduction's units;
    units(valid (N, T) bool, max_tokens) -> scalar: how many units the batch holds, where max_tokens
    is the completion budget L_max. The loss is total / normalizer, the normalizer being the units of
    the whole optimizer step (loss_normalizer).
    """

    total: Callable[[Tensor, Tensor], Tensor]
    units: Callable[[Tensor, int], Tensor]


# Name -> LossReduction; the names are config dapo.loss_reduction's choices (a test ties the two).
LOSS_REDUCTIONS: dict[str, LossReduction] = {}


def register_loss_reduction(name: str, units: Callable[[Tensor, int], Tensor]):
    """Decorator: `total` becomes loss reduction `name`, counted in `units(valid, max_tokens)`."""

    def add(total: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
        LOSS_REDUCTIONS[name] = LossReduction(total, units)
        return total

    return add


def _sequences(valid: Tensor) -> Tensor:
    # The sequences of the loss: those with a valid token (one masked out entirely neither adds nor counts).
    return valid.any(dim=-1).sum()


@register_loss_reduction("token", units=lambda valid, max_tokens: valid.sum())
def _token_total(token_loss: Tensor, valid: Tensor) -> Tensor:
    # Eq. 12: every valid token of the optimizer step weighs the same.
    return token_loss.sum()


@register_loss_reduction("sample", units=lambda valid, max_tokens: _sequences(valid))
def _sample_total(token_loss: Tensor, valid: Tensor) -> Tensor:
    # GRPO: mean over each sequence's valid tokens, summed; the units are the sequences of the loss.
    return (token_loss.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)).sum()


@register_loss_reduction("constant", units=lambda valid, max_tokens: _sequences(valid) * max_tokens)
def _constant_total(token_loss: Tensor, valid: Tensor) -> Tensor:
    # Dr. GRPO: the token sum, over a denominator (sequences x L_max) that no length changes.
    return token_loss.sum()


def loss_normalizer(masks: Sequence[Tensor], reduction: str, max_tokens: int | None = None) -> float:
    """The Eq. 12 denominator of a whole optimizer step: the reduction's units summed over the
    step's (N_i, T_i) masks (non-zero = valid), counted before any micro-batch is trained.
    max_tokens: the completion budget L_max (rollout.max_new_tokens) that "constant" counts per
    sequence; None = each mask's own width T_i."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_normalizer: unknown reduction {reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"loss_normalizer: max_tokens must be >= 1, got {max_tokens}")
    units = LOSS_REDUCTIONS[reduction].units
    return float(sum(float(units(mask != 0, mask.shape[-1] if max_tokens is None else max_tokens)) for mask in masks))
