"""Step 2 of every optimizer step: the policy update with exact token-level accumulation (Eq. 10, 12).

The step's groups are flattened into completions and cut into micro-batches (by count, or by a
padded-token budget). The loss normaliser is counted over the WHOLE step before the micro-batch
loop (valid tokens for reduction "token", sequences for "sample") and passed to every
micro-batch, so k micro-batches give exactly the gradient of one batch; verl's default token-mean
and the seed trainer's per-group mean do not. A non-finite loss or gradient norm skips the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dapo_train.algo import policy_loss
from dapo_train.collect import Group
from dapo_train.config import Config
from dapo_train.logprobs import TokenBatch, collate, score_tokens


@dataclass
class TrainSample:
    """One completion ready for the loss. L = its valid tokens (EOS included)."""

    prompt_ids: torch.Tensor  # (P,)
    completion_ids: torch.Tensor  # (L,)
    advantage: float  # Eq. 9, broadcast over its tokens
    in_loss: bool  # False when overlong filtering masks a truncated completion


def flatten_groups(groups: list[Group], overlong_filtering: bool) -> list[TrainSample]:
    return [
        TrainSample(c.prompt_ids, c.completion_ids, float(group.advantages[j]), not (overlong_filtering and c.truncated))
        for group in groups
        for j, c in enumerate(group.completions)
    ]


def split_micro_batches(samples: list[TrainSample], max_count: int, max_tokens: int = 0) -> list[list[TrainSample]]:
    """Consecutive micro-batches of at most max_count samples and, if max_tokens > 0, at most
    max_tokens padded tokens (rows x widest prompt+completion); a single sample always fits."""
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    widest = 0
    for sample in samples:
        width = int(sample.prompt_ids.numel() + sample.completion_ids.numel())
        new_widest = max(widest, width)
        too_many = len(current) >= max_count
        too_wide = max_tokens > 0 and current and new_widest * (len(current) + 1) > max_tokens
        if current and (too_many or too_wide):
            batches.append(current)
            current, new_widest = [], width
        current.append(sample)
        widest = new_widest
    if current:
        batches.append(current)
    return batches


def step_normalizer(samples: list[TrainSample], reduction: str) -> float:
    """Eq. 12 denominator for the whole step: valid tokens ("token") or sequences ("sample")."""
    if reduction == "token":
        return float(sum(s.completion_ids.numel() for s in samples if s.in_loss))
    return float(sum(1 for s in samples if s.in_loss))


def _collate(samples: list[TrainSample], pad_id: int, device) -> tuple[TokenBatch, torch.Tensor]:
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id)
    in_loss = torch.tensor([s.in_loss for s in samples], dtype=torch.float32).unsqueeze(1)  # (N, 1)
    batch.completion_mask = batch.completion_mask * in_loss
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # (N,)
    return batch.to(device), advantages.to(device)


@dataclass
class UpdateContext:
    """What an update needs besides the samples."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accelerator: object
    cfg: Config
    pad_id: int
    ref_model: torch.nn.Module | None = None


def _old_logprobs(ctx: UpdateContext, micro_batches: list[list[TrainSample]]) -> list[torch.Tensor]:
    """Log-probs under the policy before any update of this step (num_iterations > 1)."""
    device = ctx.accelerator.device
    out = []
    with torch.no_grad():
        for micro in micro_batches:
            batch, _ = _collate(micro, ctx.pad_id, device)
            logprobs, _ = score_tokens(ctx.model, batch, temperature=ctx.cfg.rollout.temperature, chunk_size=ctx.cfg.train.logprob_chunk_size)
            out.append(logprobs)
    return out


def accumulate_gradients(ctx: UpdateContext, micro_batches: list[list[TrainSample]], normalizer: float, old: list[torch.Tensor] | None) -> dict:
    """Forward/backward every micro-batch; gradients accumulate in .grad. -> token-weighted metrics."""
    cfg, device = ctx.cfg, ctx.accelerator.device
    totals: dict[str, float] = {}
    weight_sum, loss_sum = 0.0, 0.0
    for i, micro in enumerate(micro_batches):
        batch, advantages = _collate(micro, ctx.pad_id, device)
        logprobs, entropy = score_tokens(
            ctx.model, batch, temperature=cfg.rollout.temperature, chunk_size=cfg.train.logprob_chunk_size, with_entropy=True
        )
        ref_logprobs = None
        if ctx.ref_model is not None:
            with torch.no_grad():
                ref_logprobs, _ = score_tokens(ctx.ref_model, batch, temperature=cfg.rollout.temperature, chunk_size=cfg.train.logprob_chunk_size)
        loss, metrics = policy_loss(
            logprobs,
            old[i] if old is not None else logprobs.detach(),
            advantages,
            batch.completion_mask,
            cfg.dapo.eps_low,
            cfg.dapo.eps_high,
            reduction=cfg.dapo.loss_reduction,
            normalizer=normalizer,
            clip_ratio_c=cfg.dapo.clip_ratio_c,
            ref_logprobs=ref_logprobs,
            beta=cfg.dapo.beta,
        )
        ctx.accelerator.backward(loss)
        loss_sum += float(loss.detach())
        tokens = float(metrics["num_tokens"])
        metrics["entropy"] = float((entropy * batch.completion_mask).sum() / max(tokens, 1.0))
        for key, value in metrics.items():
            if key != "num_tokens":
                totals[key] = totals.get(key, 0.0) + value * tokens
        weight_sum += tokens
    out = {key: value / max(weight_sum, 1.0) for key, value in totals.items()}
    out["loss"] = loss_sum
    out["num_tokens"] = weight_sum
    return out


def policy_update(ctx: UpdateContext, groups: list[Group]) -> dict:
    """All optimizer passes of one step (num_iterations of them). -> metrics incl. grad_norm."""
    cfg = ctx.cfg
    samples = flatten_groups(groups, cfg.dapo.overlong_filtering)
    micro_batches = split_micro_batches(samples, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens)
    normalizer = step_normalizer(samples, cfg.dapo.loss_reduction)
    ctx.model.train()
    old = _old_logprobs(ctx, micro_batches) if cfg.dapo.num_iterations > 1 else None
    metrics: dict = {"micro_batches": len(micro_batches), "skipped_nonfinite": 0}
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    for _ in range(cfg.dapo.num_iterations):
        metrics.update(accumulate_gradients(ctx, micro_batches, normalizer, old))
        grad_norm = float(ctx.accelerator.clip_grad_norm_(ctx.model.parameters(), max_norm))
        metrics["grad_norm"] = grad_norm
        if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
            ctx.optimizer.zero_grad(set_to_none=True)
            metrics["skipped_nonfinite"] = 1
            return metrics
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
    return metrics
