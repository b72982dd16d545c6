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

Deciding before generating (docs/training.md, What generation costs, and screening): a round may
screen its prompts first (dapo.screen_size, screen.py: ruled-out prompts get their own fates and
never reach the buffer); its size may follow the running keep rate (dapo.max_round_prompts,
KeepRate); and drawn prompts may be skipped on their history (dapo.skip_history, history.py). What
generation cost per trained token is in every step's metrics (dropped_tokens, trained_tokens,
generated_per_trained_token, seconds_generate_per_group).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from dapo_train.algo.advantages import group_advantages, is_informative_group
from dapo_train.config.schema import Config
from dapo_train.rollout.engines import RolloutEngine
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train import ranks
from dapo_train.train.history import PromptHistory
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.rollout_sample import RolloutSample
from dapo_train.train.screen import Scored, draw_round


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
class KeepRate:
    """The running fraction of drawn prompts whose group was kept (Eq. 11, and a screen), over all ranks:
    sums of kept groups and drawn prompts, each round's added after the earlier ones are decayed by
    DECAY, so about the last 1 / (1 - DECAY) rounds count. The same on every rank (its counts are
    totals over ranks) and part of the checkpoint, so resume draws the same round sizes."""

    DECAY = 0.9
    kept: float = 0.0
    drawn: float = 0.0

    @property
    def rate(self) -> float | None:
        return self.kept / self.drawn if self.drawn else None

    def add(self, kept: int, drawn: int) -> None:
        self.kept, self.drawn = self.DECAY * self.kept + kept, self.DECAY * self.drawn + drawn

    def round_size(self, missing: int, wanted: int, most: int) -> int:
        """Prompts the next round draws: `wanted` (train.prompts_per_step) when most is 0 (fixed rounds),
        else enough that the groups still `missing` are expected to be kept at the running rate, between
        `missing` and `most` (dapo.max_round_prompts): a step then usually fills in one round, and the
        surplus carries over. No rate yet (the run's first round): `missing`."""
        if most == 0:
            return wanted
        rate = self.rate
        if rate is None:
            return min(missing, most)
        return most if rate == 0 else max(missing, min(most, math.ceil(missing / rate)))

    def state_dict(self) -> dict:
        return {"kept": self.kept, "drawn": self.drawn}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint from before the keep rate starts without one."""
        self.kept, self.drawn = (float(state["kept"]), float(state["drawn"])) if state else (0.0, 0.0)


@dataclass
class CollectStats:
    """What the step's generation rounds saw, over ALL generated groups (kept or not)."""

    rounds: int = 0
    carried_in: int = 0  # groups buffered by earlier steps: the FIFO's first ones
    dropped_all_correct: int = 0
    dropped_all_wrong: int = 0
    dropped_no_variance: int = 0  # filter_metric total / reward:<name>: equal values, mixed correct bits
    screened_all_right: int = 0  # prompts a screen of dapo.screen_size ruled out (screen.py)
    screened_all_wrong: int = 0
    dropped_tokens: int = 0  # completion tokens generated on dropped groups and ruled-out screens: the waste
    seconds_generate: float = 0.0
    seconds_score: float = 0.0  # every reward, the reward models' seconds_reward_model included
    seconds_reward_model: float = 0.0
    rewards: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    cut_mass: list[float] = field(default_factory=list)  # per completion: sum of -log(kept mass), top-k / top-p
    tool_calls: list[int] = field(default_factory=list)  # per completion (rollout.tools): calls made
    tool_errors: list[int] = field(default_factory=list)  # per completion: calls answered with an error text
    tool_tokens: list[int] = field(default_factory=list)  # per completion: tokens of its tool turns (context)
    per_reward: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def merged(cls, ranks: list[CollectStats]) -> CollectStats:
        """One step's stats over all ranks (in rank order): counts add, lists join, seconds are the
        slowest rank's (the step waits for it)."""
        if len(ranks) == 1:
            return ranks[0]
        out = cls(rounds=ranks[0].rounds)
        for stats in ranks:
            for name in ("carried_in", "dropped_all_correct", "dropped_all_wrong", "dropped_no_variance",
                         "screened_all_right", "screened_all_wrong", "dropped_tokens"):
                setattr(out, name, getattr(out, name) + getattr(stats, name))
            for name in ("seconds_generate", "seconds_score", "seconds_reward_model"):
                setattr(out, name, max(getattr(out, name), getattr(stats, name)))
            for name in ("rewards", "correct", "lengths", "truncated", "cut_mass", "tool_calls", "tool_errors",
                         "tool_tokens"):
                getattr(out, name).extend(getattr(stats, name))
            for name, values in stats.per_reward.items():
                out.per_reward[name] += values
        return out

    def add_generated(self, completions: list, scores) -> None:
        """Completions a round generated, with their rewards.Scores: every one counts, kept or not."""
        self.rewards += scores.total
        self.correct += scores.correct
        self.lengths += [c.length for c in completions]
        self.truncated += [c.truncated for c in completions]
        self.cut_mass += [0.0 if c.kept_log_mass is None else -float(c.kept_log_mass.sum()) for c in completions]
        self.tool_calls += [len(c.tool_calls) for c in completions]
        self.tool_errors += [sum(call.error for call in c.tool_calls) for c in completions]
        self.tool_tokens += [c.length - c.policy_tokens for c in completions]
        for name, values in scores.per_reward.items():
            self.per_reward[name] += values

    def metrics(self, wanted: int, got: int, trained_tokens: int) -> dict:
        """The step's collection metrics; got: the groups it trains, trained_tokens: their completion
        tokens (all ranks). What a trained token cost in generation: generated_per_trained_token (1 when
        nothing is dropped and nothing carries over) and seconds_generate_per_group (None: nothing trained)."""
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
            "groups_screened_all_right": self.screened_all_right,
            "groups_screened_all_wrong": self.screened_all_wrong,
            "gen_rounds": self.rounds,
            "batch_short": wanted - got,
            "seconds_generate": self.seconds_generate,
            "seconds_score": self.seconds_score,
            "seconds_reward_model": self.seconds_reward_model,
            "generated_tokens": sum(self.lengths),
            "dropped_tokens": self.dropped_tokens,
            "trained_tokens": trained_tokens,
            "generated_per_trained_token": sum(self.lengths) / trained_tokens if trained_tokens else None,
            "seconds_generate_per_group": self.seconds_generate / got if got else None,
            # KL(truncated || untruncated) of the sampling distribution per generated token: E[-log Z].
            "rollout_kl_truncation": sum(self.cut_mass) / max(1, sum(self.lengths)),
            # rollout.tools: calls and error answers over all completions generated, the share of completions
            # that called a tool, and the tokens of tool turns (in generated_tokens, never trained)
            "tool_calls": sum(self.tool_calls),
            "tool_errors": sum(self.tool_errors),
            "tool_use_ratio": sum(calls > 0 for calls in self.tool_calls) / n,
            "tool_tokens": sum(self.tool_tokens),
        }
        out.update({f"rewards/{name}/mean": sum(v) / max(1, len(v)) for name, v in self.per_reward.items()})
        return out


def collect_round(
    engine: RolloutEngine, reward_set, prompts: list[Prompt], cfg: Config, stats: CollectStats, version: int,
    sample: RolloutSample | None = None, positions: list[int] | None = None, draws: list[int] | None = None,
) -> list[Group]:
    """One generation round: B prompts x G completions generated (with dapo.screen_size, a screen of k
    first: screen.py), scored, advantages computed (Eq. 9), and the informative groups kept (Eq. 11),
    stamped with `version` (optimizer steps so far). sample: offered every group, kept, dropped or
    ruled out by its screen, as round stats.rounds, prompt b at positions[b] (default b) of the round's
    batch over all ranks; draws: each prompt's index among the run's draws (default b), which keys
    its completions' random streams under screening."""
    positions = list(range(len(prompts))) if positions is None else positions
    drawn = draw_round(engine, reward_set, prompts, cfg, stats, list(range(len(prompts))) if draws is None else draws)
    for b, screen, fate in drawn.ruled_out:
        group = make_group(prompts[b], screen, cfg, version)  # its k completions: for the records alone
        setattr(stats, fate, getattr(stats, fate) + 1)
        stats.dropped_tokens += group_tokens(group)
        if sample is not None:
            sample.offer(group, stats.rounds, positions[b], fate)
    groups = [make_group(prompts[b], scored, cfg, version) for b, scored in drawn.complete]
    return keep_informative(groups, [positions[b] for b, _ in drawn.complete], cfg, stats, sample)


def make_group(prompt: Prompt, scored: Scored, cfg: Config, version: int) -> Group:
    """A prompt's scored completions as a Group, with its advantages (Eq. 9)."""
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)  # (G,)
    return Group(prompt=prompt, completions=scored.completions, rewards=rewards,
                 correct=torch.tensor(scored.correct, dtype=torch.bool),
                 advantages=group_advantages(rewards[None], std=cfg.dapo.advantage_std)[0],
                 per_reward=scored.per_reward, version=version)


def keep_informative(groups: list[Group], positions: list[int], cfg: Config, stats: CollectStats,
                     sample: RolloutSample | None = None) -> list[Group]:
    """Eq. 11 on a round's complete groups: the informative ones, in order; each dropped one counted in
    `stats` (its counter and its tokens in dropped_tokens), and every one offered to `sample`."""
    kept = []
    for group, position in zip(groups, positions):
        fate = drop_reason(group, cfg)
        if fate is None:
            kept.append(group)
        else:
            setattr(stats, fate, getattr(stats, fate) + 1)
            stats.dropped_tokens += group_tokens(group)
        if sample is not None:
            sample.offer(group, stats.rounds, position, fate)
    return kept


def group_tokens(group: Group) -> int:
    """The completion tokens generated for a group (its valid tokens, EOS included)."""
    return sum(c.length for c in group.completions)


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
               version: int, sample: RolloutSample | None = None, keep_rate: KeepRate | None = None,
               history: PromptHistory | None = None) -> StepBatch:
    """Step 1: generation rounds (collect_round) until prompts_per_step informative groups are buffered
    over all ranks or rounds run out, then this step's groups. version: the optimizer steps taken so
    far, stamped on the new groups; sample: offered every generated group; keep_rate: the run's keep
    rate, updated by every round, which sizes the rounds under dapo.max_round_prompts; history: the
    run's prompt history, which skips prompts under dapo.skip_history and learns every round's outcomes."""
    wanted, keep_rate = cfg.train.prompts_per_step, keep_rate or KeepRate()
    history = history if cfg.dapo.skip_history else None
    stats, skipped = CollectStats(carried_in=len(buffer)), 0
    buffered = ranks.buffered_groups(len(buffer))
    while stats.rounds < max_rounds(cfg) and buffered < wanted:
        stats.rounds += 1
        first = prompts_drawn(sampler)
        batch = sampler.next_batch(keep_rate.round_size(wanted - buffered, wanted, cfg.dapo.max_round_prompts))
        live = [b for b, prompt in enumerate(batch)  # the same on every rank, as the history and draws are
                if history is None or history.generates(prompt.uid, first + b, cfg.seed, cfg.dapo.skip_floor)]
        skipped += len(batch) - len(live)
        positions = ranks.own_share(live)
        prompts, kept = [batch[b] for b in positions], []
        if prompts:
            kept = collect_round(engine, reward_set, prompts, cfg, stats, version, sample, positions,
                                 [first + position for position in positions])
            buffer.add(kept)
        if history is not None:
            history.record(ranks.round_outcomes(outcomes(prompts, kept)))
        before, buffered = buffered, ranks.buffered_groups(len(buffer))
        keep_rate.add(buffered - before, len(batch))
    batch = take_batch(buffer, stats, wanted)
    batch.metrics["prompts_skipped"] = skipped
    return batch


def outcomes(prompts: list[Prompt], kept: list[Group]) -> list[tuple[str, bool]]:
    """(uid, whether its group was kept) for a round's prompts on this rank, in order."""
    left = Counter(group.prompt.uid for group in kept)
    out = []
    for prompt in prompts:
        out.append((prompt.uid, left[prompt.uid] > 0))
        left[prompt.uid] -= 1
    return out


def prompts_drawn(sampler: PromptSampler) -> int:
    """How many prompts the run has drawn so far (every epoch's): the next one's index among its draws."""
    state = sampler.state_dict()
    return state["epoch"] * state["num_prompts"] + state["position"]


def take_batch(buffer: GroupBuffer, stats: CollectStats, wanted: int) -> StepBatch:
    """This step's groups from the buffer (the rest carries over), with the metrics of its generation
    rounds over all ranks: groups_kept (trained this step), groups_carried (of those, generated by an
    earlier step), buffer_size (left for the next) and trained_tokens (the completion tokens of the
    groups trained, the policy's: a tool turn's are generated, not trained; against which generated_tokens
    and dropped_tokens are the cost)."""
    deal = ranks.deal_groups(len(buffer), stats, wanted)
    groups = buffer.take(deal.own)
    trained_tokens = int(ranks.total(sum(c.policy_tokens for group in groups for c in group.completions)))
    metrics = CollectStats.merged(deal.stats).metrics(wanted, sum(deal.takes), trained_tokens)
    # The buffer is a FIFO: the first `carried_in` groups a rank takes were generated by earlier steps.
    metrics["groups_carried"] = sum(min(take, stats.carried_in) for take, stats in zip(deal.takes, deal.stats))
    metrics["buffer_size"] = sum(deal.counts) - sum(deal.takes)
    return StepBatch(groups, deal.takes, metrics)
