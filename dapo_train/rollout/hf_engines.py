"""The built-in rollout engines, over a transformers model (engines.py: the interface and the registry).

- `hf` (default): DecodeLoopEngine, decoding.decode_loop over the model's forward; or, when
  `rollout.compile` is on (auto: with CUDA, unless rollout.tools are named), StaticCacheEngine,
  transformers' static-cache generate on batch rows bucketed to powers of two (the decode loop where its
  compile cannot run: compiled.py).
- `hf-generate`: GenerateEngine, plain `model.generate` on G copies of each prompt: the reference.

On CUDA they sample from a copy of the weights in rollout.dtype (bfloat16), refreshed after every step's
updates. Only the decode loop runs tools (supports_tools). A generate call out of memory is decoded again in
calls of half the rows, with the same draws, and the smaller size stays (`generation_rows`, fitting.py).
"""

from __future__ import annotations

import copy
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from dapo_train.rollout.compiled import compile_failure_types, compiles, say_fallback
from dapo_train.rollout.completions import Completion, group_rows, sample_completions
from dapo_train.rollout.decoding import Decoded, decode_loop, decode_region, generate_rows
from dapo_train.rollout.engines import EngineSetup, register_engine
from dapo_train.rollout.fitting import GenerationRows, random_state, set_random_state
from dapo_train.rollout.sampling import SamplingSettings

logger = logging.getLogger(__name__)


ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rollout_dtype(setting: str, device: torch.device) -> torch.dtype:
    """rollout.dtype -> the dtype the rollout's weights use. auto: bfloat16 on CUDA, float32 elsewhere."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return ROLLOUT_DTYPES[setting]


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with its parameters and saved buffers in `dtype`, as from_pretrained(dtype=...) would load
    it: buffers that are not saved (the rotary inv_freq) are computed at init, in float32, and keep their
    dtype; `module.to(dtype)` would cast them too (bf16 inv_freq: 0.09 rad of rotary angle at position 500)."""
    kept = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()
            if buffer is not None and name in module._non_persistent_buffers_set]
    model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    return model


def _rollout_copy(model: torch.nn.Module, setting: str) -> torch.nn.Module | None:
    """A frozen copy of `model` in rollout.dtype, or None when that is the training weights' dtype."""
    dtype = rollout_dtype(setting, next(model.parameters()).device)
    if dtype == next(model.parameters()).dtype:
        return None
    frozen = cast_as_loaded(copy.deepcopy(model), dtype).eval().requires_grad_(False)
    logger.info("rollout: sampling from a %s copy of the weights, refreshed after every step's updates",
                str(dtype).removeprefix("torch."))
    return frozen


class TransformersEngine(ABC):
    """Base of the transformers engines: the rollout model (the training model, or its copy in
    rollout.dtype, synced after each update) sampled through sample_completions; a subclass decodes."""

    supports_tools = False  # whether it runs rollout.tools (RolloutEngine.generate)

    def __init__(self, setup: EngineSetup) -> None:
        self.model, self.tokenizer = setup.model, setup.tokenizer
        self.generation_rows = GenerationRows(setup.batch_size)  # halved by a call out of memory (fitting.py)
        self.copy = _rollout_copy(setup.model, setup.dtype)
        self.compute_dtype = setup.compute_dtype
        if setup.tools is not None and not self.supports_tools:
            raise ValueError(f"{type(self).__name__} cannot run tools")
        self.tools = setup.tools

    @property
    def rollout_model(self) -> torch.nn.Module:
        """The weights the engine samples from."""
        return self.copy if self.copy is not None else self.model

    def decoding(self):
        """A context holding the rollout model for one generate call (or eval), in the precision it decodes in:
        decoding.decode_region, one autocast region over float32 weights under mixed precision."""
        return decode_region(self.rollout_model, self.compute_dtype)

    def sync_weights(self) -> None:
        if self.copy is None:
            return
        with torch.no_grad():
            for target, source in zip(self.copy.parameters(), self.model.parameters()):
                target.copy_(source)

    keyed_draws = False  # whether generate takes seeds (one random stream per row)

    def generate(self, prompts, settings: SamplingSettings, group_size: int,
                 seeds: Sequence[int] | None = None) -> list[Completion]:
        if seeds is not None and not self.keyed_draws:
            raise ValueError(f"{type(self).__name__} draws from the global random stream: it takes no seeds")
        with self.decoding() as model:
            return sample_completions(model, self.tokenizer, prompts, settings, batch_size=self.generation_rows,
                                      group_size=group_size, decode=self.decode, seeds=seeds)

    @abstractmethod
    def decode(self, model, prompts: list[torch.Tensor], group_size: int, settings: SamplingSettings,
               eos_ids: list[int], pad_id: int) -> Decoded:
        """One chunk of whole groups -> Decoded (B*G rows); see `Decode`."""


class DecodeLoopEngine(TransformersEngine):
    """decoding.decode_loop: each prompt prefilled once for its group, finished rows dropped; with
    seeds, each row drawn from its own stream; with tools, a row that calls them is fed the tool turn."""

    keyed_draws = True
    supports_tools = True

    def decode(self, model, prompts, group_size, settings, eos_ids, pad_id, seeds=None):
        return decode_loop(model, prompts, group_size, settings, eos_ids, pad_id, seeds, self.tools)


BUCKET_WIDTH = 64  # the static-cache engine pads prompt widths to a multiple of this


def bucket_size(rows: int, limit: int) -> int:
    """The smallest power of two >= rows, capped at max(rows, limit)."""
    size = 1
    while size < rows:
        size *= 2
    return min(size, max(rows, limit))


class StaticCacheEngine(TransformersEngine):
    """transformers' static-cache `generate` (its decode step compiled into CUDA graphs on CUDA) on G
    copies of each prompt. A call's rows are padded up to a power of two (at most batch_size) with
    copies of its first row, whose outputs are dropped, and the prompt width up to a multiple of
    BUCKET_WIDTH, so the compiled step sees few distinct shapes. A compile that fails (compiled.py) gives way,
    once, to the decode loop over the same weights, from the random state the call began with."""

    eager = False  # the compile failed: the decode loop decodes from then on

    def decode(self, model, prompts, group_size, settings, eos_ids, pad_id):
        if not self.eager:
            state = random_state(next(model.parameters()).device)
            try:
                return self._static_decode(model, prompts, group_size, settings, eos_ids, pad_id)
            except compile_failure_types() as failure:
                self.eager = True
                say_fallback("the static-cache engine", failure)
            set_random_state(state, next(model.parameters()).device)
        return decode_loop(model, prompts, group_size, settings, eos_ids, pad_id)

    def _static_decode(self, model, prompts, group_size, settings, eos_ids, pad_id):
        rows = group_rows(prompts, group_size)
        padded = rows + [rows[0]] * (bucket_size(len(rows), self.generation_rows.limit) - len(rows))
        decoded = generate_rows(model, padded, settings, eos_ids, pad_id, width_multiple=BUCKET_WIDTH,
                                cache_implementation="static")
        kept = decoded.kept_log_mass
        return Decoded(decoded.ids[: len(rows)], decoded.behaviour_logprobs[: len(rows)],
                       None if kept is None else kept[: len(rows)])


@register_engine("hf-generate")
class GenerateEngine(TransformersEngine):
    """Plain `model.generate` on G copies of each prompt: the reference semantics."""

    def decode(self, model, prompts, group_size, settings, eos_ids, pad_id):
        return generate_rows(model, group_rows(prompts, group_size), settings, eos_ids, pad_id)


@register_engine("hf")
def hf_engine(setup: EngineSetup) -> TransformersEngine:
    """rollout.engine=hf: the static-cache engine when rollout.compile is on (auto: on with CUDA, unless tools
    are named: only the decode loop runs them), else the decode loop. One name for both: rollout.compile is
    the switch users already have."""
    cuda = next(setup.model.parameters()).device.type == "cuda"
    wanted = setup.compile == "on" or (setup.compile == "auto" and cuda and setup.tools is None)
    return StaticCacheEngine(setup) if compiles(wanted, cuda, "the hf engine") else DecodeLoopEngine(setup)


hf_engine.supports_tools = True  # with tools it is the decode loop (require_tool_support refuses compile=on)
