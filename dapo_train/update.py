"""Step 2 of every step: the policy update, as several optimizer steps (Eq. 10, 12).

A step's rollout batch (its informative groups) is cut into `train.updates_per_step` mini-batches
of whole groups, each one optimizer step; `dapo.num_iterations` passes repeat the whole set. After
the first update the policy differs from the one that sampled, so the ratio leaves 1 and the
decoupled clip (Eq. 10) acts; that is the paper's regime (16 updates per rollout batch).

Each mini-batch is cut into micro-batches (by count, or by a padded-token budget) whose gradients
accumulate. The loss normaliser is the MINI-BATCH's units (algo.loss_normalizer: valid tokens for
"token", sequences for "sample"), counted before its micro-batch loop and passed to every
micro-batch, so any micro-batch split gives exactly the gradient of one batch (Eq. 12).

Under N ranks the same holds for the whole step: the mini-batches are cut from all ranks' groups in
one global order (rank_mini_batches), each normaliser is reduced over ranks before its micro-batch
loop, every rank makes as many forward/backward calls as the rank with the most micro-batches
(padding with fillers that add nothing), and each loss is scaled by N because DDP/FSDP average the
ranks' gradients where Eq. 12 sums them; gradients are reduced in the last micro-batch only.

The ratio's denominator is the log-prob under the policy that generated the completion: each
group carries it from collection time (record_old_logprobs, a no-grad pass of the training
weights). A completion without it is on-policy by construction (its step's first and only update)
and uses its own detached log-probs, ratio exactly 1, at no extra cost. A non-finite loss or
gradient norm skips the update and ends the step's updates.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from dapo_train import distributed
from dapo_train.algo import LossSettings, loss_normalizer
from dapo_train.collect import Group
from dapo_train.config import Config
from dapo_train.logprobs import TokenBatch, collate, score_tokens, supports_shared_prefix


@dataclass
class TrainSample:
    """One completion ready for the loss. L = its valid tokens (EOS included)."""

    prompt_ids: torch.Tensor  # (P,)
    completion_ids: torch.Tensor  # (L,)
    advantage: float  # Eq. 9, broadcast over its tokens
    in_loss: bool  # False when overlong filtering masks a truncated completion
    old_logprobs: torch.Tensor | None = None  # (L,) under the generating policy; None = on-policy


def flatten_groups(groups: list[Group], overlong_filtering: bool) -> list[TrainSample]:
    return [
        TrainSample(
            c.prompt_ids, c.completion_ids, float(group.advantages[j]), not (overlong_filtering and c.truncated),
            None if group.old_logprobs is None else group.old_logprobs[j],
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


@dataclass
class MicroBatch:
    """Collated rows on the device. N rows, T = padded completion width."""

    batch: TokenBatch
    advantages: torch.Tensor  # (N,)
    old_logprobs: torch.Tensor | None  # (N, T) float32, 0 where has_old is False; None if no row has any
    has_old: torch.Tensor | None  # (N, 1) bool


def collate_micro_batch(samples: list[TrainSample], pad_id: int, device, share_prefix: bool = False) -> MicroBatch:
    """Rows -> MicroBatch; a sample out of the loss gets an all-zero mask. share_prefix: consecutive
    samples of one group share one copy of their prompt (logprobs.collate)."""
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id, share_prefix)
    in_loss = torch.tensor([s.in_loss for s in samples], dtype=torch.float32).unsqueeze(1)  # (N, 1)
    batch.completion_mask = batch.completion_mask * in_loss
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # (N,)
    old = has_old = None
    if any(s.old_logprobs is not None for s in samples):
        old = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)  # (N, T)
        for row, sample in enumerate(samples):
            if sample.old_logprobs is not None:
                old[row, : sample.old_logprobs.numel()] = sample.old_logprobs
        has_old = torch.tensor([s.old_logprobs is not None for s in samples]).unsqueeze(1).to(device)  # (N, 1)
        old = old.to(device)
    return MicroBatch(batch.to(device), advantages.to(device), old, has_old)


def loss_settings(cfg: Config) -> LossSettings:
    """The config's dapo.* loss options as the one value the loss takes."""
    d = cfg.dapo
    return LossSettings(
        eps_low=d.eps_low, eps_high=d.eps_high, reduction=d.loss_reduction, clip_ratio_c=d.clip_ratio_c, beta=d.beta
    )


@dataclass
class UpdateContext:
    """What an update needs besides the samples; `loss` is built from cfg.

    optimizer_steps counts every optimizer step of the run (the LR schedule's clock, saved in
    checkpoints); lr_at(optimizer step) -> learning rate, None to leave the optimizer's as it is.
    reference_scope() is the context ref_model scores in: with LoRA, ref_model is the policy itself
    and the scope disables its adapters."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    accelerator: object
    cfg: Config
    pad_id: int
    ref_model: torch.nn.Module | None = None
    lr_at: Callable[[int], float] | None = None
    optimizer_steps: int = 0
    reference_scope: Callable[[], AbstractContextManager] = contextlib.nullcontext
    loss: LossSettings = field(init=False)
    share_prefix: bool = field(init=False)

    def __post_init__(self) -> None:
        self.loss = loss_settings(self.cfg)
        self.share_prefix = use_shared_prefix(self.cfg, self.model)

    def score(self, model, batch: TokenBatch):
        """Per-token log-probs and entropy of batch under `model`, at the rollout temperature."""
        return score_tokens(model, batch, temperature=self.cfg.rollout.temperature,
                            chunk_mib=self.cfg.train.logprob_chunk_mib)

    def micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        t = self.cfg.train
        split = split_micro_batches(samples, t.micro_batch_size, t.micro_batch_tokens)
        return [collate_micro_batch(micro, self.pad_id, self.accelerator.device, self.share_prefix) for micro in split]

    def filler(self) -> MicroBatch:
        """A one-token row out of the loss: the forward/backward a rank with fewer micro-batches runs
        so that every rank makes the same collective calls; it adds exactly zero to the gradient."""
        pad = torch.tensor([self.pad_id])
        return collate_micro_batch([TrainSample(pad, pad, 0.0, in_loss=False)], self.pad_id, self.accelerator.device)


def use_shared_prefix(cfg: Config, model) -> bool:
    """train.shared_prefix: on / off, or auto = on when the model's attention takes a 4-D mask."""
    if cfg.train.shared_prefix == "auto":
        return supports_shared_prefix(model)
    return cfg.train.shared_prefix == "on"


def record_old_logprobs(ctx: UpdateContext, groups: list[Group], model: torch.nn.Module | None = None) -> int:
    """Give every group without them its old log-probs: a no-grad pass of the current training
    weights (float32 master weights, the forward the update runs), made while these weights are
    still the ones that generated the group. model: those weights as a plain module (under several
    ranks, distributed.full_weights: no collective op per forward); default ctx.model.
    -> completions scored."""
    todo = [group for group in groups if group.old_logprobs is None]
    if not todo:
        return 0
    model = ctx.model if model is None else model
    samples = flatten_groups(todo, overlong_filtering=False)
    model.train()  # the update's forward, not generation's
    scored: list[torch.Tensor] = []
    with torch.no_grad():
        for micro in ctx.micro_batches(samples):
            logprobs, _ = ctx.score(model, micro.batch)  # (N, T)
            for row in logprobs.float().cpu():
                scored.append(row[: samples[len(scored)].completion_ids.numel()].clone())
    rows = iter(scored)
    for group in todo:
        group.old_logprobs = [next(rows) for _ in group.completions]
    return len(scored)


def accumulate_gradients(ctx: UpdateContext, batches: list[MicroBatch], normalizer: float,
                         calls: int | None = None) -> dict:
    """Forward/backward every micro-batch; gradients accumulate in .grad. -> token-weighted metrics
    (over all ranks).

    normalizer: the mini-batch's loss units (algo.loss_normalizer) over all ranks, the same for every
    micro-batch. calls: forward/backward passes to make (the most micro-batches any rank has; this
    rank pads its own with fillers); gradients are reduced over ranks in the last one only."""
    totals: dict[str, float] = {}
    weight_sum, loss_sum = 0.0, 0.0
    calls = len(batches) if calls is None else calls
    # DDP/FSDP average the ranks' gradients; Eq. 12 wants their sum (each loss already has the global normaliser).
    scale = distributed.world_size()
    for index in range(calls):
        micro = batches[index] if index < len(batches) else ctx.filler()
        with distributed.gradient_sync(ctx.accelerator, ctx.model, sync=index == calls - 1):
            metrics = _micro_batch_backward(ctx, micro, normalizer, scale)
        loss_sum += metrics.pop("loss")
        tokens = metrics.pop("num_tokens")
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value * tokens
        weight_sum += tokens
    keys = list(totals)  # the same order on every rank: one loss function made them
    loss_sum, weight_sum, *sums = distributed.all_reduce([loss_sum, weight_sum, *(totals[key] for key in keys)])
    totals = dict(zip(keys, sums))
    out = {key: value / max(weight_sum, 1.0) for key, value in totals.items()}
    out["loss"] = loss_sum
    out["num_tokens"] = weight_sum
    return out


def _micro_batch_backward(ctx: UpdateContext, micro: MicroBatch, normalizer: float, scale: int) -> dict:
    """One micro-batch's forward and backward. -> its loss and metrics (num_tokens, entropy, clip, ...)."""
    batch = micro.batch
    logprobs, entropy = ctx.score(ctx.model, batch)
    ref_logprobs = None
    if ctx.ref_model is not None:
        with torch.no_grad(), ctx.reference_scope():
            ref_logprobs, _ = ctx.score(ctx.ref_model, batch)
    old_logprobs = logprobs.detach()  # on-policy rows: ratio exactly 1
    if micro.old_logprobs is not None:
        old_logprobs = torch.where(micro.has_old, micro.old_logprobs, old_logprobs)  # (N, T)
    loss, metrics = ctx.loss(logprobs, old_logprobs, micro.advantages, batch.completion_mask,
                             normalizer=normalizer, ref_logprobs=ref_logprobs)
    ctx.accelerator.backward(loss * scale if scale != 1 else loss)
    tokens = float(metrics["num_tokens"])
    metrics["entropy"] = float((entropy * batch.completion_mask).sum() / max(tokens, 1.0))
    metrics["loss"] = float(loss.detach())
    return metrics


def mini_batches(groups: list, updates: int) -> list[list]:
    """Whole groups cut into min(updates, len(groups)) consecutive parts whose sizes differ by at most one."""
    parts = max(1, min(updates, len(groups)))
    bounds = [len(groups) * i // parts for i in range(parts + 1)]
    return [groups[bounds[i] : bounds[i + 1]] for i in range(parts)]


def rank_mini_batches(counts: list[int], rank: int, updates: int) -> list[list[int]]:
    """This rank's share of each mini-batch of the step's global rollout batch, as local indices.

    counts: every rank's number of groups. The global batch orders them by (local index, rank) --
    rank 0's first group, rank 1's first, ..., then the second ones -- which is the order of one
    process holding them all (each rank generated batch[rank::N] of the same prompts), and is cut
    like mini_batches, so every rank makes the same optimizer steps and each mini-batch spreads over
    the ranks. One process: its groups cut by mini_batches."""
    order = [(index, process) for index in range(max(counts, default=0))
             for process, count in enumerate(counts) if index < count]
    return [[index for index, process in part if process == rank] for part in mini_batches(order, updates)]


@dataclass
class _StepMetrics:
    """A step's update metrics: token-weighted means over all its updates, plus counts and the last update's clip."""

    totals: dict[str, float] = field(default_factory=dict)
    tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    last: dict = field(default_factory=dict)

    def add(self, metrics: dict) -> None:
        tokens = metrics["num_tokens"]
        for key, value in metrics.items():
            if key != "num_tokens":
                self.totals[key] = self.totals.get(key, 0.0) + value * tokens
        self.tokens += tokens
        self.last = metrics

    def result(self, micro_batches: int, pass_tokens: float) -> dict:
        out = {key: value / max(self.tokens, 1.0) for key, value in self.totals.items()}
        out.update(
            num_tokens=pass_tokens, micro_batches=micro_batches, optimizer_steps=len(self.grad_norms),
            clip_frac_high_last=self.last.get("clip_frac_high", 0.0),
            clip_frac_low_last=self.last.get("clip_frac_low", 0.0),
            staleness_mean=sum(self.staleness) / max(1, len(self.staleness)),
            staleness_max=max(self.staleness, default=0),
        )
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return out


@dataclass
class _Part:
    """One mini-batch on this rank: its micro-batches, the Eq. 12 normaliser and the forward/backward
    calls of the whole mini-batch over all ranks, and its groups' versions."""

    batches: list[MicroBatch]
    normalizer: float
    calls: int
    versions: list[int]


def plan_mini_batches(ctx: UpdateContext, groups: list[Group]) -> tuple[list[_Part], float, float, int]:
    """This rank's groups as mini-batches of micro-batches, with every count that must be global
    reduced over ranks before any micro-batch runs. -> (parts, valid tokens of one pass, forward token
    positions of one pass, micro-batches)."""
    cfg = ctx.cfg
    local = []
    for indices in rank_mini_batches(distributed.gather(len(groups)), distributed.rank(), cfg.train.updates_per_step):
        part = [groups[index] for index in indices]
        batches = ctx.micro_batches(flatten_groups(part, cfg.dapo.overlong_filtering))
        normalizer = loss_normalizer([micro.batch.completion_mask for micro in batches], ctx.loss.reduction)
        local.append((batches, normalizer, [group.version for group in part]))
    pass_tokens = sum(float(micro.batch.completion_mask.sum()) for batches, _, _ in local for micro in batches)
    forward_tokens = sum(micro.batch.forward_tokens for batches, _, _ in local for micro in batches)
    micro_count = sum(len(batches) for batches, _, _ in local)
    *normalizers, pass_tokens, forward_tokens, micro_count = distributed.all_reduce(
        [normalizer for _, normalizer, _ in local] + [pass_tokens, forward_tokens, micro_count]
    )
    calls = distributed.all_reduce([len(batches) for batches, _, _ in local], op="max")
    parts = [_Part(batches, normalizer, int(call), versions)
             for (batches, _, versions), normalizer, call in zip(local, normalizers, calls)]
    return parts, pass_tokens, forward_tokens, int(micro_count)


def policy_update(ctx: UpdateContext, groups: list[Group]) -> dict:
    """Every optimizer step of one rollout batch: num_iterations passes over its mini-batches.
    -> metrics (token-weighted over all updates; optimizer_steps, clip_frac_*_last, staleness_*).
    Under N ranks every rank calls it (with its own groups, possibly none) and makes the same updates."""
    cfg = ctx.cfg
    parts, pass_tokens, forward_tokens, micro_count = plan_mini_batches(ctx, groups)
    ctx.model.train()
    step = _StepMetrics()
    result = {"skipped_nonfinite": 0, "update_forward_tokens": int(forward_tokens) * cfg.dapo.num_iterations}
    max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
    for _ in range(cfg.dapo.num_iterations):
        for part in parts:
            if ctx.lr_at is not None:
                result["lr"] = ctx.lr_at(ctx.optimizer_steps)
                for param_group in ctx.optimizer.param_groups:
                    param_group["lr"] = result["lr"]
            metrics = accumulate_gradients(ctx, part.batches, part.normalizer, part.calls)
            grad_norm = float(ctx.accelerator.clip_grad_norm_(ctx.model.parameters(), max_norm))
            if not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)):
                ctx.optimizer.zero_grad(set_to_none=True)
                result.update(skipped_nonfinite=1, loss=metrics["loss"], grad_norm=grad_norm)
                return {**step.result(micro_count, pass_tokens), **result}
            ctx.optimizer.step()
            ctx.optimizer.zero_grad(set_to_none=True)
            step.staleness += [ctx.optimizer_steps - version for version in part.versions]
            step.grad_norms.append(grad_norm)
            step.add(metrics)
            ctx.optimizer_steps += 1
    step.staleness = [value for ranks in distributed.gather(step.staleness) for value in ranks]
    return {**step.result(micro_count, pass_tokens), **result}
