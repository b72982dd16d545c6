"""Which groups of a step its rollout records keep (logging.rollout_groups), and the records:
text and numbers per completion (run/rollouts.py lists the fields), never tensors.

Every group a generation round makes is offered here (collect.settle_round), kept or dropped by
Eq. 11: dropped groups never reach the buffer, and they are what a user wants to see when nothing
trains. The sample is bounded and deterministic: each group gets a priority drawn from (seed, step,
round, its prompt's position in the round's batch over all ranks), each rank keeps at most
logging.rollout_groups of its groups, lowest priority first, and the step keeps that many of them
over all ranks (ranks.gather_rollouts, merged). So a resume draws the same groups, and so does
another number of processes, and the cost per step is bounded however many rounds ran. A kept
group learns its fate (trained this step, skipped by the update, or carried over) once the step has taken its batch, and
the update's view of it (records.TrainedStats) once the update ran.

A group the step took but no applied optimizer step trained (each one that would have was skipped:
a non-finite loss or gradient norm, fp16's loss scaler, or the update ended before it) is
`update_skipped`. A group generated in one step and trained in a later one is recorded once, in the step that
generated it, as `carried` (its ratios are not recorded).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_train.config.schema import Config
from dapo_train.task.answers import answer_check
from dapo_train.train.records import Group

EVERY_GROUP = -1  # logging.rollout_groups: record every group of every step


@dataclass
class SampledGroup:
    """One sampled group: its priority (lower is kept first) and its G records. Plain data: it is
    what crosses ranks."""

    priority: float
    records: list[dict]


def group_records(group: Group, step: int, round_: int, position: int, fate: str | None,
                  extract: Callable[[str], str | None]) -> list[dict]:
    """One record per completion of `group` (run/rollouts.py's RECORD_KEYS); fate None: kept, the
    step's batch decides (RolloutSample.settle); ratio_mean and clip_frac come with the update."""
    records, behaviour = [], _behaviour_means(group)
    for j, completion in enumerate(group.completions):
        records.append({
            "step": step, "round": round_, "group": position, "sample": j, "uid": group.prompt.uid,
            "question": group.prompt.question, "gold": group.prompt.gold, "completion": completion.text,
            "length": completion.length, "truncated": bool(completion.truncated),
            "extracted": extract(completion.policy_text), "correct": bool(group.correct[j]),
            "rewards": {key: float(values[j]) for key, values in group.per_reward.items()},
            "reward": float(group.rewards[j]), "advantage": float(group.advantages[j]), "fate": fate,
            "behaviour_logprob_mean": behaviour[j], "ratio_mean": None, "clip_frac": None,
            "tool_calls": [call.to_record() for call in completion.tool_calls], "over_calls": completion.over_calls,
            "tool_turn_spans": [list(span) for span in completion.tool_turn_spans],
        })
    return records


def _behaviour_means(group: Group) -> list[float | None]:
    """Each completion's mean behaviour log-prob over the policy's own tokens (None: the engine recorded
    none), fetched from the rollout's device in one sync per group."""
    recorded = [c.behaviour_logprobs if c.policy_mask is None or c.behaviour_logprobs is None
                else c.behaviour_logprobs[c.policy_mask] for c in group.completions]
    present = [values for values in recorded if values is not None and values.numel()]
    means = iter(torch.stack([values.float().mean() for values in present]).tolist() if present else [])
    return [next(means) if values is not None and values.numel() else None for values in recorded]


def priority(seed: int, step: int, round_: int, position: int) -> float:
    """A uniform draw from the group's place alone (Random seeds a string through SHA-512, the same in
    every process and Python session)."""
    return random.Random(f"rollouts:{seed}:{step}:{round_}:{position}").random()


class RolloutSample:
    """One step's sample of groups on this rank: at most `size` (EVERY_GROUP: all; 0: none) of the
    lowest priority, each with its records, and for a kept group the Group itself until settle."""

    def __init__(self, size: int, seed: int, step: int, extract: Callable[[str], str | None]) -> None:
        self.size, self.seed, self.step, self.extract = size, seed, step, extract
        self.entries: list[tuple[SampledGroup, Group | None]] = []

    @classmethod
    def for_step(cls, cfg: Config, step: int) -> RolloutSample:
        return cls(cfg.logging.rollout_groups, cfg.seed, step, answer_check(cfg.data.correctness).extract)

    def offer(self, group: Group, round_: int, position: int, fate: str | None) -> None:
        """A group a round generated (position: its prompt's in the round's batch over all ranks), with
        why it was dropped (a rollouts.FATES name) or None when it was kept."""
        if self.size == 0:
            return
        drawn = priority(self.seed, self.step, round_, position)
        full = self.size != EVERY_GROUP and len(self.entries) >= self.size
        if full and drawn >= max(entry.priority for entry, _ in self.entries):
            return  # outranked by every group already held: its records are never built
        records = group_records(group, self.step, round_, position, fate, self.extract)
        self.entries.append((SampledGroup(drawn, records), group if fate is None else None))
        if full:
            self.entries.remove(max(self.entries, key=lambda pair: pair[0].priority))

    def settle(self, taken: list[Group]) -> list[SampledGroup]:
        """This rank's sampled groups with every fate known: a kept group among the step's `taken` groups
        is `trained` when an applied optimizer step trained it (with the ratios its update left,
        TrainedStats), else `update_skipped`; a kept group not taken is `carried`."""
        for entry, group in self.entries:
            if group is None:
                continue
            fate = "carried"
            if any(group is other for other in taken):
                fate = "trained" if group.trained is not None and group.trained.applied else "update_skipped"
            for j, record in enumerate(entry.records):
                record["fate"] = fate
                if fate == "trained":
                    record["ratio_mean"], record["clip_frac"] = group.trained.ratio_mean[j], group.trained.clip_frac[j]
        return [entry for entry, _ in self.entries]


def merge(per_rank: list[list[SampledGroup]], size: int) -> list[dict]:
    """The step's records from every rank's sampled groups: the `size` groups of lowest priority
    (EVERY_GROUP: all), in generation order (round, then position in the round's batch)."""
    groups = sorted((entry for entries in per_rank for entry in entries), key=lambda entry: entry.priority)
    kept = groups if size == EVERY_GROUP else groups[:size]
    kept.sort(key=lambda entry: (entry.records[0]["round"], entry.records[0]["group"]))
    return [record for entry in kept for record in entry.records]
