"""Step 1 of every step: fill the batch with informative groups (Eq. 9, 11).

The step runs generation rounds until prompts_per_step informative groups are buffered over all
ranks (the count is ranks.py's) or `max_gen_rounds` ran; then it trains on what it has (possibly
fewer groups, or none: the step is skipped) and says so in its metrics. It never loops forever and
never crashes on a dry spell. A round is a pipeline of stages, each a function, typed records between:

    1 draw_prompts      the round's prompts (its size from the KeepRate; skips on the history) -> RoundPrompts
    2 generate          this rank's share: G completions each, or a screen of k then G - k  (screen.py)
    3 score             every reward on each generation call's completions -> Scored      (screen.py)
    4 make_group        each prompt's Group with its advantages (Eq. 9)
    5 fate              kept, or why not: its screen's verdict or Eq. 11's -> Fated
    6 settle_round      counts and rollout records (RolloutSample) of every group; the kept ones buffered

and the round's outcomes teach the prompt history (dapo.skip_history, history.py) and the keep rate
(dapo.max_round_prompts) before the next round is sized. A `Group` (records.py) is what the step
passes on to the update; surplus informative groups wait in the GroupBuffer for the next step (part of
the checkpoint, so resume is exact). What generation cost per trained token is in every step's metrics
(generation_stats.py: dropped_tokens, trained_tokens, generated_per_trained_token, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dapo_train.algo.advantages import group_advantages, is_informative_group
from dapo_train.config.schema import Config
from dapo_train.rollout.engines import RolloutEngine
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train import ranks
from dapo_train.train.collect.generation_stats import CollectStats
from dapo_train.train.collect.history import MIXED, RIGHT, WRONG, PromptHistory, alike_side
from dapo_train.train.collect.rollout_sample import RolloutSample
from dapo_train.train.collect.screen import Scored, generate_round
from dapo_train.train.records import Group, StepBatch


@dataclass
class RoundPrompts:
    """Stage 1's record: a round drew `drawn` prompts (the same on every rank), `skipped` of them on their
    history (each as the side its last outcome fell on: history.RIGHT, WRONG or MIXED); this rank generates
    `prompts`, each with its place in the round's batch over all ranks (`positions`: its rollout records'
    group) and its index among the run's draws (`draws`: it keys the prompt's random streams under screening)."""

    drawn: int
    skipped: list[str]
    prompts: list[Prompt]
    positions: list[int]
    draws: list[int]


@dataclass
class Fated:
    """Stage 5's record: a group a round generated, its place in the round's batch over all ranks, and its
    fate: None kept (the step's batch later says trained or carried), else why it never reaches the buffer:
    a drop_reason or a screen's SCREEN_FATES name, each a CollectStats counter and a run/rollouts.FATES name."""

    group: Group
    position: int
    fate: str | None


def fill_batch(engine: RolloutEngine, reward_set, sampler: PromptSampler, buffer: GroupBuffer, cfg: Config,
               version: int, sample: RolloutSample | None = None, keep_rate: KeepRate | None = None,
               history: PromptHistory | None = None) -> StepBatch:
    """Step 1: generation rounds until prompts_per_step informative groups are buffered over all ranks or
    rounds run out, then this step's groups. version: the optimizer steps taken so far, stamped on the new
    groups; sample: offered every generated group; keep_rate: the run's keep rate, updated by every round,
    which sizes the rounds under dapo.max_round_prompts; history: the run's prompt history, which skips
    prompts under dapo.skip_history and learns every round's outcomes."""
    wanted, keep_rate = cfg.train.prompts_per_step, keep_rate or KeepRate()
    history = history if cfg.dapo.skip_history else None
    stats, skipped = CollectStats(carried_in=len(buffer)), []
    buffered = ranks.buffered_groups(len(buffer))
    while stats.rounds < max_rounds(cfg) and buffered < wanted:
        stats.rounds += 1
        size = keep_rate.round_size(wanted - buffered, wanted, cfg.dapo.max_round_prompts)
        drawn = draw_prompts(sampler, size, history, cfg)  # 1
        fated = collect_round(engine, reward_set, drawn, cfg, stats, version)  # 2 to 5
        kept = settle_round(fated, stats, sample)  # 6
        buffer.add(kept)
        if history is not None:
            history.record(ranks.round_outcomes(outcomes(fated)))
        before, buffered = buffered, ranks.buffered_groups(len(buffer))
        keep_rate.add(buffered - before, drawn.drawn)
        skipped += drawn.skipped
    batch = take_batch(buffer, stats, wanted)
    batch.metrics["prompts_skipped"] = len(skipped)
    if history is not None:  # the sides health.py counts them on (a run without the history logs as before)
        batch.metrics.update({f"prompts_skipped_{side}": skipped.count(side) for side in (RIGHT, WRONG)})
    return batch


def draw_prompts(sampler: PromptSampler, size: int, history: PromptHistory | None, cfg: Config) -> RoundPrompts:
    """Stage 1: the round's `size` prompts, those the history skips left out (the same on every rank: the
    history and each draw's decision are), and this rank's share of the rest (ranks.own_share)."""
    first = prompts_drawn(sampler)
    batch = sampler.next_batch(size)
    live, skipped = [], []
    for b, prompt in enumerate(batch):
        if history is None or history.generates(prompt.uid, first + b, cfg.seed, cfg.dapo.skip_floor):
            live.append(b)
        else:
            skipped.append(history.side[prompt.uid])
    positions = ranks.own_share(live)
    return RoundPrompts(len(batch), skipped, [batch[b] for b in positions], positions, [first + b for b in positions])


def collect_round(engine: RolloutEngine, reward_set, drawn: RoundPrompts, cfg: Config, stats: CollectStats,
                  version: int) -> list[Fated]:
    """Stages 2 to 5 on this rank's prompts of a round, in order: generated and scored (with dapo.screen_size,
    a screen of k first: screen.py; every completion counted in `stats`), each a Group with its advantages
    (Eq. 9) stamped with `version`, and its fate: its screen's, or Eq. 11's. A ruled-out prompt's group
    holds its k screening completions, for its counts and records alone."""
    scored = generate_round(engine, reward_set, drawn.prompts, drawn.draws, cfg, stats)
    groups = [make_group(prompt, one, cfg, version) for prompt, one in zip(drawn.prompts, scored)]
    return [Fated(group, position, one.fate or drop_reason(group, cfg))
            for group, position, one in zip(groups, drawn.positions, scored)]


def make_group(prompt: Prompt, scored: Scored, cfg: Config, version: int) -> Group:
    """Stage 4: a prompt's scored completions as a Group, with its advantages (Eq. 9)."""
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)  # (G,)
    return Group(prompt=prompt, completions=scored.completions, rewards=rewards,
                 correct=torch.tensor(scored.correct, dtype=torch.bool),
                 advantages=group_advantages(rewards[None], std=cfg.dapo.advantage_std)[0],
                 per_reward=scored.per_reward, version=version)


def drop_reason(group: Group, cfg: Config) -> str | None:
    """Stage 5, Eq. 11 on the configured filter metric: None when the group is kept, else why it is dropped,
    the name of its CollectStats counter and its fate in the rollout records (run/rollouts.FATES)."""
    if not cfg.dapo.dynamic_sampling or is_informative_group(filter_values(group, cfg.dapo.filter_metric)):
        return None
    fates = {RIGHT: "dropped_all_correct", WRONG: "dropped_all_wrong", MIXED: "dropped_no_variance"}
    return fates[alike_side(group.correct)]


def filter_values(group: Group, metric: str) -> torch.Tensor:
    """The (G,) values dapo.filter_metric names: correct bits, total rewards, or reward:<name>'s."""
    if metric == "correct":
        return group.correct
    if metric == "total":
        return group.rewards
    return torch.tensor(group.per_reward[metric.partition(":")[2]])


def settle_round(fated: list[Fated], stats: CollectStats, sample: RolloutSample | None = None) -> list[Group]:
    """Stage 6: a round's kept groups, in order, for the buffer; each other one counted in `stats` (its fate's
    counter, its tokens in dropped_tokens), and every one offered to `sample` as round stats.rounds."""
    kept = []
    for one in fated:
        if one.fate is None:
            kept.append(one.group)
        else:
            setattr(stats, one.fate, getattr(stats, one.fate) + 1)
            stats.dropped_tokens += group_tokens(one.group)
        if sample is not None:
            sample.offer(one.group, stats.rounds, one.position, one.fate)
    return kept


def group_tokens(group: Group) -> int:
    """The completion tokens generated for a group (its valid tokens, EOS included)."""
    return sum(c.length for c in group.completions)


def max_rounds(cfg: Config) -> int:
    """Generation rounds a step may run: dapo.max_gen_rounds with dynamic sampling; without it exactly
    one, in which every group is kept (zero-variance groups then have A = 0 and only add to the token
    count)."""
    return cfg.dapo.max_gen_rounds if cfg.dapo.dynamic_sampling else 1


def outcomes(fated: list[Fated]) -> list[tuple[str, str | None]]:
    """(uid, side) of a round's groups on this rank, in order, for the prompt history: side None for a kept
    group, else the side its completions (a group's, or a ruled-out screen's) fell on."""
    return [(one.group.prompt.uid, None if one.fate is None else alike_side(one.group.correct)) for one in fated]


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
