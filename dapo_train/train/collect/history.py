"""Skipping prompts on their history (GRESO, arXiv 2506.02177): dapo.skip_history.

A prompt whose groups were all alike (dropped by Eq. 11, or ruled out by a screen) mostly stays so in
the next epoch. Each prompt's count of such outcomes in a row, z (reset by an informative group), sets
the probability that a round generates it when drawn: max(dapo.skip_floor, BASE^z), so a prompt is
never skipped for sure (the floor keeps exploring it: a hard prompt the policy learns to solve comes
back). A skipped prompt costs no generation; it counts as drawn, and in the starvation verdicts
(health.py) on the side its last outcome fell: all right, all wrong, or alike with mixed answers.

The decision for the n-th prompt the run draws is a uniform draw from (seed, n) alone, and the history
is the same on every rank (each round's outcomes are gathered from all ranks, ranks.py) and part of
the checkpoint, so every rank skips the same prompts and a resume skips what the uninterrupted run
would have. This only pays when prompts come back: on runs of more than one epoch of the data.
"""

from __future__ import annotations

import random

BASE = 0.5  # each all-alike outcome in a row halves a prompt's chance to be generated, down to the floor
# The side an all-alike outcome fell on, by its completions' correct bits (a group's, or a screen's k):
# every one right, every one wrong, or some of each (alike by a dapo.filter_metric other than `correct`).
RIGHT, WRONG, MIXED = "all_right", "all_wrong", "mixed"


def alike_side(correct) -> str:
    """RIGHT, WRONG or MIXED: every one of `correct` (bools, or a bool tensor) true, every one false, or some of
    each (a group alike only by another dapo.filter_metric; a screen that did not rule its prompt out)."""
    values = [bool(c) for c in correct]
    return RIGHT if all(values) else WRONG if not any(values) else MIXED


class PromptHistory:
    """Per prompt uid, its all-alike outcomes in a row and the side the last one fell on (absent: none, or
    an informative group last)."""

    def __init__(self) -> None:
        self.alike: dict[str, int] = {}
        self.side: dict[str, str] = {}

    def keep_probability(self, uid: str, floor: float) -> float:
        """1 for a prompt without a side: none alike in a row, or a count from a checkpoint written before
        the sides were kept (generated once, its side is known again)."""
        return max(floor, BASE ** self.alike[uid]) if uid in self.side else 1.0

    def generates(self, uid: str, draw: int, seed: int, floor: float) -> bool:
        """Whether the run's draw-th prompt (uid) is generated: a uniform from (seed, draw) under its
        keep probability (Random seeds a string through SHA-512: the same in every process)."""
        return random.Random(f"skip:{seed}:{draw}").random() < self.keep_probability(uid, floor)

    def record(self, outcomes: list[tuple[str, str | None]]) -> None:
        """A round's (uid, side) outcomes, in the round's order, over all ranks: side None for an informative
        group, else RIGHT, WRONG or MIXED."""
        for uid, side in outcomes:
            if side is None:
                self.alike.pop(uid, None)
                self.side.pop(uid, None)
            else:
                self.alike[uid] = self.alike.get(uid, 0) + 1
                self.side[uid] = side

    def state_dict(self) -> dict:
        return {"alike": dict(self.alike), "side": dict(self.side)}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint from before the history (or of a run without it) starts with none; one from before
        the sides keeps its counts, each prompt's side unknown until it is generated again."""
        state = state or {}
        self.alike = {str(uid): int(count) for uid, count in state.get("alike", {}).items()}
        self.side = {str(uid): str(side) for uid, side in state.get("side", {}).items()}
