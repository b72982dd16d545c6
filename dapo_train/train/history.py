"""Skipping prompts on their history (GRESO, arXiv 2506.02177): dapo.skip_history.

A prompt whose groups were all alike (dropped by Eq. 11, or ruled out by a screen) mostly stays so in
the next epoch. Each prompt's count of such outcomes in a row, z (reset by an informative group), sets
the probability that a round generates it when drawn: max(dapo.skip_floor, BASE^z), so a prompt is
never skipped for sure (the floor keeps exploring it: a hard prompt the policy learns to solve comes
back). A skipped prompt costs no generation; it counts as drawn.

The decision for the n-th prompt the run draws is a uniform draw from (seed, n) alone, and the history
is the same on every rank (each round's outcomes are gathered from all ranks, ranks.py) and part of
the checkpoint, so every rank skips the same prompts and a resume skips what the uninterrupted run
would have. This only pays when prompts come back: on runs of more than one epoch of the data.
"""

from __future__ import annotations

import random

BASE = 0.5  # each all-alike outcome in a row halves a prompt's chance to be generated, down to the floor


class PromptHistory:
    """Per prompt uid, its all-alike outcomes in a row (absent: none, or an informative group last)."""

    def __init__(self) -> None:
        self.alike: dict[str, int] = {}

    def keep_probability(self, uid: str, floor: float) -> float:
        return max(floor, BASE ** self.alike.get(uid, 0))

    def generates(self, uid: str, draw: int, seed: int, floor: float) -> bool:
        """Whether the run's draw-th prompt (uid) is generated: a uniform from (seed, draw) under its
        keep probability (Random seeds a string through SHA-512: the same in every process)."""
        return random.Random(f"skip:{seed}:{draw}").random() < self.keep_probability(uid, floor)

    def record(self, outcomes: list[tuple[str, bool]]) -> None:
        """A round's (uid, informative) outcomes, in the round's order, over all ranks."""
        for uid, informative in outcomes:
            if informative:
                self.alike.pop(uid, None)
            else:
                self.alike[uid] = self.alike.get(uid, 0) + 1

    def state_dict(self) -> dict:
        return {"alike": dict(self.alike)}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint from before the history (or of a run without it) starts with none."""
        self.alike = {str(uid): int(count) for uid, count in (state or {}).get("alike", {}).items()}
