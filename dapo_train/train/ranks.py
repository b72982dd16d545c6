"""What crosses ranks in one step, agreed in one place: when the batch is full (Eq. 11), which
buffered groups the step trains, the update plan (mini-batches, Eq. 12 normalisers, forward/backward
calls, token totals) and, after the update, its metric sums and the step's sampled rollout records; at
start, the least free card memory auto's budget is sized by.
collect/rounds.py and update/passes.py work on this rank's groups and records alone and make no collective call of
their own: they ask this module; with one process every function here is arithmetic on this
process's own counts.

Under N ranks (`accelerate launch`, `torchrun`; distributed.py holds the primitives):
- each generation round, every rank generates its slice of the same prompts, and the batch is full
  when the groups buffered on ALL ranks reach prompts_per_step, so every rank runs the same rounds
  (of the same sizes: the keep rate is a total over ranks), and with dapo.skip_history every rank
  learns every prompt's outcome, so all skip the same prompts;
- the step's groups are dealt from the ranks' buffers in turn (take_counts), so the ranks' shares
  differ as little as their buffers allow, and the generation stats are merged over ranks;
- the mini-batches are cut from all ranks' groups in one global order (batching.rank_mini_batches),
  so every rank makes the same optimizer steps; each mini-batch's groups are then dealt over the ranks
  by their tokens (balance_groups: a group may be trained on another rank than the one that generated
  it, and its per-completion stats come back, trained_rows), so the ranks carry similar tokens; each
  mini-batch's Eq. 12 normaliser is summed over ranks before its first micro-batch; every rank makes
  as many forward/backward calls as the rank with the most micro-batches (padding with fillers that
  add nothing), and each loss is scaled by N because DDP/FSDP average the ranks' gradients where
  Eq. 12 sums them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from dapo_train.algo.reductions import loss_normalizer
from dapo_train.config.schema import Config
from dapo_train.train import distributed
from dapo_train.train.records import StepBatch, UpdateResult, UpdateSums
from dapo_train.train.update.batching import (
    Batching,
    MiniBatch,
    UpdatePlan,
    flatten_groups,
    micro_batch_tokens,
    rank_mini_batches,
)


def buffered_groups(count: int) -> int:
    """The groups buffered on all ranks, from this rank's `count`: every rank sees the same total, so
    every rank runs the same generation rounds."""
    return int(distributed.all_reduce([count])[0])


def own_share(prompts: list) -> list:
    """This rank's slice of a round's prompts (every rank draws the same ones): batch[rank::N]."""
    return prompts[distributed.rank() :: distributed.world_size()]


@dataclass
class Deal:
    """Which buffered groups each rank trains this step (take_counts), with what every rank had
    buffered and its generation stats, in rank order; `own` is this rank's take."""

    takes: list[int]
    counts: list[int]
    stats: list
    own: int


def deal_groups(count: int, stats, wanted: int) -> Deal:
    """Every rank's buffered count and stats, and the step's `wanted` groups dealt over them."""
    gathered = distributed.gather((count, stats))
    counts = [rank_count for rank_count, _ in gathered]
    takes = take_counts(counts, wanted)
    return Deal(takes, counts, [rank_stats for _, rank_stats in gathered], takes[distributed.rank()])


def take_counts(counts: list[int], wanted: int) -> list[int]:
    """How many of its buffered groups each rank trains this step, given every rank's count: `wanted`
    in all (every buffered group if there are fewer), dealt one per rank in turn so the ranks' shares
    differ as little as their buffers allow. One process: [min(count, wanted)]."""
    takes = [0] * len(counts)
    remaining = min(wanted, sum(counts))
    while remaining:
        for process, count in enumerate(counts):
            if remaining and takes[process] < count:
                takes[process] += 1
                remaining -= 1
    return takes


def plan_update(batch: StepBatch, batching: Batching, cfg: Config) -> UpdatePlan:
    """The step's mini-batches of micro-batches on this rank, with every count that must be global
    summed over ranks before any micro-batch runs. Each mini-batch's groups are first dealt over the
    ranks by their tokens (balance_groups), so the ranks carry similar tokens."""
    local = []
    for indices in rank_mini_batches(batch.takes, distributed.rank(), cfg.train.updates_per_step):
        part = [batch.groups[index] for index in indices]
        own = [flatten_groups([group], cfg.dapo.overlong_filtering) for group in part]
        trained = balance_groups(list(zip(indices, own, (group.version for group in part))), batching.share_prefix)
        micro = batching.micro_batches([sample for _, samples, _ in trained for sample in samples])
        normalizer = loss_normalizer([m.batch.completion_mask for m in micro], cfg.dapo.loss_reduction,
                                     cfg.rollout.max_new_tokens)
        rows = [(key, j) for key, samples, _ in trained for j in range(len(samples))]
        local.append(MiniBatch(micro, normalizer, len(micro), [version for _, _, version in trained], rows))
    batches = [m.batch for mini in local for m in mini.micro_batches]
    totals = [sum(float(b.completion_mask.sum()) for b in batches), sum(b.forward_tokens for b in batches),
              len(batches), sum(b.padding_tokens for b in batches), sum(b.head_tokens for b in batches)]
    *normalizers, valid_tokens, forward_tokens, count, padding_tokens, head_tokens = distributed.all_reduce(
        [mini.normalizer for mini in local] + totals
    )
    calls = distributed.all_reduce([mini.calls for mini in local], op="max")
    mini_batches = [replace(mini, normalizer=normalizer, calls=int(call))
                    for mini, normalizer, call in zip(local, normalizers, calls)]
    return UpdatePlan(mini_batches, cfg.dapo.num_iterations, distributed.world_size(), valid_tokens,
                      forward_tokens, int(count), padding_tokens, head_tokens)


def balanced_owners(tokens: list[list[int]]) -> list[list[int]]:
    """tokens[r][i]: the tokens of rank r's i-th group of a mini-batch -> the rank that trains each group
    (the same shape): the largest first, each to the rank with the fewest tokens so far (a tie keeps a
    group where it is), so the ranks carry similar tokens (within about the largest group). One rank
    keeps all of its own."""
    load = [0] * len(tokens)
    owners = [[rank] * len(row) for rank, row in enumerate(tokens)]
    for count, rank, index in sorted((-count, rank, index) for rank, row in enumerate(tokens)
                                     for index, count in enumerate(row)):
        owner = min(range(len(tokens)), key=lambda other: (load[other], other != rank, other))
        owners[rank][index] = owner
        load[owner] -= count
    return owners


def balance_groups(groups: list[tuple[int, list, int]], share_prefix: bool) -> list[tuple[tuple[int, int], list, int]]:
    """This rank's groups of one mini-batch, (index in its step batch, samples, version) each -> the groups
    this rank trains, ((rank that holds it, its index there), samples, version) each, dealt over the ranks
    by balanced_owners; a group trained elsewhere travels there (its samples are small). In the order
    of one process holding them all, as rank_mini_batches orders them. One process: its own groups."""
    tokens = distributed.gather([micro_batch_tokens(samples, share_prefix) for _, samples, _ in groups])
    owners, me = balanced_owners(tokens), distributed.rank()
    moving = any(owner != rank for rank, row in enumerate(owners) for owner in row)
    leaving = {position: group for position, group in enumerate(groups) if owners[me][position] != me}
    arrived = distributed.gather(leaving) if moving else [{}] * len(owners)
    held = [dict(enumerate(groups)) if rank == me else arrived[rank] for rank in range(len(owners))]
    order = [(position, rank) for position in range(max(map(len, owners), default=0))
             for rank in range(len(owners)) if position < len(owners[rank])]
    return [((rank, held[rank][position][0]), *held[rank][position][1:]) for position, rank in order
            if owners[rank][position] == me]


def trained_rows(plan: UpdatePlan, applied: list[UpdateSums]) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """(index of the group in this rank's step batch, index of the completion) -> its (mean ratio, clipped
    share) in each applied optimizer step that trained it, on whichever rank trained it."""
    seen: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for step in applied:
        for ((rank, index), j), values in zip(plan.mini_batches[step.mini_batch].rows, step.rows):
            seen[(rank, index, j)].append(values)
    me = distributed.rank()
    merged = {key: values for rows in distributed.gather(dict(seen)) for key, values in rows.items()}
    return {(index, j): values for (rank, index, j), values in merged.items() if rank == me}


def round_outcomes(outcomes: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
    """A round's (prompt uid, side: None when kept) outcomes from every rank, in the round's order (each rank held
    live[rank::N]): the prompt history (dapo.skip_history) learns the same on every rank."""
    return distributed.interleave(distributed.gather(outcomes))


def gather_rollouts(sampled: list) -> list[list]:
    """Every rank's sampled groups of the step (rollout_sample.SampledGroup: plain records), in rank
    order, for the main process to merge and write: one file per step holds every rank's groups once."""
    return distributed.gather(sampled)


def least_free_memory(free_bytes: int) -> int:
    """The least free memory of any rank's card, from this rank's: train.micro_batch_tokens=auto sizes every
    rank's budget (the same on all) by it (update/card.py)."""
    return int(-distributed.all_reduce([-free_bytes], op="max")[0])


def total(count: float) -> float:
    """A count summed over ranks (e.g. the completions whose old log-probs were scored)."""
    return distributed.all_reduce([count])[0]


def reduce_update(result: UpdateResult) -> UpdateResult:
    """A step's optimizer-step sums over all ranks (every rank made the same optimizer steps, the
    failing one included, with the same keys): sums and counts added, maxima the largest; and their
    groups' staleness from every rank."""
    steps = result.applied + ([result.failed] if result.failed is not None else [])
    flat = distributed.all_reduce([value for step in steps for part in (step.sums, step.counts)
                                   for value in part.values()])
    largest = distributed.all_reduce([value for step in steps for value in step.maxima.values()], op="max")
    reduced, start, at = [], 0, 0
    for step in steps:
        sums = dict(zip(step.sums, flat[start : start + len(step.sums)]))
        start += len(step.sums)
        counts = dict(zip(step.counts, flat[start : start + len(step.counts)]))
        start += len(step.counts)
        maxima = dict(zip(step.maxima, largest[at : at + len(step.maxima)]))
        at += len(step.maxima)
        reduced.append(replace(step, sums=sums, counts=counts, maxima=maxima))
    staleness = [value for ranks in distributed.gather(result.staleness) for value in ranks]
    if result.failed is not None:
        return UpdateResult(reduced[:-1], reduced[-1], staleness, result.scaler_skips)
    return UpdateResult(reduced, None, staleness, result.scaler_skips)
