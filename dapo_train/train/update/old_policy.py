"""Step 2 of every step, and the behaviour policy it rests on: the old log-probs in the ratio
(Eq. 10), pi_old = the policy that generated each completion.

Is the rollout the training forward? `dapo.old_logprobs` and `dapo.rollout_correction` are resolved
once, at start, from the config and the engine (DESIGN: behaviour policy vs training policy). The
rollout computes the training forward when it is the decode loop over the training weights
themselves (no copy in another dtype), in float32 without autocast, and no dropout in the training
forward. Then its log-probs before top-k / top-p truncation (Completion.untruncated_logprobs) are the
old log-probs to float rounding, so `auto` takes them as the old log-probs (no second pass) and
corrects nothing. Anything else (a bf16 copy, the compiled static cache, `generate`, another engine)
makes the rollout's numbers differ from pi_old: `auto` recomputes the old log-probs with the training
forward and applies truncated importance sampling (algo/correction.py) to that numeric gap.

Truncation is not part of that gap, by choice (docs/training.md, Sampling from what is scored): the
objective is the untruncated policy's, and under top-k / top-p pi_old / pi_behav is the kept mass
Z <= 1 of each position, which no weight on sampled tokens can turn into the untruncated gradient
(the cut tokens are never sampled) and which would scale down exactly the uncertain positions (tis),
mask them (mis) or vanish over a sequence (seq-*). The correction compares the training forward with
the rollout's distribution before truncation; the truncation is reported apart
(rollout_kl_truncation), and a top_k of at least the vocabulary or top_p 1 is no truncation at all.

With old log-probs from the rollout, step 2 does nothing. Else they are recorded right after
collection, while the weights are still the ones that sampled, by a no-grad pass of the training
forward (float32 master weights, the forward the update runs), for every group that a later update
trains after the policy has moved: all of this step's groups when the clip can act (any update but a
lone first one) or a rollout correction weighs tokens by pi_old / pi_behav, and always the
carried-over surplus (it trains in a later step, after this step's updates). A group keeps them,
through checkpoints too. A group without them is on-policy when trained (its step's first and only
update): the update uses its own detached log-probs, ratio exactly 1, and no pass is made for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dapo_train.algo.correction import RolloutCorrection
from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.faults import OLD_LOGPROB_TOKENS, out_of_memory_above
from dapo_train.train.records import Group
from dapo_train.train.update.batching import Batching, MicroBatchOutOfMemory, Scorer, flatten_groups

logger = logging.getLogger(__name__)

UNKNOWN_ROLLOUT = ("the rollout engine is not known here",)


@dataclass(frozen=True)
class BehaviourPolicy:
    """How the update treats the distribution the rollout sampled from: dapo.old_logprobs and
    dapo.rollout_correction resolved, and why (`differences`: how the rollout's forward departs from
    the training forward; empty when it is the training forward; `truncation`: top-k / top-p, which is
    not corrected)."""

    old_from_rollout: bool = False  # the rollout's untruncated log-probs are the ratio's old log-probs (no pass)
    correction: RolloutCorrection = RolloutCorrection()
    differences: tuple[str, ...] = UNKNOWN_ROLLOUT
    truncation: str | None = None  # what top-k / top-p cut (old_policy.truncation); None: nothing


def rollout_differences(cfg: Config, engine, model: torch.nn.Module, cuda: bool) -> tuple[str, ...]:
    """Every way the rollout `engine` samples from something other than the training forward of `model`
    (the unwrapped training model) under `cfg`; empty when it samples from the training forward."""
    from dapo_train.model.loading import dropout_fields, mixed_precision
    from dapo_train.rollout.hf_engines import DecodeLoopEngine

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
    if cfg.model.keep_dropout and dropout_fields(model.config):
        found.append("dropout in the training forward (model.keep_dropout)")
    if cfg.model.lora.r > 0 and cfg.model.lora.dropout > 0:
        found.append("LoRA dropout in the training forward (model.lora.dropout)")
    return tuple(found)


def truncation(cfg: Config, model: torch.nn.Module) -> str | None:
    """What top-k / top-p cut from the sampling distribution, as a phrase; None when nothing is cut (top_k
    0 or at least the vocabulary, top_p 1)."""
    from dapo_train.rollout.sampling import SamplingSettings

    r = cfg.rollout
    vocab = int(getattr(model.config, "vocab_size", 0) or 0) or r.top_k + 1
    if not SamplingSettings(1, top_k=r.top_k, top_p=r.top_p).truncates(vocab):
        return None
    parts = ([f"top-k {r.top_k} of {vocab}"] if 0 < r.top_k < vocab else []) + \
        ([f"top-p {r.top_p:g}"] if r.top_p < 1.0 else [])
    return " and ".join(parts)


def resolve(cfg: Config, differences: tuple[str, ...], truncation: str | None = None) -> BehaviourPolicy:
    """dapo.old_logprobs and dapo.rollout_correction with `auto` decided by `differences` (not by the
    truncation: the rollout's untruncated log-probs are compared)."""
    same = not differences
    old = cfg.dapo.old_logprobs
    mode = cfg.dapo.rollout_correction
    if mode == "auto":
        mode = "off" if same else "tis"
    return BehaviourPolicy(old_from_rollout=same if old == "auto" else old == "rollout",
                           correction=RolloutCorrection(mode, cfg.dapo.rollout_correction_cap),
                           differences=differences, truncation=truncation)


def log_behaviour(policy: BehaviourPolicy, cfg: Config, model: torch.nn.Module) -> None:
    """Say at start what the rollout samples from, where the old log-probs come from, what corrects the
    difference, and which of these settings cannot act."""
    from dapo_train.model.loading import dropout_fields

    if policy.differences:
        logger.info("rollout: the behaviour policy is not the training forward: %s", "; ".join(policy.differences))
    else:
        logger.info("rollout: the behaviour policy is the training forward (float32 decode loop over the training "
                    "weights)")
    if policy.truncation is not None:
        logger.info("rollout: samples after %s truncation; the objective and the correction are the untruncated "
                    "policy's, the cut mass is logged apart (rollout_kl_truncation)", policy.truncation)
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


def clip_can_act(cfg: Config) -> bool:
    """False when every update is the first and only one on its rollout batch: then the ratio is 1
    (carried-over groups aside) and eps_low / eps_high change nothing."""
    return min(cfg.train.updates_per_step, cfg.train.prompts_per_step) > 1 or cfg.dapo.num_iterations > 1


def needing_old_logprobs(cfg: Config, batch: list[Group], carried_over: list[Group],
                         behaviour: BehaviourPolicy) -> list[Group]:
    """The groups the no-grad pass must score: none when the behaviour log-probs are the old ones; else
    this step's (when the clip can act or a rollout correction needs pi_old) and the surplus that
    carries over to the next step."""
    if behaviour.old_from_rollout:
        return []
    return (batch if clip_can_act(cfg) or behaviour.correction.mode != "off" else []) + carried_over


def require_behaviour_logprobs(groups: list[Group], engine: str) -> None:
    """dapo.old_logprobs=rollout takes the behaviour log-probs as the old ones: every completion needs them."""
    if any(c.behaviour_logprobs is None for group in groups for c in group.completions):
        raise UserError(f"dapo.old_logprobs=rollout needs each completion's behaviour log-probs, and rollout.engine="
                        f"{engine} returned completions without them (Completion.behaviour_logprobs); set "
                        "dapo.old_logprobs=recompute")


def require_kept_mass(groups: list[Group], cfg: Config, behaviour: BehaviourPolicy) -> None:
    """Under top-k / top-p, what compares the rollout with pi_old (the correction, or the old log-probs
    taken from the rollout) needs the untruncated log-probs: every completion needs its kept_log_mass."""
    if behaviour.truncation is None or not (behaviour.old_from_rollout or behaviour.correction.mode != "off"):
        return
    if any(c.behaviour_logprobs is not None and c.kept_log_mass is None and c.length
           for group in groups for c in group.completions):
        raise UserError(
            f"rollout.top_k={cfg.rollout.top_k} / rollout.top_p={cfg.rollout.top_p:g} truncate, and rollout.engine="
            f"{cfg.rollout.engine} returned completions without Completion.kept_log_mass, so their behaviour log-probs "
            "cannot be compared with the untruncated training forward (docs/training.md, Sampling from what is "
            "scored); record it, or set dapo.rollout_correction=off and dapo.old_logprobs=recompute"
        )


def record_old_logprobs(model: torch.nn.Module, groups: list[Group], batching: Batching, scorer: Scorer) -> int:
    """Give every group without them its old log-probs under `model`: the training weights as a plain
    module (under several ranks, distributed.full_weights: no collective op per forward), still the
    ones that generated the groups. -> completions scored. Out of memory raises MicroBatchOutOfMemory with the
    micro-batch's size, no group given any (update/out_of_memory.py redoes the pass smaller)."""
    todo = [group for group in groups if group.old_logprobs is None]
    if not todo:
        return 0
    samples = flatten_groups(todo, overlong_filtering=False)
    model.train()  # the update's forward, not generation's
    scored: list[torch.Tensor] = []
    with torch.no_grad():
        for micro in batching.micro_batches(samples):
            try:  # one micro-batch on the device at a time
                out_of_memory_above(OLD_LOGPROB_TOKENS, micro.batch.forward_tokens)  # a test's fault (faults.py)
                logprobs, _ = scorer(model, micro.batch.to(batching.device))  # (N, T)
            except torch.OutOfMemoryError as exc:
                raise MicroBatchOutOfMemory(len(micro.advantages), micro.batch.forward_tokens) from exc
            for row in logprobs.float().cpu():
                scored.append(row[: samples[len(scored)].completion_ids.numel()].clone())
    rows = iter(scored)
    for group in todo:
        group.old_logprobs = [next(rows) for _ in group.completions]
    return len(scored)
