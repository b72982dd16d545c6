"""Step 3 of every step: the policy update, as several optimizer steps (Eq. 10, 12).

The step's plan (ranks.py) cuts its rollout batch into `train.updates_per_step` mini-batches of whole
groups, each one optimizer step, and `dapo.num_iterations` passes repeat the whole set. After the
first update the policy differs from the one that sampled, so the ratio leaves 1 and the policy
objective's clip acts; that is the paper's regime (16 updates per rollout batch).

Each mini-batch's micro-batches accumulate gradients. The loss normaliser is the MINI-BATCH's units
(algo.loss_normalizer: valid tokens for "token", sequences for "sample", sequences x L_max for
"constant"), counted before its micro-batch loop and passed to every micro-batch, so any
micro-batch split gives exactly the gradient of one batch (Eq. 12). Micro-batches hold whole
completions, so a sequence-level objective (GSPO) sees every token of each completion at once.

The ratio's denominator is the log-prob under the policy that generated the completion (each group
carries it from old_policy.py), or with dapo.old_logprobs=rollout the behaviour log-prob the
rollout recorded. A completion without either is on-policy by construction (its step's first and
only update) and uses its own detached log-probs, ratio exactly 1, at no extra cost. The rollout
correction's weights and masks (algo/correction.py) were set when the plan was made; each update also
measures the rollout mismatch where the training forward at the sampling weights is known. A
non-finite loss or gradient norm skips that optimizer step and ends the step's updates. Each trained
group is left its completions' mean ratio and clipped share (records.TrainedStats, for the rollout
records), from the loss's own per-row figures: no extra forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from dapo_train.algo.correction import MISMATCH_SUMS, rollout_mismatch
from dapo_train.algo.objectives import LossSettings
from dapo_train.config.schema import Config
from dapo_train.faults import BACKWARD_TOKENS, UPDATE_TOKENS, out_of_memory_above, out_of_memory_in_backward
from dapo_train.train import distributed, ranks
from dapo_train.train.records import Group, StepBatch, TrainedStats, UpdateResult, UpdateSums
from dapo_train.train.update.batching import (
    Batching,
    MicroBatch,
    MicroBatchOutOfMemory,
    MiniBatch,
    Scorer,
    UpdatePlan,
)
from dapo_train.train.update.objective import loss_settings
from dapo_train.train.update.old_policy import UNKNOWN_ROLLOUT, BehaviourPolicy, resolve
from dapo_train.train.update.optim import PolicyOptimizer

if TYPE_CHECKING:
    from accelerate import Accelerator


@dataclass
class Reference:
    """The frozen reference policy of dapo.beta > 0 and the context it scores in (with LoRA it is the
    policy itself, and `scope` disables its adapters)."""

    model: torch.nn.Module
    scope: Callable[[], AbstractContextManager]


@dataclass
class Learner:
    """What the update trains and how: the model as accelerate prepared it, its optimizer, the loss,
    how completions become micro-batches and are scored, the reference policy (dapo.beta > 0), and how
    the behaviour policy enters (old_policy.py: old log-probs, rollout correction)."""

    model: torch.nn.Module
    optimizer: PolicyOptimizer
    accelerator: Accelerator
    loss: LossSettings
    batching: Batching
    scorer: Scorer
    reference: Reference | None = None
    behaviour: BehaviourPolicy = BehaviourPolicy()

    @classmethod
    def build(cls, cfg: Config, model: torch.nn.Module, optimizer: torch.optim.Optimizer, accelerator, pad_id: int,
              reference: Reference | None = None, optimizer_steps: int = 0,
              behaviour: BehaviourPolicy | None = None, micro_batch_tokens: int | None = None) -> Learner:
        """The learner of `cfg` for a prepared model and optimizer (on the accelerator's device).
        behaviour: resolved for the run's engine (session.setup); None = as for an engine not known to
        be the training forward. micro_batch_tokens: the budget train.micro_batch_tokens=auto resolved to
        (train/update/card.py); None = the config's number."""
        behaviour = behaviour or resolve(cfg, UNKNOWN_ROLLOUT)
        batching = Batching.from_config(cfg, model, pad_id, accelerator.device, behaviour.correction,
                                        micro_batch_tokens)
        return cls(
            model=model, optimizer=PolicyOptimizer(optimizer, cfg, optimizer_steps), accelerator=accelerator,
            loss=loss_settings(cfg), batching=batching, scorer=Scorer(cfg.rollout.temperature,
                                                                      cfg.train.logprob_chunk_mib),
            reference=reference, behaviour=behaviour,
        )


def update(learner: Learner, batch: StepBatch, cfg: Config) -> dict:
    """Step 3: the plan every rank agrees on (ranks.py), the optimizer steps, and their metrics over
    all ranks."""
    return update_with_plan(learner, batch, ranks.plan_update(batch, learner.batching, cfg))


def update_with_plan(learner: Learner, batch: StepBatch, plan: UpdatePlan) -> dict:
    """Step 3 on its plan (ranks.plan_update of `batch`): the optimizer steps, and their metrics over all ranks."""
    result = update_policy(learner, plan)
    leave_trained_stats(batch.groups, plan, result.applied)
    return update_metrics(ranks.reduce_update(result), plan)


def leave_trained_stats(groups: list[Group], plan: UpdatePlan, applied: list[UpdateSums]) -> None:
    """Each group of this rank's batch gets its TrainedStats: per completion, the mean over the applied
    optimizer steps that trained it (one per pass, on whichever rank) of its mean ratio and of its
    clipped share."""
    seen = ranks.trained_rows(plan, applied)
    for index, group in enumerate(groups):
        per_completion = [seen.get((index, j), []) for j in range(len(group.completions))]
        group.trained = TrainedStats([_finite_mean(v[0] for v in values) for values in per_completion],
                                     [_finite_mean(v[1] for v in values) for values in per_completion],
                                     applied=any(per_completion))


def _finite_mean(values) -> float | None:
    finite = [value for value in values if math.isfinite(value)]
    return sum(finite) / len(finite) if finite else None


def update_policy(learner: Learner, plan: UpdatePlan) -> UpdateResult:
    """Every optimizer step of one rollout batch: plan.passes passes over its mini-batches, each the
    accumulated gradient of its micro-batches and one optimizer step. -> this rank's sums per
    optimizer step (plan.reduce_update sums them over ranks; update_metrics reads them). A step fp16's
    loss scaler skipped is counted and passed over; a non-finite one ends the step's updates."""
    learner.model.train()
    result = UpdateResult()
    for index in range(plan.passes):
        for position, mini in enumerate(plan.mini_batches):
            sums = accumulate_gradients(learner, mini, plan.loss_scale, first_pass=index == 0)
            staleness = [learner.optimizer.steps - version for version in mini.versions]
            step = learner.optimizer.step(learner.model, learner.accelerator, sums.sums["loss"])
            record = replace(sums, grad_norm=step.grad_norm, lr=step.lr, mini_batch=position)
            if step.scaler_skipped:  # fp16 overflow: the weights did not move, the next mini-batch goes on
                result.scaler_skips += 1
                continue
            if not step.applied:
                result.failed = record
                return result
            result.applied.append(record)
            result.staleness += staleness
    return result


def accumulate_gradients(learner: Learner, mini: MiniBatch, loss_scale: int = 1, first_pass: bool = True
                         ) -> UpdateSums:
    """Forward/backward every micro-batch of `mini`; gradients accumulate in .grad, reduced over ranks
    in the last of its `calls` passes (this rank pads its own micro-batches with fillers).
    -> this rank's sums: loss, num_tokens and every loss metric times its micro-batch's tokens; the
    rollout mismatch's counts and largest |diff| (first_pass: the rows' recorded old log-probs are
    measured in the first pass over the batch only, so each row counts once); each row's mean ratio
    and clipped share, in mini.rows order. Out of memory in a micro-batch raises MicroBatchOutOfMemory."""
    totals: dict[str, float] = {}
    counts = dict.fromkeys(MISMATCH_SUMS, 0.0)
    weight_sum, loss_sum, largest, rows = 0.0, 0.0, 0.0, []
    for index in range(mini.calls):
        micro = mini.micro_batches[index] if index < len(mini.micro_batches) else learner.batching.filler()
        with distributed.gradient_sync(learner.accelerator, learner.model, sync=index == mini.calls - 1):
            metrics, (mismatch, diff_max) = micro_batch_backward(learner, micro, mini.normalizer, loss_scale,
                                                                 first_pass)
        micro_rows = list(zip(metrics.pop("row_ratio_mean"), metrics.pop("row_clip_frac")))
        rows += micro_rows if index < len(mini.micro_batches) else []  # a filler's row is nobody's
        loss_sum += metrics.pop("loss")
        tokens = metrics.pop("num_tokens")
        _add_weighted(totals, metrics, tokens)
        weight_sum += tokens
        for key, value in mismatch.items():
            counts[key] += value
        largest = max(largest, diff_max)
    return UpdateSums({**totals, "loss": loss_sum, "num_tokens": weight_sum}, counts=counts,
                      maxima={"logprob_diff_max": largest}, rows=rows)


def _add_weighted(totals: dict[str, float], values: dict[str, float], weight: float) -> None:
    """totals[key] += value x weight: token-weighted sums, for micro-batches and for optimizer steps."""
    for key, value in values.items():
        totals[key] = totals.get(key, 0.0) + value * weight


def micro_batch_backward(learner: Learner, micro: MicroBatch, normalizer: float = 1.0, loss_scale: int = 1,
                         first_pass: bool = True) -> tuple[dict, tuple[dict[str, float], float]]:
    """One micro-batch (on the CPU) to the device, its forward and backward: each micro-batch goes to the card
    only when it runs. -> its loss and metrics (num_tokens, entropy, clip, ..., and the per-row lists
    row_ratio_mean, row_clip_frac), and its rollout mismatch (_mismatch). Out of memory raises
    MicroBatchOutOfMemory with its size."""
    try:
        return _micro_batch_backward(learner, micro.to(learner.batching.device), normalizer, loss_scale, first_pass)
    except torch.OutOfMemoryError as exc:
        raise MicroBatchOutOfMemory(len(micro.advantages), micro.batch.forward_tokens) from exc


def _micro_batch_backward(learner: Learner, micro: MicroBatch, normalizer: float, loss_scale: int,
                          first_pass: bool) -> tuple[dict, tuple[dict[str, float], float]]:
    batch = micro.batch
    out_of_memory_above(UPDATE_TOKENS, batch.forward_tokens)  # a test's fault (faults.py); nothing otherwise
    with out_of_memory_in_backward(BACKWARD_TOKENS, batch.forward_tokens, learner.model):  # the same, in the backward
        logprobs, entropy = learner.scorer(learner.model, batch)
    ref_logprobs = None
    if learner.reference is not None:
        with torch.no_grad(), learner.reference.scope():
            ref_logprobs, _ = learner.scorer(learner.reference.model, batch)
    old_logprobs = logprobs.detach()  # on-policy rows: ratio exactly 1
    if learner.behaviour.old_from_rollout and micro.behaviour_logprobs is not None:
        old_logprobs = torch.where(micro.behaviour_mask, micro.behaviour_logprobs, old_logprobs)  # (N, T)
    if micro.old_logprobs is not None:
        old_logprobs = torch.where(micro.has_old, micro.old_logprobs, old_logprobs)  # (N, T)
    loss, metrics = learner.loss(logprobs, old_logprobs, micro.advantages, batch.completion_mask,
                                 normalizer=normalizer, ref_logprobs=ref_logprobs, token_weight=micro.correction_weight,
                                 per_row=True)
    learner.accelerator.backward(loss * loss_scale if loss_scale != 1 else loss)
    tokens = float(metrics["num_tokens"])
    metrics["entropy"] = float((entropy * batch.completion_mask).sum() / max(tokens, 1.0))
    metrics["loss"] = float(loss.detach())
    return metrics, _mismatch(learner, micro, logprobs.detach(), first_pass)


def _mismatch(learner: Learner, micro: MicroBatch, logprobs: torch.Tensor, first_pass: bool
              ) -> tuple[dict[str, float], float]:
    """The rollout mismatch (mismatch.rollout_mismatch) of the rows whose training forward at the weights
    that sampled them is known: their recorded old log-probs (counted in the first pass), or this
    forward when no optimizer step has moved the weights since they were generated. -> (sums, largest
    |diff|); zeros when no row qualifies (every rank returns the same keys)."""
    fresh = micro.versions == learner.optimizer.steps  # (N,) on the CPU: decided without a device sync
    if micro.behaviour_logprobs is None or (micro.old_logprobs is None and not bool(fresh.any())):
        return dict.fromkeys(MISMATCH_SUMS, 0.0), 0.0  # no row is known: nothing to measure
    fresh = fresh.to(logprobs.device)[:, None]  # (N, 1)
    training, known = logprobs, fresh
    if micro.old_logprobs is not None:
        training = torch.where(micro.has_old, micro.old_logprobs, logprobs)  # (N, T)
        known = torch.where(micro.has_old, first_pass, fresh)
    sums, largest = rollout_mismatch(training, micro.behaviour_logprobs, micro.behaviour_mask & known,
                                     learner.behaviour.correction)
    values = torch.stack([*sums.values(), largest]).tolist()  # one device sync
    return dict(zip(sums, values[:-1])), values[-1]


def _means(sums: dict[str, float]) -> dict[str, float]:
    """One optimizer step's metrics: token-weighted means, its summed loss and its tokens."""
    tokens = sums["num_tokens"]
    means = {key: value / max(tokens, 1.0) for key, value in sums.items() if key not in ("loss", "num_tokens")}
    return {**means, "loss": sums["loss"], "num_tokens": tokens}


def update_metrics(result: UpdateResult, plan: UpdatePlan) -> dict:
    """A step's update metrics from its optimizer steps' sums over all ranks: token-weighted means over
    its optimizer steps (loss, entropy, clip fractions, ...), the last one's clip fractions, counts,
    gradient norm, the LR of its last optimizer step, and its groups' staleness."""
    totals: dict[str, float] = {}
    tokens, last = 0.0, {}
    for step in result.applied:
        last = _means(step.sums)
        _add_weighted(totals, {key: value for key, value in last.items() if key != "num_tokens"}, last["num_tokens"])
        tokens += last["num_tokens"]
    out = {key: value / max(tokens, 1.0) for key, value in totals.items()}
    out.update(
        num_tokens=plan.valid_tokens, micro_batches=plan.micro_batch_count, optimizer_steps=len(result.applied),
        clip_frac_high_last=last.get("clip_frac_high", 0.0), clip_frac_low_last=last.get("clip_frac_low", 0.0),
        staleness_mean=sum(result.staleness) / max(1, len(result.staleness)),
        staleness_max=max(result.staleness, default=0),
    )
    if result.applied:
        out["grad_norm"] = sum(step.grad_norm for step in result.applied) / len(result.applied)
    out.update(skipped_nonfinite=int(result.failed is not None), scaler_skips=result.scaler_skips,
               **work_metrics(plan))
    attempted = result.applied + ([result.failed] if result.failed is not None else [])
    if attempted:
        out["lr"] = attempted[-1].lr
    if result.failed is not None:
        out.update(loss=result.failed.sums["loss"], grad_norm=result.failed.grad_norm)
    return {**out, **rollout_metrics(attempted)}


def work_metrics(plan: UpdatePlan) -> dict:
    """What the update's forwards computed over all passes, against what trains: update_forward_tokens
    (positions), update_padding_tokens (of which padding), update_head_tokens (positions the LM head
    scored: the completions' own tokens), update_trained_tokens (the loss's tokens, once per pass), and
    forward and head positions per trained token (None when nothing trained)."""
    passes = plan.passes
    out = {"update_forward_tokens": int(plan.forward_tokens) * passes,
           "update_padding_tokens": int(plan.padding_tokens) * passes,
           "update_head_tokens": int(plan.head_tokens) * passes,
           "update_trained_tokens": int(plan.valid_tokens) * passes}
    trained = plan.valid_tokens
    out["update_forward_per_token"] = plan.forward_tokens / trained if trained else None
    out["update_head_per_token"] = plan.head_tokens / trained if trained else None
    return out


# mismatch.MISMATCH_SUMS name -> the step metric that is its mean over the measured tokens.
ROLLOUT_MEANS = {"kl": "rollout_kl", "logprob_diff": "rollout_logprob_diff_mean", "is_weight": "rollout_is_weight_mean",
                 "is_clipped": "rollout_is_clipped_frac"}


def rollout_metrics(steps: list[UpdateSums]) -> dict:
    """The step's rollout mismatch over the tokens measured in its optimizer steps (all ranks): rollout_kl,
    rollout_logprob_diff_mean / _max, rollout_is_weight_mean, rollout_is_clipped_frac, and rollout_tokens,
    how many tokens they cover. Every step has them: with 0 tokens (no row's training forward at its
    sampling weights was known, see _mismatch; or no update) the figures are None (null in metrics.jsonl)."""
    tokens = sum(step.counts.get("tokens", 0.0) for step in steps)
    if not tokens:
        return {**dict.fromkeys([*ROLLOUT_MEANS.values(), "rollout_logprob_diff_max"]), "rollout_tokens": 0}
    out = {name: sum(step.counts[key] for step in steps) / tokens for key, name in ROLLOUT_MEANS.items()}
    out["rollout_logprob_diff_max"] = max(step.maxima["logprob_diff_max"] for step in steps)
    return {**out, "rollout_tokens": tokens}
