"""Step 1 of every step: fill the batch with informative groups (Eq. 9, 11).

A generation round (collect_round) samples prompts, has the rollout engine generate G completions
for each (rollout/), scores them (rewards/), computes group advantages (Eq. 9) and, with dynamic
sampling, drops the groups whose filter metric does not vary. Rounds repeat until the step's batch
is full or `max_gen_rounds` is reached (fill_batch; the count is over all ranks, ranks.py); then the
step trains on what it has (possibly fewer groups, or none: the step is skipped) and says so in its
metrics. It never loops forever and never crashes on a dry spell.

Each `Group` (records.py: a prompt, its G completions, rewards, correct bits and advantages) is what
the step passes on to the update. Surplus informative groups wait in a `GroupBuffer` for the next
step; the buffer is part of the checkpoint, so resume is exact. Every group generated, kept or
dropped, is offered to the step's RolloutSample (rollout_sample.py) with its fate, for the rollout
records.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from dapo_train.algo.advantages import group_advantages, is_informative_group
from dapo_train.config.schema import Config
from dapo_train.rewards.scoring import score
from dapo_train.rollout.decoding import SamplingSettings
from dapo_train.rollout.engines import RolloutEngine
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train import ranks
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.rollout_sample import RolloutSample


class GroupBuffer:
    """Dynamic-sampling buffer (Eq. 11): a FIFO of informative groups; `take` returns at most n,
    the rest carries over to the next step."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[Group]) -> None:
        self.groups.extend(groups)

    def take(self, n: int) -> list[Group]:
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken

    def state_dict(self) -> list[dict]:
        return [g.to_state() for g in self.groups]

    def load_state_dict(self, state: list[dict], prompts_by_uid: dict[str, Prompt]) -> None:
        self.groups = [Group.from_state(s, prompts_by_uid) for s in state]


@dataclass
class CollectStats:
    """What the step's generation rounds saw, over ALL generated groups (kept or not)."""

    rounds: int = 0
    carried_in: int = 0  # groups buffered by earlier steps: the FIFO's first ones
    dropped_all_correct: int = 0
    dropped_all_wrong: int = 0
    dropped_no_variance: int = 0  # filter_metric total / reward:<name>: equal values, mixed correct bits
    seconds_generate: float = 0.0
    seconds_score: float = 0.0  # every reward, the reward models' seconds_reward_model included
    seconds_reward_model: float = 0.0
    rewards: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    cut_mass: list[float] = field(default_factory=list)  # per completion: sum of -log(kept mass), top-k / top-p
    per_reward: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def merged(cls, ranks: list[CollectStats]) -> CollectStats:
        """One step's stats over all ranks (in rank order): counts add, lists join, seconds are the
        slowest rank's (the step waits for it)."""
        if len(ranks) == 1:
            return ranks[0]
        out = cls(rounds=ranks[0].rounds)
        for stats in ranks:
            for name in ("carried_in", "dropped_all_correct", "dropped_all_wrong", "dropped_no_variance"):
                setattr(out, name, getattr(out, name) + getattr(stats, name))
            for name in ("seconds_generate", "seconds_score", "seconds_reward_model"):
                setattr(out, name, max(getattr(out, name), getattr(stats, name)))
            for name in ("rewards", "correct", "lengths", "truncated", "cut_mass"):
                getattr(out, name).extend(getattr(stats, name))
            for name, values in stats.per_reward.items():
                out.per_reward[name] += values
        return out

    def metrics(self, wanted: int, got: int) -> dict:
        n = max(1, len(self.rewards))
        rewards = torch.tensor(self.rewards or [0.0])
        out = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "train_accuracy": sum(self.correct) / n,
            "completions": len(self.rewards),
            "completion_length_mean": sum(self.lengths) / n,
            "completion_length_max": max(self.lengths, default=0),
            "truncated_ratio": sum(self.truncated) / n,
            "groups_kept": got,
            "groups_dropped_all_correct": self.dropped_all_correct,
            "groups_dropped_all_wrong": self.dropped_all_wrong,
            "groups_dropped_no_variance": self.dropped_no_variance,
            "gen_rounds": self.rounds,
            "batch_short": wanted - got,
            "seconds_generate": self.seconds_generate,
            "seconds_score": self.seconds_score,
            "seconds_reward_model": self.seconds_reward_model,
            "generated_tokens": sum(self.lengths),
            # KL(truncated || untruncated) of the sampling distribution per generated token: E[-log Z].
            "rollout_kl_truncation": sum(self.cut_mass) / max(1, sum(self.lengths)),
        }
        out.update({f"rewards/{name}/mean": sum(v) / max(1, len(v)) for name, v in self.per_reward.items()})
        return out


def collect_round(
    engine: RolloutEngine, reward_set, prompts: list[Prompt], cfg: Config, stats: CollectStats, version: int,
    sample: RolloutSample | None = None, positions: list[int] | None = None,
) -> list[Group]:
    """One generation round: B prompts x G completions generated, scored, advantages computed (Eq. 9),
    and the informative groups kept (Eq. 11), stamped with `version` (optimizer steps so far). sample:
    offered every group, kept or dropped, as round stats.rounds, prompt b at positions[b] (default b)
    of the round's batch over all ranks."""
    group_size = cfg.rollout.group_size
    settings = SamplingSettings(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
    )
    start = time.perf_counter()
    completions = engine.generate([p.input_ids for p in prompts], settings, group_size)
    stats.seconds_generate += time.perf_counter() - start
    start = time.perf_counter()
    scores = score(
        reward_set,
        [c.text for c in completions],
        [p.gold for p in prompts for _ in range(group_size)],
        lengths=[c.length for c in completions],
        prompts=[p.text for p in prompts for _ in range(group_size)],
        questions=[p.question for p in prompts for _ in range(group_size)],
    )
    stats.seconds_score += time.perf_counter() - start
    stats.seconds_reward_model += sum(scores.seconds[r.key] for r in reward_set.rewards if r.owns_model)
    rewards = torch.tensor(scores.total, dtype=torch.float32).view(len(prompts), group_size)  # (B, G)
    correct = torch.tensor(scores.correct, dtype=torch.bool).view(len(prompts), group_size)  # (B, G)
    advantages = group_advantages(rewards, std=cfg.dapo.advantage_std)  # (B, G)
    stats.rewards += scores.total
    stats.correct += scores.correct
    stats.lengths += [c.length for c in completions]
    stats.truncated += [c.truncated for c in completions]
    stats.cut_mass += [0.0 if c.kept_log_mass is None else -float(c.kept_log_mass.sum()) for c in completions]
    for name, values in scores.per_reward.items():
        stats.per_reward[name] += values
    groups = []
    for b, prompt in enumerate(prompts):
        rows = slice(b * group_size, (b + 1) * group_size)
        group = Group(
            prompt=prompt,
            completions=completions[rows],
            rewards=rewards[b],
            correct=correct[b],
            advantages=advantages[b],
            per_reward={name: values[rows] for name, values in scores.per_reward.items()},
            version=version,
        )
        fate = drop_reason(group, cfg)
        if fate is None:
            groups.append(group)
        else:
            setattr(stats, fate, getattr(stats, fate) + 1)
        if sample is not None:
            sample.offer(group, stats.rounds, b if positions is None else positions[b], fate)
    return groups


def filter_values(group: Group, metric: str) -> torch.Tensor:
    """The (G,) values dapo.filter_metric names: correct bits, total rewards, or reward:<name>'s."""
    if metric == "correct":
        return group.correct
    if metric == "total":
        return group.rewards
    return torch.tensor(group.per_reward[metric.partition(":")[2]])


def drop_reason(group: Group, cfg: Config) -> str | None:
    """Eq. 11 on the configured filter metric: None when the group is kept, else why it is dropped,
    the name of its CollectStats counter and its fate in the rollout records (run/rollouts.FATES)."""
    if not cfg.dapo.dynamic_sampling or is_informative_group(filter_values(group, cfg.dapo.filter_metric)):
        return None
    if bool(group.correct.all()):
        return "dropped_all_correct"
    return "dropped_no_variance" if bool(group.correct.any()) else "dropped_all_wrong"


def max_rounds(cfg: Config) -> int:
    """Generation rounds a step may run: dapo.max_gen_rounds with dynamic sampling; without it exactly
    one, in which every group is kept (zero-variance groups then have A = 0 and only add to the token
    count)."""
    return cfg.dapo.max_gen_rounds if cfg.dapo.dynamic_sampling else 1


def fill_batch(engine: RolloutEngine, reward_set, sampler: PromptSampler, buffer: GroupBuffer, cfg: Config,
               version: int, sample: RolloutSample | None = None) -> StepBatch:
    """Step 1: generation rounds (collect_round) until prompts_per_step informative groups are buffered
    over all ranks or rounds run out, then this step's groups. version: the optimizer steps taken so
    far, stamped on the new groups; sample: offered every generated group."""
    wanted = cfg.train.prompts_per_step
    stats = CollectStats(carried_in=len(buffer))
    while stats.rounds < max_rounds(cfg) and ranks.buffered_groups(len(buffer)) < wanted:
        stats.rounds += 1
        batch = sampler.next_batch(wanted)
        prompts, positions = ranks.own_share(batch), ranks.own_share(list(range(len(batch))))
        if prompts:
            buffer.add(collect_round(engine, reward_set, prompts, cfg, stats, version, sample, positions))
    return take_batch(buffer, stats, wanted)


def take_batch(buffer: GroupBuffer, stats: CollectStats, wanted: int) -> StepBatch:
    """This step's groups from the buffer (the rest carries over), with the metrics of its generation
    rounds over all ranks: groups_kept (trained this step), groups_carried (of those, generated by an
    earlier step) and buffer_size (left for the next)."""
    deal = ranks.deal_groups(len(buffer), stats, wanted)
    groups = buffer.take(deal.own)
    metrics = CollectStats.merged(deal.stats).metrics(wanted, sum(deal.takes))
    # The buffer is a FIFO: the first `carried_in` groups a rank takes were generated by earlier steps.
    metrics["groups_carried"] = sum(min(take, stats.carried_in) for take, stats in zip(deal.takes, deal.stats))
    metrics["buffer_size"] = sum(deal.counts) - sum(deal.takes)
    return StepBatch(groups, deal.takes, metrics)
