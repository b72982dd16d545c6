"""Step 2 of every step: the old log-probs in the ratio (Eq. 10), pi_old = the policy that generated
each completion.

With dapo.old_logprobs=rollout (auto: when the rollout is the training forward, behaviour.py) they
are the behaviour log-probs the rollout recorded while sampling, and this step does nothing. Else
they are recorded right after collection, while the weights are still the ones that sampled, by a
no-grad pass of the training forward (float32 master weights, the forward the update runs), for
every group that a later update trains after the policy has moved: all of this step's groups when
the clip can act (any update but a lone first one) or a rollout correction weighs tokens by
pi_old / pi_behav, and always the carried-over surplus (it trains in a later step, after this step's
updates). A group keeps them, through checkpoints too. A group without them is on-policy when
trained (its step's first and only update): the update uses its own detached log-probs, ratio
exactly 1, and no pass is made for it.
"""

from __future__ import annotations

import torch

from dapo_train.batches import Batching, Scorer, flatten_groups
from dapo_train.behaviour import BehaviourPolicy
from dapo_train.collect import Group
from dapo_train.config import Config
from dapo_train.errors import UserError


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


def record_old_logprobs(model: torch.nn.Module, groups: list[Group], batching: Batching, scorer: Scorer) -> int:
    """Give every group without them its old log-probs under `model`: the training weights as a plain
    module (under several ranks, distributed.full_weights: no collective op per forward), still the
    ones that generated the groups. -> completions scored."""
    todo = [group for group in groups if group.old_logprobs is None]
    if not todo:
        return 0
    samples = flatten_groups(todo, overlong_filtering=False)
    model.train()  # the update's forward, not generation's
    scored: list[torch.Tensor] = []
    with torch.no_grad():
        for micro in batching.micro_batches(samples):
            logprobs, _ = scorer(model, micro.batch)  # (N, T)
            for row in logprobs.float().cpu():
                scored.append(row[: samples[len(scored)].completion_ids.numel()].clone())
    rows = iter(scored)
    for group in todo:
        group.old_logprobs = [next(rows) for _ in group.completions]
    return len(scored)
