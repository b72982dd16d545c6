"""Step 2 of every optimizer step: the policy update with exact token-level accumulation (Eq. 10, 12).

The step's groups are flattened into completions and cut into micro-batches (by count, or by a
padded-token budget). The loss normaliser is counted over the WHOLE step before the micro-batch
loop, in the loss reduction's own units (algo.loss_normalizer: valid tokens for "token",
sequences for "sample"), and passed to every micro-batch, so k micro-batches give exactly the
gradient of one batch. The loss options travel as one algo.LossSettings built from the config.
A non-finite loss or gradient norm skips the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dapo_train.algo import LossSettings, loss_normalizer
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
        TrainSample(
            c.prompt_ids, c.completion_ids, float(group.advantages[j]), not (overlong_filtering and c.truncated)
        )
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


MicroBatch = tuple[TokenBatch, torch.Tensor]  # collated rows, advantages (N,)


def collate_micro_batch(samples: list[TrainSample], pad_id: int, device) -> MicroBatch:
    """Rows -> (TokenBatch on device, advantages (N,)); a sample out of the loss gets an all-zero mask."""
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id)
    in_loss = torch.tensor([s.in_loss for s in samples], dtype=torch.float32).unsqueeze(1)  # (N, 1)
    batch.completion_mask = batch.completion_mask * in_loss
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # (N,)
    return batch.to(device), advantages.to(device)


def loss_settings(cfg: Config) -> LossSettings:
    """The config's dapo.* loss options as the one value the loss takes."""
    d = cfg.dapo
    return LossSettings(
        eps_low=d.eps_low, eps_high=d.eps_high, reduction=d.loss_reduction, clip_ratio_c=d.clip_ratio_c, beta=d.beta
    )


@dataclass
class UpdateContext:
    """What an update needs besides the samples; `loss` is built from cfg."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accelerator: object
    cfg: Config
    pad_id: int
    ref_model: torch.nn.Module | None = None
    loss: LossSettings = field(init=False)

    def __post_init__(self) -> None:
        self.loss = loss_settings(self.cfg)

    def score(self, model, batch: TokenBatch, with_entropy: bool = False):
        """Per-token log-probs (and entropy) of batch under `model`, at the rollout temperature."""
        return score_tokens(model, batch, temperature=self.cfg.rollout.temperature,
                            chunk_size=self.cfg.train.logprob_chunk_size, with_entropy=with_entropy)


def _old_logprobs(ctx: UpdateContext, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """Log-probs under the policy before any update of this step (num_iterations > 1)."""
    with torch.no_grad():
        return [ctx.score(ctx.model, batch)[0] for batch, _ in batches]


def accumulate_gradients(ctx: UpdateContext, batches: list[MicroBatch], normalizer: float,
                         old: list[torch.Tensor] | None) -> dict:
    """Forward/backward every micro-batch; gradients accumulate in .grad. -> token-weighted metrics.

    normalizer: the whole step's loss units (algo.loss_normalizer), the same for every micro-batch."""
    totals: dict[str, float] = {}
    weight_sum, loss_sum = 0.0, 0.0
    for i, (batch, advantages) in enumerate(batches):
        logprobs, entropy = ctx.score(ctx.model, batch, with_entropy=True)
        ref_logprobs = None
        if ctx.ref_model is not None:
            with torch.no_grad():
                ref_logprobs, _ = ctx.score(ctx.ref_model, batch)
        old_logprobs = old[i] if old is not None else logprobs.detach()
        loss, metrics = ctx.loss(logprobs, old_logprobs, advantages, batch.completion_mask,
                                 normalizer=normalizer, ref_logprobs=ref_logprobs)
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
    split = split_micro_batches(samples, cfg.train.micro_batch_size, cfg.train.micro_batch_tokens)
    batches = [collate_micro_batch(micro, ctx.pad_id, ctx.accelerator.device) for micro in split]
    normalizer = loss_normalizer([batch.completion_mask for batch, _ in batches], ctx.loss.reduction)
    ctx.model.train()
    old = _old_logprobs(ctx, batches) if cfg.dapo.num_iterations > 1 else None
    metrics: dict = {"micro_batches": len(batches), "skipped_nonfinite": 0}
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    for _ in range(cfg.dapo.num_iterations):
        metrics.update(accumulate_gradients(ctx, batches, normalizer, old))
        grad_norm = float(ctx.accelerator.clip_grad_norm_(ctx.model.parameters(), max_norm))
        metrics["grad_norm"] = grad_norm
        if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
            ctx.optimizer.zero_grad(set_to_none=True)
            metrics["skipped_nonfinite"] = 1
            return metrics
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
    return metrics
