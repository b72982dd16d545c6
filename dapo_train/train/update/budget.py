"""The update's token budget a card holds (train.micro_batch_tokens=auto): the largest budget whose estimated
peak (memory.py) fits the card's free memory less a margin; rollout.vllm_memory checked against the same.

At a fixed packed-row width every moment of the estimate is linear in the micro-batch's tokens: the
backward's two branches grow with them (what the forward saves, the attention mask, the LM head's
positions, the recomputed layer), generation, the eval, reward scoring and the optimizer step do not. So
the choice needs each moment's fixed bytes and bytes per token (`Line`, from `budget_lines`), and
`choose_budget` is arithmetic on those, the free memory and the margin: pure, checked by hand in
tests/train/update/test_budget.py. The row width is held at the widest the largest budget makes, so a smaller
budget's estimate is over, never under, its own.

At start (resolve_budget), once, before the model loads: the card's free memory (the least over the ranks)
against the estimate of the real run (its config.json, no weights; the longest training prompt). On a CPU
there is no card to size a budget from: auto is micro_batch_size's count, as a budget of 0 is. Several
processes: the out-of-memory retry (out_of_memory.py) is off, and the run says so here.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError
from dapo_train.train import distributed
from dapo_train.train.memory import (
    CARD_BYTES,
    GIB,
    ModelShape,
    RewardModelLoad,
    Setting,
    estimate,
    mini_batch_tokens,
    reward_model_loads,
)

logger = logging.getLogger(__name__)

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


def choose_budget(lines: list[Line], need: Need, free_bytes: int, margin: float = MARGIN) -> int | None:
    """The largest budget whose every line fits free_bytes x (1 - margin): a multiple of BUDGET_STEP (or the
    floor, when that is more), at most need.cap; None when nothing fits: a fixed line is over, or one sequence
    alone is."""
    usable = int(free_bytes * (1 - margin))
    if any(line.fixed > usable for line in lines if line.per_token == 0):
        return None
    most = min((usable - line.fixed) // line.per_token for line in lines if line.per_token > 0)
    if most < need.floor:
        return None
    return min(max(most // BUDGET_STEP * BUDGET_STEP, need.floor), need.cap)


def peak_at(lines: list[Line], need: Need, budget: int) -> tuple[int, str]:
    """The estimated peak at `budget` (a micro-batch of at least one sequence) and its moment's name."""
    tokens = max(budget, need.floor)
    top = max(lines, key=lambda line: line.at(tokens))
    return top.at(tokens), top.name


def budget_lines(shape: ModelShape, cfg: Config, prompt_tokens: int, shards: int = 1,
                 reward_models: tuple[RewardModelLoad, ...] = (), card_bytes: int = CARD_BYTES
                 ) -> tuple[list[Line], Need]:
    """The estimate's moments on a CUDA card as lines in the micro-batch's tokens (module docstring), and the
    floor and cap of a budget, for `cfg` with its longest prompt at prompt_tokens."""
    floor = prompt_tokens + cfg.rollout.max_new_tokens
    whole = -(-mini_batch_tokens(cfg, prompt_tokens, shards) // BUDGET_STEP) * BUDGET_STEP
    need = Need(floor, max(floor, min(BUDGET_MOST, whole)))
    widest = replace(cfg, train=replace(cfg.train, micro_batch_tokens=need.cap))
    setting = Setting.from_config(widest, cuda=True, prompt_tokens=prompt_tokens, shards=shards,
                                  reward_models=reward_models, card_bytes=card_bytes)

    def parts(tokens: int) -> dict[str, int]:
        return estimate(shape, replace(setting, tokens=tokens, head_positions=tokens - prompt_tokens)).parts

    low, high = parts(floor), parts(2 * floor)
    lines = []
    for name, value in low.items():
        per_token = (high[name] - value) // floor
        lines.append(Line(name, value - per_token * floor, per_token))
    return lines, need


def vllm_room(lines: list[Line], share: float, total_bytes: int, free_bytes: int, margin: float = MARGIN) -> float:
    """rollout.engine=vllm on CUDA: the largest rollout.vllm_memory (a share of the card's total_bytes, as
    vLLM's gpu_memory_utilization is) that fits beside the training state while it generates, when the lines
    were made with `share`: free_bytes x (1 - margin) less the generation moments without the engine's share
    (it sleeps through the update), over the total."""
    usable = int(free_bytes * (1 - margin))
    engine = int(share * total_bytes)
    beside = max(line.fixed - engine for line in lines if line.name in ("generate", "eval"))
    return (usable - beside) / total_bytes


def resolve_budget(cfg: Config, accelerator, prompt_lengths: list[int]) -> int | None:
    """The update's token budget for the Learner: auto's choice (one line with its numbers), or None for the
    config's own number. On CUDA with rollout.engine=vllm, refuses (one line) a share of the card that does
    not fit beside the training state. prompt_lengths: the training prompts' token counts."""
    auto = cfg.train.micro_batch_tokens == "auto"
    cuda = accelerator.device.type == "cuda"
    if distributed.world_size() > 1:
        logger.warning("%d processes: an out-of-memory update is not redone smaller (every rank would have to "
                       "agree on it) and ends the run; %s", distributed.world_size(),
                       "train.micro_batch_tokens=auto sizes the budget from the card with the least free memory"
                       if auto else "train.micro_batch_tokens=auto would size the budget from the cards")
    vllm = cuda and cfg.rollout.engine == "vllm"
    if not auto and not vllm:
        return None
    if not cuda:
        logger.info("train.micro_batch_tokens=auto on a CPU: no card's free memory to size a token budget from; "
                    "micro-batches of train.micro_batch_size=%d completions, as with 0", cfg.train.micro_batch_size)
        return 0
    free, total = torch.cuda.mem_get_info(accelerator.device)
    free = int(-distributed.all_reduce([-free], op="max")[0])  # the least free memory of any rank
    lines, need = _lines(cfg, accelerator, max(prompt_lengths), total)
    if vllm:
        _check_vllm_share(cfg, lines, total, free)
    if not auto:
        return None
    budget = choose_budget(lines, need, free)
    if budget is None:
        fixed = max((line for line in lines if line.per_token == 0), key=lambda line: line.fixed)
        over = f"the {fixed.name} moment alone is estimated at {fixed.fixed / GIB:.1f} GiB" \
            if fixed.fixed > free * (1 - MARGIN) else f"one sequence of {need.floor} tokens alone is over it"
        raise ConfigError("train.micro_batch_tokens", f"auto: no budget fits the {free / GIB:.1f} GiB free on this "
                          f"card less a {MARGIN:.0%} margin ({over}); cut memory (model.lora.r, "
                          "model.gradient_checkpointing=on, rollout.generation_batch_size, rollout.max_new_tokens) or "
                          "set a number to try anyway")
    peak, moment = peak_at(lines, need, budget)
    logger.info("train.micro_batch_tokens=auto: %d, the largest budget whose estimated peak (%.1f GiB, at the %s) "
                "fits the %.1f GiB free on this card less a %.0f%% margin (%.1f GiB)%s", budget, peak / GIB, moment,
                free / GIB, MARGIN * 100, free * (1 - MARGIN) / GIB,
                "; a whole mini-batch" if budget == need.cap else "")
    return budget


def _lines(cfg: Config, accelerator, longest: int, total: int):
    """budget.budget_lines for the real model (its config.json, no weights) and this run's ranks."""
    from accelerate.utils import DistributedType

    from dapo_train.model.loading import load_model_config

    shape = ModelShape.from_config(load_model_config(cfg.model)[0], cfg.model.lora)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    shards = distributed.world_size() if sharded else 1
    rewards = reward_model_loads(cfg, cuda=True, sequence=longest + cfg.rollout.max_new_tokens)
    return budget_lines(shape, cfg, longest, shards, rewards, card_bytes=total)


def _check_vllm_share(cfg: Config, lines, total: int, free: int) -> None:
    """rollout.vllm_memory against the training state beside it while vLLM generates (budget.vllm_room)."""
    share = cfg.rollout.vllm_memory
    room = vllm_room(lines, share, total, free)
    if share <= room:
        return
    where = f"in the {free / GIB:.1f} GiB free on this {total / GIB:.1f} GiB card less a {MARGIN:.0%} margin"
    if room <= 0:
        raise ConfigError("rollout.vllm_memory", f"vLLM has no room beside the training state {where}: cut the "
                          "training state (model.lora.r, model.dtype=bfloat16)")
    raise ConfigError("rollout.vllm_memory", f"{share:g} of the card for vLLM does not fit beside the training state "
                      f"(weights, AdamW state, ...) {where}: set it to at most {math.floor(room * 100) / 100:.2f}")


def estimated_peak(cfg: Config, accelerator, prompt_lengths: list[int], budget: int | None) -> int | None:
    """The estimated peak in bytes of this run on its card, which the first step's line sets beside the measured
    one (train/card_memory.py): the memory model at the update's budget (`budget`: resolve_budget's, else the
    config's; by count, the positions train.micro_batch_size rows hold), read off the lines auto chooses by,
    so that under auto it is the number auto's line gave. None on a CPU, or for a model config the memory model
    cannot read."""
    if accelerator.device.type != "cuda":
        return None
    longest = max(prompt_lengths)
    try:
        lines, need = _lines(cfg, accelerator, longest, torch.cuda.mem_get_info(accelerator.device)[1])
    except AttributeError:  # a config the memory model cannot read (GPT-2's names no intermediate_size): none
        return None
    tokens = budget if budget is not None else cfg.train.micro_batch_tokens
    if not tokens:
        tokens = Setting.from_config(cfg, cuda=True, prompt_tokens=longest).tokens
    return peak_at(lines, need, tokens)[0]
