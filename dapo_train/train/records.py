"""The typed records the stages of a step pass each other.

Group: one prompt and its G scored completions, made by step 1 (collect/rounds.py), kept in the
dynamic-sampling buffer across steps and checkpoints, given old log-probs by step 2 (update/old_policy.py)
and trained by step 3 (update/passes.py), which leaves its TrainedStats on it (for the rollout records).
StepBatch: the groups one step trains. UpdateSums and UpdateResult: what the optimizer steps of step
3 measured, per rank until ranks.py sums them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dapo_train.rollout.completions import Completion
from dapo_train.task.prompts import Prompt
from dapo_train.tools.turns import ToolCall


@dataclass
class TrainedStats:
    """What the update saw of a group's completions, one value per completion, averaged over the
    applied optimizer steps that trained it (one per dapo.num_iterations pass): its mean token
    ratio and the share of its valid tokens the objective clipped. None: no token of it was in the
    loss (overlong filtering), no applied step trained it, or (clip_frac) the objective reports no
    clipped tokens. applied: an applied optimizer step trained the group (False: every step that would
    have was skipped, non-finite or by fp16's loss scaler, or the update ended before it)."""

    ratio_mean: list[float | None]
    clip_frac: list[float | None]
    applied: bool = True


@dataclass
class Group:
    """One prompt and its G scored completions.

    version: optimizer steps taken before it was generated (its staleness when trained is the
    optimizer step count then minus this). old_logprobs: per completion, (L,) float32 log-probs
    under the training forward of the policy that generated it, recorded right after collection
    (update/old_policy.py; None while the update can prove the ratio is 1 and needs none, or when the
    completions' behaviour log-probs serve as old ones: dapo.old_logprobs=rollout). The completions
    carry their behaviour log-probs and the mass top-k / top-p kept (Completion.behaviour_logprobs,
    kept_log_mass), through checkpoints too.
    """

    prompt: Prompt
    completions: list[Completion]  # G
    rewards: torch.Tensor  # (G,) float32 total reward
    correct: torch.Tensor  # (G,) bool
    advantages: torch.Tensor  # (G,) float32 (Eq. 9)
    per_reward: dict[str, list[float]] = field(default_factory=dict)  # name -> G unweighted values
    version: int = 0
    old_logprobs: list[torch.Tensor] | None = None  # G x (L_i,)
    trained: TrainedStats | None = None  # set by the update that trains it; a buffered group has none

    def to_state(self) -> dict:
        """Plain tensors/lists only, loadable with torch.load(weights_only=True)."""
        return {
            "prompt_uid": self.prompt.uid,
            "prompt_ids": [c.prompt_ids for c in self.completions],
            "completion_ids": [c.completion_ids for c in self.completions],
            "truncated": [c.truncated for c in self.completions],
            "texts": [c.text for c in self.completions],
            "behaviour_logprobs": [c.behaviour_logprobs for c in self.completions],
            "kept_log_mass": [c.kept_log_mass for c in self.completions],
            "policy_masks": [c.policy_mask for c in self.completions],
            "tool_calls": [[call.to_record() for call in c.tool_calls] for c in self.completions],
            "over_calls": [c.over_calls for c in self.completions],
            "tool_turn_spans": [[list(span) for span in c.tool_turn_spans] for c in self.completions],
            "rewards": self.rewards,
            "correct": self.correct,
            "advantages": self.advantages,
            "per_reward": self.per_reward,
            "version": self.version,
            "old_logprobs": self.old_logprobs,
        }

    @classmethod
    def from_state(cls, state: dict, prompts_by_uid: dict[str, Prompt]) -> Group:
        # Optional in checkpoints: a group saved before they were kept has none (its old log-probs are recorded).
        behaviour = state.get("behaviour_logprobs") or [None] * len(state["completion_ids"])
        kept = state.get("kept_log_mass") or [None] * len(behaviour)  # saved before truncation was recorded: none
        policy = state.get("policy_masks") or [None] * len(behaviour)  # saved before tools: no tool turns
        calls = state.get("tool_calls") or [[]] * len(behaviour)
        over = state.get("over_calls") or [False] * len(behaviour)  # saved before it was its own end
        spans = state.get("tool_turn_spans") or [[]] * len(behaviour)  # saved before: graded already
        completions = [
            Completion(prompt_ids=p, completion_ids=c, truncated=t, text=x, behaviour_logprobs=b, kept_log_mass=k,
                       policy_mask=m, tool_calls=[ToolCall(**call) for call in made], over_calls=o,
                       tool_turn_spans=[tuple(span) for span in s])
            for p, c, t, x, b, k, m, made, o, s in zip(
                state["prompt_ids"], state["completion_ids"], state["truncated"], state["texts"], behaviour, kept,
                policy, calls, over, spans)
        ]
        return cls(
            prompt=prompts_by_uid[state["prompt_uid"]],
            completions=completions,
            rewards=state["rewards"],
            correct=state["correct"],
            advantages=state["advantages"],
            per_reward=state["per_reward"],
            version=int(state.get("version", 0)),  # optional in checkpoints: a missing one reads as fresh
            old_logprobs=state.get("old_logprobs"),
        )


@dataclass
class StepBatch:
    """The groups this rank trains this step, every rank's count of them (the global batch is
    their sum, in rank-interleaved order), and the collection metrics over all ranks."""

    groups: list[Group]
    takes: list[int]
    metrics: dict


@dataclass
class UpdateSums:
    """One optimizer step's metric sums over its micro-batches, on this rank until plan.reduce_update
    combines them over ranks. sums: token-weighted (value x tokens), with `loss` (the summed micro-batch
    losses) and `num_tokens`; counts: plain sums (the rollout mismatch's, mismatch.MISMATCH_SUMS);
    maxima: largest values (summed over ranks as a maximum)."""

    sums: dict[str, float]
    grad_norm: float = 0.0
    lr: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    rows: list[tuple[float, float]] = field(default_factory=list)  # this rank's (ratio mean, clipped share) per row
    mini_batch: int = 0  # its mini-batch's position in the plan (UpdatePlan.mini_batches)


@dataclass
class UpdateResult:
    """A step's optimizer steps: those applied, the one that failed (non-finite loss or gradient
    norm: the step's updates end there), if any, and the staleness of each group an applied step
    trained (optimizer steps between its generation and that step), and how many steps fp16's loss
    scaler skipped (the same on every rank: the gradients are reduced first). UpdateSums.rows of a
    step are its mini-batch's rows in order (MiniBatch.rows says whose); not summed over ranks."""

    applied: list[UpdateSums] = field(default_factory=list)
    failed: UpdateSums | None = None
    staleness: list[int] = field(default_factory=list)
    scaler_skips: int = 0
