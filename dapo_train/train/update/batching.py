"""Completions laid out for a forward: samples, micro-batches, mini-batches, and the plan of a step's
update that ranks.py agrees across ranks and passes.py runs.

A step's rollout batch (its informative groups) is cut into `train.updates_per_step` mini-batches
of whole groups, each one optimizer step (mini_batches); each mini-batch into micro-batches, by
count or by a token budget, whose gradients accumulate (split_micro_batches); shared-prefix rows
pack several groups back to back, rows no wider than the budget allows (layout.collate). Scoring reads
logits / the rollout temperature, the distribution the rollout sampled from (Scorer).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields, replace

import torch

from dapo_train.algo.correction import RolloutCorrection
from dapo_train.config.schema import Config
from dapo_train.model.layout import TokenBatch, collate, row_limit
from dapo_train.model.scoring import score_tokens, supports_shared_prefix
from dapo_train.train.records import Group

NO_CORRECTION = RolloutCorrection("off")
logger = logging.getLogger(__name__)


@dataclass
class TrainSample:
    """One completion ready for the loss. L = its valid tokens (EOS included)."""

    prompt_ids: torch.Tensor  # (P,)
    completion_ids: torch.Tensor  # (L,)
    advantage: float  # Eq. 9, broadcast over its tokens
    in_loss: bool  # False when overlong filtering masks a truncated completion
    old_logprobs: torch.Tensor | None = None  # (L,) training forward of the generating policy; None = not recorded
    # (L,) the rollout's log-probs before top-k / top-p truncation (Completion.untruncated_logprobs); None: none
    behaviour_logprobs: torch.Tensor | None = None
    version: int = 0  # optimizer steps before it was generated
    policy_mask: torch.Tensor | None = None  # (L,) bool, False on tool turns (Completion.policy_mask); None: all True


def flatten_groups(groups: list[Group], overlong_filtering: bool) -> list[TrainSample]:
    return [
        TrainSample(
            c.prompt_ids, c.completion_ids, float(group.advantages[j]), not (overlong_filtering and c.truncated),
            None if group.old_logprobs is None else group.old_logprobs[j], c.untruncated_logprobs, group.version,
            c.policy_mask,
        )
        for group in groups
        for j, c in enumerate(group.completions)
    ]


def split_micro_batches(samples: list[TrainSample], max_count: int, max_tokens: int = 0,
                        share_prefix: bool = False) -> list[list[TrainSample]]:
    """Consecutive micro-batches, in order. max_tokens = 0: at most max_count samples each. max_tokens > 0
    (the budget wins, max_count is not used): the fewest micro-batches whose tokens (micro_batch_tokens,
    in rows of at most layout.row_limit(max_tokens)) stay within the budget, cut so that the largest
    holds as few tokens as it can, so the micro-batches of a mini-batch carry similar tokens. A sample
    over the budget alone gets a micro-batch of its own (with a warning, once)."""
    if max_tokens <= 0:
        return [samples[i : i + max_count] for i in range(0, len(samples), max_count)]
    row_tokens = row_limit(max_tokens)
    if any(micro_batch_tokens([sample], share_prefix) > max_tokens for sample in samples):
        _warn_over_budget(max_tokens)
    fewest = len(_cut(samples, max_tokens, share_prefix, row_tokens))
    low, high = 1, max_tokens  # the smallest cap that still needs no more micro-batches than `fewest`
    while low < high:
        middle = (low + high) // 2
        if len(_cut(samples, middle, share_prefix, row_tokens)) <= fewest:
            high = middle
        else:
            low = middle + 1
    return _cut(samples, low, share_prefix, row_tokens)


@dataclass(frozen=True)
class _Count:
    """A micro-batch as the forward lays it out, kept running sample by sample: with shared prefixes its
    rows filled in order, the current row's tokens and the widest row's; without, the widest prompt and
    completion. `tokens`: rows x width, the positions the forward computes, padding included."""

    rows: int = 0
    row: int = 0
    widest: int = 0
    prompt: int = 0
    completion: int = 0

    @property
    def tokens(self) -> int:
        return self.rows * (self.widest or self.prompt + self.completion)


def _grown(count: _Count, sample: TrainSample, same_run: bool, share_prefix: bool, row_tokens: int) -> _Count:
    """count with `sample` added. Shared prefix: rows filled in order up to row_tokens (0: one row), a
    run's prompt once per row it reaches (repeated when it is cut between rows), a sample wider alone;
    layout.shared_rows lays the same samples out in as many rows, no wider, so the forward computes at
    most these tokens. Otherwise one padded row per sample, rows x (widest prompt + widest completion)."""
    p, c = int(sample.prompt_ids.numel()), int(sample.completion_ids.numel())
    if not share_prefix:
        return _Count(count.rows + 1, 0, 0, max(count.prompt, p), max(count.completion, c, 1))
    wide = row_tokens or math.inf
    if count.rows and count.row + c + (0 if same_run else p) <= wide:
        row, rows = count.row + c + (0 if same_run else p), count.rows
    else:
        row, rows = p + c, count.rows + 1
    return replace(count, rows=rows, row=row, widest=max(count.widest, row))


def micro_batch_tokens(samples: list[TrainSample], share_prefix: bool, row_tokens: int = 0) -> int:
    """What train.micro_batch_tokens counts for these samples: the positions their forward computes, at
    most (rows x width, padding included). share_prefix: packed rows of at most row_tokens, each run's
    prompt once per row (0: a single row, each prompt once); otherwise rows x (widest prompt + widest
    completion), the padded layout."""
    count = _Count()
    for i, sample in enumerate(samples):
        count = _grown(count, sample, bool(i) and _same_prompt(samples[i - 1], sample), share_prefix, row_tokens)
    return count.tokens


def _cut(samples: list[TrainSample], cap: int, share_prefix: bool, row_tokens: int) -> list[list[TrainSample]]:
    """Greedy consecutive cut: each part grows while its tokens (micro_batch_tokens, kept running) stay
    within cap; a lone sample always fits."""
    parts: list[list[TrainSample]] = []
    count = _Count()
    for i, sample in enumerate(samples):
        grown = _grown(count, sample, bool(parts) and _same_prompt(samples[i - 1], sample), share_prefix, row_tokens)
        if parts and grown.tokens <= cap:
            parts[-1].append(sample)
            count = grown
        else:
            parts.append([sample])
            count = _grown(_Count(), sample, False, share_prefix, row_tokens)
    return parts


def _same_prompt(a: TrainSample, b: TrainSample) -> bool:
    return a.prompt_ids is b.prompt_ids or torch.equal(a.prompt_ids, b.prompt_ids)


_warned_over_budget: list[int] = []


def _warn_over_budget(budget: int) -> None:
    if not _warned_over_budget:
        _warned_over_budget.append(budget)
        logger.warning("a sequence is longer than train.micro_batch_tokens=%d: it gets a micro-batch of its own "
                       "(its memory is not bounded by the budget)", budget)


class MicroBatchOutOfMemory(Exception):
    """torch.OutOfMemoryError in a micro-batch's move to the device, forward or backward (or the old-log-prob
    pass's forward), with that micro-batch's size: its completions and the positions its forward computes
    (train/update/out_of_memory.py halves the budget from them)."""

    def __init__(self, completions: int, tokens: int) -> None:
        super().__init__(f"out of memory in a micro-batch of {completions} completion(s), {tokens} positions")
        self.completions, self.tokens = completions, tokens


@dataclass
class MicroBatch:
    """Collated rows, on the CPU until the micro-batch runs (`to`). N rows, T = padded completion width.
    batch.completion_mask is the loss mask: overlong filtering and the rollout correction's masked tokens (mis)
    are already out."""

    batch: TokenBatch
    advantages: torch.Tensor  # (N,)
    old_logprobs: torch.Tensor | None  # (N, T) float32, 0 where has_old is False; None if no row has any
    has_old: torch.Tensor | None  # (N, 1) bool
    behaviour_logprobs: torch.Tensor | None = None  # (N, T) float32 before truncation, 0 off behaviour_mask; or None
    behaviour_mask: torch.Tensor | None = None  # (N, T) bool: tokens with a behaviour log-prob
    versions: torch.Tensor | None = None  # (N,) long, on the CPU: optimizer steps before each row was generated
    correction_weight: torch.Tensor | None = None  # (N, T) float32 on the token losses; None = 1 (no correction)

    def to(self, device: torch.device) -> MicroBatch:
        """On `device`, but the versions (read on the CPU, without a device sync)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if f.name != "versions" and getattr(self, f.name) is not None}
        return replace(self, **moved)


def _per_token(values: list[torch.Tensor | None], shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per-row (L_i,) values (or None) -> ((N, T) float32, 0 where absent; (N, T) bool where present), or
    None when no row has any."""
    if all(value is None for value in values):
        return None
    out = torch.zeros(shape, dtype=torch.float32)
    present = torch.zeros(shape, dtype=torch.bool)
    for row, value in enumerate(values):
        if value is not None:
            out[row, : value.numel()], present[row, : value.numel()] = value, True
    return out, present


def collate_micro_batch(samples: list[TrainSample], pad_id: int, share_prefix: bool = False,
                        correction: RolloutCorrection = NO_CORRECTION, max_tokens: int = 0) -> MicroBatch:
    """Rows -> MicroBatch; a sample out of the loss gets an all-zero mask, a tool turn's tokens are out of
    every mask (collate: the loss, the head, the behaviour log-probs' use). share_prefix: consecutive
    samples of one group share one copy of their prompt (layout.collate), in rows no wider than
    layout.row_limit(max_tokens), the token budget's. correction: the rollout correction, applied now to
    the tokens that have both old and behaviour log-probs (weights for tis, the loss mask for mis), so the
    Eq. 12 normaliser counted from the masks is the loss's."""
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id, share_prefix,
                    row_limit(max_tokens), [s.policy_mask for s in samples])
    in_loss = torch.tensor([s.in_loss for s in samples], dtype=torch.float32).unsqueeze(1)  # (N, 1)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)  # (N,)
    shape = batch.completion_ids.shape
    old = _per_token([s.old_logprobs for s in samples], shape)
    behaviour = _per_token([s.behaviour_logprobs for s in samples], shape)
    if behaviour is not None:
        behaviour = behaviour[0], behaviour[1] & batch.valid_mask  # a tool turn's tokens have none
    weight = None
    if old is not None and behaviour is not None and correction.mode != NO_CORRECTION.mode:
        weight, masked, _ = correction(old[0], behaviour[0], old[1] & behaviour[1])  # (N, T) each
        batch.completion_mask = batch.completion_mask * ~masked
    batch.completion_mask = batch.completion_mask * in_loss
    has_old = None if old is None else torch.tensor([s.old_logprobs is not None for s in samples]).unsqueeze(1)
    return MicroBatch(
        batch, advantages, None if old is None else old[0], has_old,
        behaviour_logprobs=None if behaviour is None else behaviour[0],
        behaviour_mask=None if behaviour is None else behaviour[1],
        versions=torch.tensor([s.version for s in samples], dtype=torch.long),
        correction_weight=weight,
    )


def use_shared_prefix(cfg: Config, model) -> bool:
    """train.shared_prefix: on / off, or auto = on when the model's attention takes a 4-D mask."""
    if cfg.train.shared_prefix == "auto":
        return supports_shared_prefix(model)
    return cfg.train.shared_prefix == "on"


@dataclass(frozen=True)
class Batching:
    """How samples become micro-batches (train.micro_batch_size / micro_batch_tokens, train.shared_prefix),
    collated on the CPU and run on `device`."""

    pad_id: int
    device: torch.device
    share_prefix: bool
    max_count: int
    max_tokens: int = 0
    correction: RolloutCorrection = NO_CORRECTION  # dapo.rollout_correction resolved

    @classmethod
    def from_config(cls, cfg: Config, model, pad_id: int, device, correction: RolloutCorrection = NO_CORRECTION,
                    micro_batch_tokens: int | None = None) -> Batching:
        """micro_batch_tokens: the budget train.micro_batch_tokens=auto resolved to; None = the config's
        number (auto, unresolved: 0, micro_batch_size)."""
        t = cfg.train
        tokens = micro_batch_tokens if micro_batch_tokens is not None else \
            t.micro_batch_tokens if isinstance(t.micro_batch_tokens, int) else 0
        return cls(pad_id, device, use_shared_prefix(cfg, model), t.micro_batch_size, tokens, correction)

    def halved(self, completions: int, tokens: int) -> Batching | None:
        """After out of memory in a micro-batch of `completions` completions and `tokens` positions: half of
        it as the budget (train.micro_batch_tokens; without one, micro_batch_size), which cuts that
        micro-batch in two or more; None when it held one completion, which nothing splits."""
        if completions <= 1:
            return None
        if self.max_tokens > 0:
            return replace(self, max_tokens=max(1, min(self.max_tokens, tokens) // 2))
        return replace(self, max_count=max(1, min(self.max_count, completions) // 2))

    def micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        split = split_micro_batches(samples, self.max_count, self.max_tokens, self.share_prefix)
        return [collate_micro_batch(micro, self.pad_id, self.share_prefix, self.correction,
                                    self.max_tokens) for micro in split]

    def filler(self) -> MicroBatch:
        """A one-token row out of the loss: the forward/backward a rank with fewer micro-batches runs
        so that every rank makes the same collective calls; it adds exactly zero to the gradient."""
        pad = torch.tensor([self.pad_id])
        return collate_micro_batch([TrainSample(pad, pad, 0.0, in_loss=False)], self.pad_id)


@dataclass(frozen=True)
class Scorer:
    """Per-token log-probs and entropy of a TokenBatch under a model, from logits / the rollout
    temperature (rollout.temperature) through the LM head in chunks (train.logprob_chunk_mib)."""

    temperature: float
    chunk_mib: float

    def __call__(self, model, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logprobs (N, T) float32, differentiable; entropy (N, T) float32, detached)."""
        return score_tokens(model, batch, temperature=self.temperature, chunk_mib=self.chunk_mib)


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
class MiniBatch:
    """One optimizer step's share on this rank: its micro-batches, the Eq. 12 normaliser of the whole
    mini-batch over all ranks, the forward/backward calls every rank makes for it (this rank pads
    its own micro-batches with fillers), the versions of its groups (for staleness), and whose its
    rows are, in micro-batch order: ((rank that holds the group, its index in that rank's step
    batch), index of the completion in it); ranks.balance_groups may deal a group to another rank.)"""

    micro_batches: list[MicroBatch]
    normalizer: float
    calls: int
    versions: list[int]
    rows: list[tuple[tuple[int, int], int]] = field(default_factory=list)


@dataclass
class UpdatePlan:
    """A step's updates on this rank, agreed across ranks before the first micro-batch runs (ranks.py).

    passes: dapo.num_iterations (each pass makes every mini-batch's optimizer step); loss_scale:
    the number of ranks (DDP/FSDP average the ranks' gradients, Eq. 12 wants their sum); the totals
    are over all ranks and one pass: the loss's tokens, the positions the forward computes, of which
    padding, and the positions the LM head scores (TokenBatch)."""

    mini_batches: list[MiniBatch]
    passes: int
    loss_scale: int
    valid_tokens: float
    forward_tokens: float
    micro_batch_count: int
    padding_tokens: float
    head_tokens: float
