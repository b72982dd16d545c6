"""The policy objectives (the registry of dapo.policy_loss) and `policy_loss`, which turns one of them
and a loss reduction into the scalar loss of a micro-batch: Eq. 10's decoupled clip (`clip`), GSPO's
sequence ratio, CISPO's clipped weight, an optional k3 KL term to a reference.

Pure functions of tensors: no model, tokenizer, config object or I/O. Shapes: N completions, T
completion tokens. Choices made on purpose:
- Loss maths runs in float32 whatever the input dtype; gradients flow back in the input dtype.
- Positions where the mask is 0 never reach the result: their log-ratio is replaced by 0 before
  exp(), so garbage (even inf/NaN) in padded old/ref log-probs cannot make the loss or gradient NaN.
- Clip fractions are fractions of all valid tokens, so clip_frac = clip_frac_high + clip_frac_low.
- Per completion (per_row=True): each row's mean token ratio and clipped share, for the rollout
  records (run/rollouts.py), fetched in the same device sync as the step's metrics.
"""


from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_train.algo.reductions import LOSS_REDUCTIONS
from dapo_train.plugins import decorator_for

Tensor = torch.Tensor

# ---------------------------------------------------------------- policy loss (Eq. 10, 12)


def _check_loss_args(logprobs, old_logprobs, advantages, mask, objective, reduction, clip_ratio_c, ref_logprobs,
                     beta, token_weight) -> None:
    if objective not in POLICY_LOSSES:
        raise ValueError(f"policy_loss: unknown objective {objective!r}; allowed: {', '.join(POLICY_LOSSES)}")
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"policy_loss: unknown reduction {reduction!r}; allowed: {', '.join(LOSS_REDUCTIONS)}")
    if logprobs.dim() != 2:
        raise ValueError(f"policy_loss: logprobs must be (N, T), got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                         ("token_weight", token_weight)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"policy_loss: {name} shape {tuple(tensor.shape)} != logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(f"policy_loss: advantages must be (N,) or (N, T), got shape {tuple(advantages.shape)}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"policy_loss: clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")
    if beta < 0.0 or (beta > 0.0 and ref_logprobs is None):
        raise ValueError(f"policy_loss: beta must be >= 0 and needs ref_logprobs when > 0, got beta={beta}")


# ---------------------------------------------------------------- policy objectives (a registry)


@dataclass(frozen=True)
class LossSettings:
    """The policy-loss options of a run as one value (built from config dapo.* by train/update/objective.py): the
    objective by name (POLICY_LOSSES), its clip bounds, the reduction and the KL coefficient, so a new
    option is one field here instead of one more argument at every call site."""

    objective: str = "clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    reduction: str = "token"
    clip_ratio_c: float | None = None
    beta: float = 0.0

    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                 normalizer: float | Tensor | None = None, ref_logprobs: Tensor | None = None,
                 token_weight: Tensor | None = None, per_row: bool = False) -> tuple[Tensor, dict]:
        """policy_loss with these settings."""
        return policy_loss(
            logprobs, old_logprobs, advantages, mask, self.eps_low, self.eps_high, objective=self.objective,
            reduction=self.reduction, normalizer=normalizer, clip_ratio_c=self.clip_ratio_c,
            ref_logprobs=ref_logprobs, beta=self.beta, token_weight=token_weight, per_row=per_row,
        )


# An objective: (logprobs (N, T) float32 with grad, old_logprobs (N, T), advantages (N, T) float32,
# 0 off the mask, valid (N, T) bool, settings) -> (token_loss (N, T), its metrics: name -> 0-d tensor
# over valid tokens; and optionally, under CLIPPED_TOKENS, the (N, T) bool tokens its clip acted on).
# What it puts off the mask never counts: policy_loss zeroes those positions.
PolicyObjective = Callable[[Tensor, Tensor, Tensor, Tensor, LossSettings], tuple[Tensor, dict[str, Tensor]]]

# The objective metrics' key of its (N, T) bool clipped tokens: policy_loss takes it out of the metrics and,
# with per_row=True, reports each completion's share of them (row_clip_frac).
CLIPPED_TOKENS = "clipped_tokens"

# Name -> objective; config dapo.policy_loss names one. Any module (a test, a plugin) may add its own.
POLICY_LOSSES: dict[str, PolicyObjective] = {}


# Decorator: @register_policy_loss("name") makes the function the objective `name` (config dapo.policy_loss).
register_policy_loss = decorator_for(POLICY_LOSSES)


def masked_log_ratio(logprobs: Tensor, old_logprobs: Tensor, valid: Tensor) -> Tensor:
    """log r = logprobs - old_logprobs on valid tokens, 0 elsewhere, (N, T) float32: garbage (even
    inf/NaN) in padded old log-probs never reaches exp() or a gradient."""
    return torch.where(valid, logprobs - old_logprobs.to(torch.float32), 0.0)


# |log r| beyond this is clamped before exp(), as verl does: e^20 ~ 4.9e8 is finite in float32, while an
# unclamped log-ratio of 25 on an A < 0 token makes a loss of 7e10 and one past 88 overflows to inf.
LOG_RATIO_LIMIT = 20.0


# verl's bound on the per-token k3 KL term (its low_var_kl): a reference far from the policy adds at most this.
KL_TERM_LIMIT = 10.0


def clamp_log_ratio(logprobs: Tensor, old_logprobs: Tensor, valid: Tensor) -> Tensor:
    """The old log-probs (N, T) float32 the objective sees beside `logprobs` itself: where |logprobs -
    old_logprobs| exceeds LOG_RATIO_LIMIT on a valid token, old_logprobs is logprobs minus the clamped
    log-ratio, so logprobs - old_logprobs is the limit and carries no gradient (torch.clamp's value and
    gradient of the ratio), while logprobs keeps its own: the clamp bounds the ratio, not log pi
    (CISPO's -sg(w) A log pi keeps its gradient there, as in verl and TRL). Every other position is the
    caller's exactly, so any objective that forms exp(logprobs - old_logprobs) gets a finite ratio
    without knowing about the clamp."""
    log_ratio = masked_log_ratio(logprobs.detach(), old_logprobs, valid)  # (N, T)
    outside = log_ratio.abs() > LOG_RATIO_LIMIT
    limited = logprobs - log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # (N, T): d(logprobs - it) = 0
    return torch.where(outside, limited, old_logprobs.to(torch.float32))


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, valid: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref), exp(d) - d - 1 with d = ref - logprobs, (N, T) >= 0, 0 off
    valid; clamped as verl clamps it (d to +-LOG_RATIO_LIMIT, the term to KL_TERM_LIMIT: beyond them a
    token's term is the bound and carries no gradient), so a reference far from the policy cannot make
    the loss inf. Not multiplied by the ratio pi / pi_old: it is the k3 value at the sampled tokens."""
    ref_delta = torch.where(valid, ref_logprobs.to(torch.float32) - logprobs, 0.0)  # (N, T)
    ref_delta = ref_delta.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(ref_delta) - ref_delta - 1.0).clamp(max=KL_TERM_LIMIT)


@register_policy_loss("clip")
def clipped_objective(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, valid: Tensor,
                      settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Eq. 10 per token, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with clip_ratio_c the dual
    clip (Ye et al. 2020, as in verl) bounds an A < 0 token's loss by -A * clip_ratio_c, so a huge
    ratio on a bad token cannot dominate. Clip fractions are of all valid tokens, so
    clip_frac = clip_frac_high + clip_frac_low."""
    ratio = torch.exp(masked_log_ratio(logprobs, old_logprobs, valid))  # (N, T)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high)
    token_loss = torch.maximum(unclipped, clipped)  # = -min(r A, clip(r) A)
    if settings.clip_ratio_c is not None:
        bound = -advantages * settings.clip_ratio_c
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, bound), token_loss)
    high = (ratio > 1.0 + settings.eps_high) & (advantages > 0)
    low = (ratio < 1.0 - settings.eps_low) & (advantages < 0)
    return token_loss, _clip_fractions(high, low, valid)


@register_policy_loss("gspo")
def sequence_objective(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, valid: Tensor,
                       settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv 2507.18071): one ratio per completion, the geometric mean of its token ratios,
    s_i = exp(mean over its valid tokens of (logprobs - old_logprobs)), clipped to
    [1 - eps_low, 1 + eps_high] (the paper: 3e-4 and 4e-4, config dapo.gspo_eps_low / _high).

    Per token, in the paper's GSPO-token form: s_i,t = sg(s_i) * pi(y_t) / sg(pi(y_t)) has the value
    s_i and the gradient s_i * grad log pi(y_t), and loss_t = -min(s_i,t A_t, clip(s_i,t) A_t). With
    one advantage per completion the "sample" reduction gives exactly the paper's sequence objective
    (mean over completions of -min(s_i A_i, clip(s_i) A_i)) and its gradient; "token" weighs each
    completion by its length. A completion's ratio needs all its tokens: micro-batches hold whole
    completions. Clip fractions count tokens (every token shares its completion's clip), as the
    paper counts clipped tokens."""
    log_ratio = masked_log_ratio(logprobs, old_logprobs, valid)  # (N, T)
    sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / valid.sum(dim=-1, keepdim=True).clamp(min=1)  # (N, 1)
    sequence_ratio = torch.exp(sequence_log_ratio).detach()  # (N, 1) sg(s_i)
    ratio = sequence_ratio * torch.exp(torch.where(valid, logprobs - logprobs.detach(), 0.0))  # (N, T) = s_i
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high)
    high = (sequence_ratio > 1.0 + settings.eps_high) & (advantages > 0)  # (N, T)
    low = (sequence_ratio < 1.0 - settings.eps_low) & (advantages < 0)
    return torch.maximum(unclipped, clipped), _clip_fractions(high, low, valid)


@register_policy_loss("cispo")
def clipped_weight_objective(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, valid: Tensor,
                             settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (arXiv 2506.13585, MiniMax-M1): REINFORCE with a clipped, detached importance weight,
    loss_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logprobs_t. Unlike Eq. 10, a clipped
    token keeps its gradient (bounded by the weight); only its size is capped. The paper sets no
    lower bound (eps_low = 1: a floor of 0) and tunes the upper one (config dapo.cispo_eps_high; the
    default 4, a cap of 5, is TRL's recommended epsilon_high = 5 for CISPO, from ScaleRL). Clip
    fractions count the valid tokens whose weight the clip changed, whatever their advantage."""
    ratio = torch.exp(masked_log_ratio(logprobs, old_logprobs, valid)).detach()  # (N, T)
    weight = ratio.clamp(1.0 - settings.eps_low, 1.0 + settings.eps_high)
    token_loss = -weight * advantages * torch.where(valid, logprobs, 0.0)  # (N, T)
    return token_loss, _clip_fractions(ratio > 1.0 + settings.eps_high, ratio < 1.0 - settings.eps_low, valid)


@torch.no_grad()
def _clip_fractions(high: Tensor, low: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The shares of valid tokens clipped from above and below, (N, T) bools in; a token is never
    both, so clip_frac = clip_frac_high + clip_frac_low. CLIPPED_TOKENS: the clipped tokens themselves."""
    return {
        "clip_frac_high": _masked_mean(high.to(torch.float32), valid),
        "clip_frac_low": _masked_mean(low.to(torch.float32), valid),
        "clip_frac": _masked_mean((high | low).to(torch.float32), valid),
        CLIPPED_TOKENS: high | low,
    }


def _masked_mean(values: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, values, 0.0).sum() / valid.sum().clamp(min=1)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    *,
    objective: str = "clip",
    reduction: str = "token",
    normalizer: float | Tensor | None = None,
    clip_ratio_c: float | None = None,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
    token_weight: Tensor | None = None,
    per_row: bool = False,
) -> tuple[Tensor, dict]:
    """The DAPO policy loss: an objective's per-token loss (by default the decoupled clip, Eq. 10)
    reduced over tokens (Eq. 12).

    Per valid token, with r = exp(logprobs - old_logprobs), the "clip" objective is
        loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)   (+ beta * k3 KL)
    Shapes: logprobs, old_logprobs, mask, ref_logprobs (N, T); advantages (N,) (broadcast over
    tokens) or (N, T). mask may be bool, int or float; non-zero = valid token.

    objective: a name in POLICY_LOSSES (config dapo.policy_loss): "clip" (Eq. 10), "gspo" (the
      sequence ratio, clipped), "cispo" (a clipped, detached weight on log pi), or a plugin's.
    eps_low, eps_high: the objective's clip bounds (config dapo.eps_low / eps_high for clip,
      dapo.gspo_eps_* for gspo, dapo.cispo_eps_* for cispo).
    reduction (registry LOSS_REDUCTIONS in reductions.py, config dapo.loss_reduction):
      "token":  sum of token losses / normalizer; normalizer defaults to this call's valid-token
                count. Pass the whole optimizer step's count so k micro-batches add up to exactly
                the gradient of one batch (Eq. 12).
      "sample": GRPO's per-sequence mean, summed and divided by normalizer (default: this call's
                sequences with a valid token; pass the step's count when accumulating). For ablations.
      "constant": Dr. GRPO's token sum over sequences x L_max (default: this call's sequences with
                a valid token x its width T; pass loss_normalizer(..., max_tokens=L_max)).
    normalizer: the step's units from loss_normalizer; None = this call's own.
    clip_ratio_c: dual clip for A < 0 tokens ("clip" objective); must be > 1.
    beta > 0: adds beta * (exp(ref - logp) - (ref - logp) - 1) per token (k3 estimator of KL to
        the reference, clamped as verl does: k3_kl), not multiplied by the ratio. DAPO itself uses beta = 0.
    token_weight: (N, T) detached weights on the objective's token losses (not on the KL term), e.g.
        the rollout correction's truncated importance weights (rollout_correction); None = 1.
    per_row: also each completion's own figures over its valid tokens, as lists of N floats
        (NaN for a row without valid tokens): row_ratio_mean (its mean ratio) and row_clip_frac (the
        share of its tokens the objective clipped; NaN throughout for an objective that reports no
        CLIPPED_TOKENS). Cheap: elementwise on tensors the loss has, and the same device sync.
    Every objective sees log-ratios clamped to +-LOG_RATIO_LIMIT (clamp_log_ratio), and logprobs
    with their gradient everywhere.

    Returns (loss: float32 scalar, metrics: plain floats over valid tokens, 0.0 when there are
    none): num_tokens, the objective's own (the built-in ones: clip_frac_high (for "clip": r > 1 +
    eps_high and A > 0), clip_frac_low (r < 1 - eps_low and A < 0), clip_frac), approx_kl (mean
    old - new), ratio_mean,
    and kl when ref_logprobs is given; with per_row, the two lists. An all-masked call gives loss 0
    and zero gradient.
    """
    _check_loss_args(logprobs, old_logprobs, advantages, mask, objective, reduction, clip_ratio_c, ref_logprobs,
                     beta, token_weight)
    settings = LossSettings(objective, eps_low, eps_high, reduction, clip_ratio_c, beta)
    valid = mask != 0  # (N, T) bool
    logprobs = logprobs.to(torch.float32)
    advantages = advantages.to(torch.float32)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)  # (N, T)
    advantages = torch.where(valid, advantages, 0.0)  # (N, T); padding values never reach a gradient
    clamped_old = clamp_log_ratio(logprobs, old_logprobs, valid)  # (N, T)
    token_loss, objective_metrics = POLICY_LOSSES[objective](logprobs, clamped_old, advantages, valid, settings)
    clipped = objective_metrics.pop(CLIPPED_TOKENS, None)  # (N, T) bool, or None
    if token_weight is not None:
        token_loss = token_loss * torch.where(valid, token_weight.detach().to(torch.float32), 1.0)
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs, valid)  # (N, T)
        if beta > 0.0:
            token_loss = token_loss + beta * kl
    token_loss = torch.where(valid, token_loss, 0.0)  # (N, T)

    reduction_fns = LOSS_REDUCTIONS[reduction]
    normalizer = float(reduction_fns.units(valid, valid.shape[-1])) if normalizer is None else float(normalizer)
    if normalizer < 0 or (normalizer == 0 and bool(valid.any())):
        raise ValueError(f"policy_loss: normalizer must be > 0 (0 only for an all-masked call), got {normalizer}")
    loss = reduction_fns.total(token_loss, valid) / (normalizer if normalizer > 0 else 1.0)  # all-masked: 0 / 1
    log_ratio = masked_log_ratio(logprobs.detach(), clamped_old.detach(), valid)  # (N, T)
    rows = _row_metrics(log_ratio, valid, clipped) if per_row else {}
    return loss, _loss_metrics(log_ratio, valid, objective_metrics, kl, rows)


@torch.no_grad()
def _row_metrics(log_ratio: Tensor, valid: Tensor, clipped: Tensor | None) -> dict[str, Tensor]:
    """Each row's mean ratio and clipped share over its valid tokens, (N,) each; NaN for a row without
    valid tokens, and for every row's clipped share when the objective reported no clipped tokens."""
    counts = valid.sum(dim=-1).to(torch.float32)  # (N,)
    empty = torch.where(counts > 0, 0.0, float("nan"))  # (N,): NaN marks a row without valid tokens
    ratio = torch.where(valid, torch.exp(log_ratio), 0.0).sum(dim=-1) / counts.clamp(min=1) + empty
    if clipped is None:
        share = torch.full_like(counts, float("nan"))
    else:
        share = (clipped & valid).sum(dim=-1).to(torch.float32) / counts.clamp(min=1) + empty
    return {"row_ratio_mean": ratio, "row_clip_frac": share}


@torch.no_grad()
def _loss_metrics(log_ratio: Tensor, valid: Tensor, objective_metrics: dict[str, Tensor],
                  kl: Tensor | None, rows: dict[str, Tensor]) -> dict:
    """Diagnostics over valid tokens, as plain floats, and the per-row lists of `rows`, fetched with
    one device sync."""
    values = {
        "num_tokens": valid.sum().to(torch.float32),
        **objective_metrics,
        "approx_kl": _masked_mean(-log_ratio, valid),
        "ratio_mean": _masked_mean(torch.exp(log_ratio), valid),
    }
    if kl is not None:
        values["kl"] = _masked_mean(kl, valid)
    scalars = torch.stack([v.detach().to(torch.float32) for v in values.values()])
    fetched = torch.cat([scalars, *(row.to(scalars) for row in rows.values())]).tolist()
    out: dict = dict(zip(values, fetched[: len(values)]))
    width = valid.shape[0]
    for index, name in enumerate(rows):
        start = len(values) + index * width
        out[name] = fetched[start : start + width]
    return out
