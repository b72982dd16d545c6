"""What a step's generation rounds saw and what they cost (rounds.py): every completion generated,
kept or dropped, counted once, merged over ranks, and turned into the step's collection metrics."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


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
