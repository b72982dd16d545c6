"""The update's token budget a card holds (train.micro_batch_tokens=auto): the largest budget whose estimated
peak (memory.py) fits the card's free memory less a margin; the room left for rollout.vllm_memory.

At a fixed packed-row width every moment of the estimate is linear in the micro-batch's tokens: the
backward's two branches grow with them (what the forward saves, the attention mask, the LM head's
positions, the recomputed layer), generation, the eval, reward scoring and the optimizer step do not. So
the choice needs each moment's fixed bytes and bytes per token (`Line`, from `budget_lines`), and
`choose_budget` is arithmetic on those, the free memory and the margin: pure, checked by hand in
tests/train/update/test_budget.py. The row width is held at the widest the largest budget makes, so a smaller
budget's estimate is over, never under, its own. What a run does with it at start, on its card: card.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dapo_train.config.schema import Config
from dapo_train.train.memory import (
    CARD_BYTES,
    GIB,
    ModelShape,
    RewardModelLoad,
    Setting,
    estimate,
    mini_batch_tokens,
)

MARGIN = 0.10  # of the free memory, kept back for what the estimate leaves out (fragmentation, kernels' workspaces)
BUDGET_STEP = 1024  # budgets are multiples of 1,024 tokens (or one sequence, when that is more)
BUDGET_MOST = 256 * 1024  # and at most 256 Ki
CARD_SIZES = (24 * 10**9, 48 * 10**9, 80 * 10**9)  # the cards preflight and docs/training.md size budgets for


@dataclass(frozen=True)
class Line:
    """One moment of the estimate as a function of the micro-batch's tokens t: fixed + per_token x t bytes."""

    name: str
    fixed: int
    per_token: int

    def at(self, tokens: int) -> int:
        return self.fixed + self.per_token * tokens


@dataclass(frozen=True)
class Need:
    """What choose_budget reads beside the lines: a micro-batch holds at least one sequence (`floor`: the
    longest prompt + max_new_tokens, alone over any smaller budget) and a budget above `cap` (what a mini-batch
    holds, rounded up to BUDGET_STEP) changes nothing."""

    floor: int
    cap: int


def usable(free_bytes: int, margin: float = MARGIN) -> int:
    """The free memory less the margin: what the estimate's moments must fit."""
    return int(free_bytes * (1 - margin))


def over_fixed(lines: list[Line], free_bytes: int, margin: float = MARGIN) -> Line | None:
    """The largest moment that no budget moves (per_token 0), when it is over the usable memory; else None."""
    fixed = [line for line in lines if line.per_token == 0]
    top = max(fixed, key=lambda line: line.fixed, default=None)
    return top if top is not None and top.fixed > usable(free_bytes, margin) else None


def most_tokens(lines: list[Line], free_bytes: int, margin: float = MARGIN) -> int:
    """The most tokens a micro-batch may hold before a growing moment is over the usable memory."""
    room = usable(free_bytes, margin)
    return min((room - line.fixed) // line.per_token for line in lines if line.per_token > 0)


def choose_budget(lines: list[Line], need: Need, free_bytes: int, margin: float = MARGIN) -> int | None:
    """The largest budget whose every line fits free_bytes x (1 - margin): a multiple of BUDGET_STEP (or the
    floor, when that is more), at most need.cap; None when nothing fits: a fixed line is over, or one sequence
    alone is."""
    if over_fixed(lines, free_bytes, margin) is not None:
        return None
    most = most_tokens(lines, free_bytes, margin)
    if most < need.floor:
        return None
    return min(max(most // BUDGET_STEP * BUDGET_STEP, need.floor), need.cap)


def peak_at(lines: list[Line], need: Need, budget: int) -> tuple[int, str]:
    """The estimated peak at `budget` (a micro-batch of at least one sequence) and its moment's name."""
    tokens = max(budget, need.floor)
    top = max(lines, key=lambda line: line.at(tokens))
    return top.at(tokens), top.name


def no_fit_reason(lines: list[Line], need: Need, free_bytes: int, margin: float = MARGIN) -> str:
    """Why choose_budget found none: the fixed moment over the card, or one sequence's peak."""
    fixed = over_fixed(lines, free_bytes, margin)
    if fixed is not None:
        return f"the {fixed.name} moment alone: {fixed.fixed / GIB:.1f} GiB"
    peak, moment = peak_at(lines, need, need.floor)
    return f"one sequence of {need.floor:,} tokens alone: {peak / GIB:.1f} GiB at the {moment}"


def describe_choice(lines: list[Line], need: Need, free_bytes: int, margin: float = MARGIN) -> str:
    """auto's choice on a card of free_bytes, as preflight and docs/training.md's table show it: '9,216 (a whole
    mini-batch)', '27,648', or 'none fits (why)'."""
    budget = choose_budget(lines, need, free_bytes, margin)
    if budget is None:
        return f"none fits ({no_fit_reason(lines, need, free_bytes, margin)})"
    return f"{budget:,}" + (" (a whole mini-batch)" if budget == need.cap else "")


def budget_lines(shape: ModelShape, cfg: Config, prompt_tokens: int, shards: int = 1,
                 reward_models: tuple[RewardModelLoad, ...] = (), card_bytes: int = CARD_BYTES, processes: int = 1
                 ) -> tuple[list[Line], Need]:
    """The estimate's moments on a CUDA card as lines in the micro-batch's tokens (module docstring), and the
    floor and cap of a budget, for `cfg` with its longest prompt at prompt_tokens."""
    floor = prompt_tokens + cfg.rollout.max_new_tokens
    whole = -(-mini_batch_tokens(cfg, prompt_tokens, shards) // BUDGET_STEP) * BUDGET_STEP
    need = Need(floor, max(floor, min(BUDGET_MOST, whole)))
    widest = replace(cfg, train=replace(cfg.train, micro_batch_tokens=need.cap))
    setting = Setting.from_config(widest, cuda=True, prompt_tokens=prompt_tokens, shards=shards,
                                  reward_models=reward_models, card_bytes=card_bytes, processes=processes)

    def parts(tokens: int) -> dict[str, int]:
        return estimate(shape, replace(setting, tokens=tokens, head_positions=tokens - prompt_tokens)).parts

    low, high = parts(floor), parts(2 * floor)
    lines = []
    for name, value in low.items():
        per_token = (high[name] - value) // floor
        lines.append(Line(name, value - per_token * floor, per_token))
    return lines, need


GENERATING = ("generate", "eval")  # the moments vLLM is awake in, its share of the card among their fixed bytes


def vllm_room(lines: list[Line], share: float, total_bytes: int, free_bytes: int, margin: float = MARGIN) -> float:
    """rollout.engine=vllm on CUDA: the largest rollout.vllm_memory (a share of the card's total_bytes, as
    vLLM's gpu_memory_utilization is) that fits beside the training state while it generates, when the lines
    were made with `share`: free_bytes x (1 - margin) less the generation moments without the engine's share
    (it sleeps through the update), over the total."""
    engine = int(share * total_bytes)
    beside = max(line.fixed - engine for line in lines if line.name in GENERATING)
    return (usable(free_bytes, margin) - beside) / total_bytes
