"""Dynamic-sampling buffer (Eq. 11): informative groups waiting for an optimizer step.

Groups whose filter metric does not vary (all correct or all wrong) carry no advantage signal and
are dropped before they reach the buffer; the trainer keeps generating until `prompts_per_step`
groups are buffered or its rounds run out. Surplus groups carry over to the next step (they are
then one update stale; with num_iterations == 1 their old log-probs are recomputed under the
current policy, as verl does), and the buffer is part of the checkpoint so resume is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dapo_train.data import Prompt
from dapo_train.rollout import Completion


@dataclass
class Group:
    """One prompt and its G scored completions."""

    prompt: Prompt
    completions: list[Completion]  # G
    rewards: torch.Tensor  # (G,) float32 total reward
    correct: torch.Tensor  # (G,) bool
    advantages: torch.Tensor  # (G,) float32 (Eq. 9)
    per_reward: dict[str, list[float]] = field(default_factory=dict)  # name -> G unweighted values

    def to_state(self) -> dict:
        """Plain tensors/lists only, loadable with torch.load(weights_only=True)."""
        return {
            "prompt_uid": self.prompt.uid,
            "prompt_ids": [c.prompt_ids for c in self.completions],
            "completion_ids": [c.completion_ids for c in self.completions],
            "truncated": [c.truncated for c in self.completions],
            "texts": [c.text for c in self.completions],
            "rewards": self.rewards,
            "correct": self.correct,
            "advantages": self.advantages,
            "per_reward": self.per_reward,
        }

    @classmethod
    def from_state(cls, state: dict, prompts_by_uid: dict[str, Prompt]) -> "Group":
        completions = [
            Completion(prompt_ids=p, completion_ids=c, truncated=t, text=x)
            for p, c, t, x in zip(state["prompt_ids"], state["completion_ids"], state["truncated"], state["texts"])
        ]
        return cls(
            prompt=prompts_by_uid[state["prompt_uid"]],
            completions=completions,
            rewards=state["rewards"],
            correct=state["correct"],
            advantages=state["advantages"],
            per_reward=state["per_reward"],
        )


class GroupBuffer:
    """FIFO of informative groups; `take` returns at most n, the rest stays for the next step."""

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
