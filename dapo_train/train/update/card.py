"""The update's budget on this run's card, decided once at start before the model loads
(train.micro_batch_tokens=auto, rollout.vllm_memory), and, when the card cannot hold the run, what can.

The card's free memory (the least over the ranks: ranks.py) against the estimate of the real run (its
config.json, no weights; the longest training prompt), by budget.py's arithmetic. On a CPU there is no card to
size a budget from: auto is micro_batch_size's count, as a budget of 0 is. Several processes: the out-of-memory
retry (out_of_memory.py) is off, and the run says so here.

A refusal names the moment that does not fit and advises only what fits by the same estimate: each setting that
could help (LoRA as configs/qwen1.5b-lora.yaml has it, gradient checkpointing, fewer rows per generate call, a
smaller vLLM share) is estimated again and named, with the budget auto then chooses, only when one fits; a
smaller model by the bound the over moment's bytes per parameter set, shorter sequences by the tokens the
growing moments hold. A setting that cannot lower the moment over the card is never named.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError
from dapo_train.evaluation.generate import longest_sequence
from dapo_train.train import distributed
from dapo_train.train.memory import GIB, ModelShape, Setting, reward_model_loads
from dapo_train.train.ranks import least_free_memory
from dapo_train.train.update.budget import (
    GENERATING,
    MARGIN,
    Line,
    Need,
    budget_lines,
    choose_budget,
    most_tokens,
    no_fit_reason,
    over_fixed,
    peak_at,
    usable,
    vllm_room,
)

logger = logging.getLogger(__name__)

LORA_RANK = 32  # configs/qwen1.5b-lora.yaml's adapters (verl's recipe), over a bfloat16 frozen base


@dataclass(frozen=True)
class Card:
    """This run's card as the estimate reads it: its free memory (the least over the ranks) and total, the
    longest training prompt's tokens, the cards FSDP/ZeRO shards over, the model's config.json (no weights)."""

    free: int
    total: int
    longest: int
    shards: int
    model_config: object

    def where(self) -> str:
        return (f"the {self.free / GIB:.1f} GiB free on this {self.total / GIB:.1f} GiB card less a {MARGIN:.0%} "
                f"margin, {usable(self.free) / GIB:.1f} GiB")

    def lines(self, cfg: Config, shape: ModelShape | None = None) -> tuple[ModelShape, list[Line], Need]:
        """budget.budget_lines for `cfg` on this card (shape: the model's under cfg's LoRA, counted if None)."""
        shape = shape or ModelShape.from_config(self.model_config, cfg.model.lora)
        rewards = reward_model_loads(cfg, cuda=True, sequence=self.longest + cfg.rollout.max_new_tokens)
        return (shape, *budget_lines(shape, cfg, self.longest, self.shards, rewards, card_bytes=self.total,
                                     processes=distributed.world_size()))

    def choice(self, cfg: Config, shape: ModelShape | None = None) -> int | None:
        """The budget auto would choose for `cfg` on this card (None: none fits)."""
        _, lines, need = self.lines(cfg, shape)
        return choose_budget(lines, need, self.free)


def resolve_budget(cfg: Config, accelerator, prompt_lengths: list[int]) -> int | None:
    """The update's token budget for the Learner: auto's choice (one line with its numbers), or None for the
    config's own number. On CUDA with rollout.engine=vllm, refuses (one line) a share of the card that does
    not fit beside the training state. prompt_lengths: the training prompts' token counts."""
    auto, cuda = cfg.train.micro_batch_tokens == "auto", accelerator.device.type == "cuda"
    if distributed.world_size() > 1:
        logger.warning("%d processes: an out-of-memory update is not redone smaller (every rank would have to "
                       "agree on it) and ends the run%s", distributed.world_size(),
                       "; train.micro_batch_tokens=auto sizes the budget from the card with the least free memory"
                       if auto and cuda else "")
    vllm = cuda and cfg.rollout.engine == "vllm"
    if not auto and not vllm:
        return None
    if not cuda:
        logger.info("train.micro_batch_tokens=auto on a CPU: no card's free memory to size a token budget from; "
                    "micro-batches of train.micro_batch_size=%d completions, as with 0", cfg.train.micro_batch_size)
        return 0
    card = this_card(cfg, accelerator, max(prompt_lengths))
    shape, lines, need = card.lines(cfg)
    if vllm:
        check_vllm_share(cfg, card, shape, lines, need)
    if not auto:
        return None
    budget = choose_budget(lines, need, card.free)
    if budget is None:
        raise ConfigError("train.micro_batch_tokens", f"auto: no budget fits {card.where()} "
                          f"({no_fit_reason(lines, need, card.free)}); {advice(cfg, card, shape, lines, need)}")
    peak, moment = peak_at(lines, need, budget)
    logger.info("train.micro_batch_tokens=auto: %d, the largest budget whose estimated peak (%.1f GiB, at the %s) "
                "fits the %.1f GiB free on this card less a %.0f%% margin (%.1f GiB)%s", budget, peak / GIB, moment,
                card.free / GIB, MARGIN * 100, usable(card.free) / GIB,
                "; a whole mini-batch" if budget == need.cap else "")
    return budget


def this_card(cfg: Config, accelerator, longest: int) -> Card:
    """The card this rank runs on, its free memory the least over the ranks, and the real model's config."""
    from accelerate.utils import DistributedType

    from dapo_train.model.loading import load_model_config

    free, total = torch.cuda.mem_get_info(accelerator.device)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    return Card(least_free_memory(free), total, longest, distributed.world_size() if sharded else 1,
                load_model_config(cfg.model)[0])


def vllm_least_share(shape: ModelShape, cfg: Config, total: int) -> float:
    """The least share of the card vLLM starts with: its bfloat16 weights and one longest sequence's KV cache."""
    return (shape.parameters * 2 + shape.kv_bytes_per_token(2) * longest_sequence(cfg)) / total


def check_vllm_share(cfg: Config, card: Card, shape: ModelShape, lines: list[Line], need: Need) -> None:
    """rollout.vllm_memory against the training state beside it while vLLM generates (budget.vllm_room): a
    smaller share is advised only when it holds vLLM's weights and one sequence, and the rest of the run fits."""
    share = cfg.rollout.vllm_memory
    room = vllm_room(lines, share, card.total, card.free)
    if share <= room:
        return
    least, most = vllm_least_share(shape, cfg, card.total), math.floor(room * 100) / 100
    smaller = replace(cfg, rollout=replace(cfg.rollout, vllm_memory=most))
    if most >= least and card.choice(smaller, shape) is not None:
        raise ConfigError("rollout.vllm_memory", f"{share:g} of the card for vLLM does not fit beside the training "
                          f"state (weights, AdamW state, ...) in {card.where()}: set it to at most {most:.2f}")
    over = over_fixed([line for line in lines if line.name not in GENERATING], card.free)
    why = [] if over is None else [f"the {over.name} moment alone: {over.fixed / GIB:.1f} GiB"]
    if most < least:
        needed = math.ceil(least * 100) / 100
        why.append(f"at most {max(most, 0):.2f} of the card is left beside the training state while vLLM generates, "
                   f"less than vLLM's bfloat16 weights and one sequence's KV cache need ({needed:.2f} of the card)")
    if not why:  # the share fits, the rest of the run does not
        why.append(no_fit_reason(*card.lines(smaller, shape)[1:], card.free))
    raise ConfigError("rollout.vllm_memory", f"no share of the card for vLLM fits in {card.where()} "
                      f"({'; '.join(why)}); {advice(cfg, card, shape, lines, need)}")


def advice(cfg: Config, card: Card, shape: ModelShape, lines: list[Line], need: Need) -> str:
    """What fits this card by the estimate (module docstring), as the end of a refusal."""
    vllm = cfg.rollout.engine == "vllm"
    training = [line for line in lines if not (vllm and line.name in GENERATING)]  # vLLM's share is no model's
    found = [*settings_that_fit(cfg, card, shape), *_bounds(shape, training, need, card)]
    return f"what fits by the estimate: {', '.join(found)}" if found else "no setting the estimate knows fits it"


def settings_that_fit(cfg: Config, card: Card, shape: ModelShape) -> list[str]:
    """Each setting that would make auto find a budget on this card, with that budget: 'LoRA (...: auto would
    choose N)'."""
    tries: list[tuple[str, Config, ModelShape | None]] = []
    if cfg.model.lora.r == 0:
        lora = replace(cfg.model, dtype="bfloat16", lora=replace(cfg.model.lora, r=LORA_RANK))
        tries.append((f"LoRA (model.lora.r={LORA_RANK}, model.dtype=bfloat16: ", replace(cfg, model=lora), None))
    if cfg.model.gradient_checkpointing == "off":
        on = replace(cfg, model=replace(cfg.model, gradient_checkpointing="on"))
        tries.append(("model.gradient_checkpointing=on (", on, shape))
    found = []
    for prefix, changed, changed_shape in tries:
        chosen = card.choice(changed, changed_shape)
        if chosen is not None:
            found.append(f"{prefix}auto would choose {chosen:,})")
    rows = _most_rows(cfg, card, shape)
    return found + ([rows] if rows else [])


def _most_rows(cfg: Config, card: Card, shape: ModelShape) -> str | None:
    """The most rows per generate call, in whole groups below rollout.generation_batch_size, with which auto finds
    a budget (None: none; vLLM's generation is its share, not rows)."""
    if cfg.rollout.engine == "vllm":
        return None
    group = cfg.rollout.group_size
    for fewer in range((cfg.rollout.generation_batch_size - 1) // group * group, 0, -group):
        chosen = card.choice(replace(cfg, rollout=replace(cfg.rollout, generation_batch_size=fewer)), shape)
        if chosen is not None:
            return f"rollout.generation_batch_size={fewer} (auto would choose {chosen:,})"
    return None


def _bounds(shape: ModelShape, lines: list[Line], need: Need, card: Card) -> list[str]:
    """A smaller model's bound when a fixed moment is over (its bytes per parameter), else the longest sequence
    the growing moments hold."""
    over = over_fixed(lines, card.free)
    if over is not None:
        per = over.fixed / shape.parameters
        return [f"a model of at most about {usable(card.free) / per / 1e9:.2f}B parameters (the {over.name} "
                f"moment's {per:.0f} bytes a parameter)"]
    most = most_tokens(lines, card.free)
    if 0 < most < need.floor:
        return [f"sequences of at most {most:,} tokens (the longest prompt + rollout.max_new_tokens: {need.floor:,} "
                "here)"]
    return []


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
        _, lines, need = this_card(cfg, accelerator, longest).lines(cfg)
    except AttributeError:  # a config the memory model cannot read (GPT-2's names no intermediate_size): none
        return None
    tokens = budget if budget is not None else cfg.train.micro_batch_tokens
    if not tokens:
        tokens = Setting.from_config(cfg, cuda=True, prompt_tokens=longest).tokens
    return peak_at(lines, need, tokens)[0]
