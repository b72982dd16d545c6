"""Rollout: prompts -> sampled completions with exact token masks, behind an engine interface.

`collect` talks to a RolloutEngine (generate G completions for each prompt; take new weights after
each step's updates), chosen by `rollout.engine` from ROLLOUT_ENGINES. Built in:

- `hf` (default): a decode loop over the transformers model's forward. Each prompt is prefilled
  ONCE and its KV cache repeated for its G completions; rows leave the batch (and the cache) as
  soon as they emit EOS, so no work is spent on finished rows. On CUDA it samples from a bfloat16
  copy of the weights, refreshed after every step's updates, and with `rollout.compile` it runs
  transformers' static-cache, compiled (CUDA-graph) decode instead, batch rows bucketed to powers
  of two so dynamic sampling's rounds reuse a few compiled shapes.
- `hf-generate`: plain `model.generate` on G copies of each prompt: the reference the loop is
  tested against.

Another engine (vLLM, SGLang, ...) is one module: a class with the two methods of RolloutEngine,
registered with `@register_engine("name")` (or named in the config as 'pkg.module:Class'). It gets
the unwrapped model and the tokenizer, and must keep the semantics below.

Semantics every engine keeps: the sampling settings are passed explicitly (a checkpoint's
generation_config, e.g. Qwen2.5's repetition penalty and top_p/top_k, must not silently change the
distribution the loss assumes); a completion's valid tokens run up to AND including the first EOS,
where EOS is any id of generation_config.eos_token_id or the tokenizer's (Qwen's pad id is also an
EOS id, so masks come from the first EOS position, never from comparing with the pad id); a row
with no EOS within max_new_tokens is truncated. The EOS is in the loss, so the model learns to stop.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """Everything that shapes the sampling distribution, passed to generate explicitly."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def generate_kwargs(self) -> dict:
        kwargs = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample, "repetition_penalty": 1.0}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:
            # Greedy ignores these, but the checkpoint's values would make generate warn: set the
            # neutral values its validation expects (top_k 50 is its "unset").
            kwargs.update(temperature=1.0, top_p=1.0, top_k=50)
        return kwargs

    def warpers(self):
        """The logits warpers `generate` applies for these settings, in its order (temperature,
        top-k, top-p); an empty list for greedy decoding."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList()
        if self.do_sample:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                warpers.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


@dataclass
class Completion:
    """One sampled completion. L = number of valid tokens (EOS included when present)."""

    prompt_ids: torch.Tensor  # (P,) the prompt's tokens, no padding
    completion_ids: torch.Tensor  # (L,) valid generated tokens, no padding
    truncated: bool  # no EOS within max_new_tokens
    text: str  # decoded completion, special tokens skipped
    generation_logprobs: torch.Tensor | None = None  # (L,) from the raw logits / temperature

    @property
    def length(self) -> int:
        return int(self.completion_ids.numel())


def eos_token_ids(model, tokenizer) -> list[int]:
    """All ids that end a completion: generation_config.eos_token_id (int or list) + tokenizer's."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if value is None:
            continue
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    if not ids:
        raise ValueError(
            "the model defines no EOS token id (generation_config.eos_token_id and tokenizer.eos_token_id are unset)"
        )
    return ids


def pad_token_id(model, tokenizer) -> int:
    """Padding id for batched generation: the tokenizer's pad, else the generation config's, else EOS."""
    for value in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None)):
        if value is not None:
            return int(value)
    return eos_token_ids(model, tokenizer)[0]


def left_pad(sequences: Sequence[torch.Tensor], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors -> (ids (B, P), attention_mask (B, P)); P is rounded up to `multiple`."""
    width = -(-max(int(s.numel()) for s in sequences) // multiple) * multiple
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq.numel():
            ids[row, width - seq.numel() :] = seq
            mask[row, width - seq.numel() :] = 1
    return ids, mask


def completion_mask(generated: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid-token mask of generated ids: up to and including the first EOS.

    generated (N, T) -> (mask (N, T) long, truncated (N,) bool). Tokens after the first EOS
    (padding, which may itself be an EOS id) are 0; a row without EOS is all 1 and truncated.
    """
    is_eos = torch.isin(generated, torch.tensor(list(eos_ids), device=generated.device))  # (N, T)
    seen_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS count strictly before t
    mask = (seen_before == 0).long()  # (N, T)
    truncated = ~is_eos.any(dim=1)  # (N,)
    return mask, truncated


def _completions(
    prompts: Sequence[torch.Tensor], generated: torch.Tensor, eos_ids, tokenizer, logprobs: torch.Tensor | None
) -> list[Completion]:
    """Generated ids (N, T) of N rows (row i continues prompts[i]) -> Completions."""
    mask, truncated = completion_mask(generated, eos_ids)
    lengths = mask.sum(dim=1).tolist()
    valid = [generated[row, :length] for row, length in enumerate(lengths)]
    texts = tokenizer.batch_decode(valid, skip_special_tokens=True)
    return [
        Completion(
            prompt_ids=prompts[row], completion_ids=ids, truncated=bool(truncated[row]), text=texts[row],
            generation_logprobs=None if logprobs is None else logprobs[row, : lengths[row]].clone(),
        )
        for row, ids in enumerate(valid)
    ]


def _prompt_chunks(prompts: Sequence[Sequence[int]], group_size: int, batch_size: int) -> list[list[torch.Tensor]]:
    """Prompts in order, cut so that a chunk's rows (prompts x group_size) stay within batch_size."""
    per_chunk = max(1, batch_size // group_size)
    tensors = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
    return [tensors[start : start + per_chunk] for start in range(0, len(tensors), per_chunk)]


# ---------------------------------------------------------------- the decode loop


def _cache_keyword(model) -> str:
    """The forward's KV-cache argument: `cache` (transformers >= 5.2x) or `past_key_values` (before).
    Read from the transformers model itself: a PEFT wrapper's forward takes **kwargs."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _output_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


try:
    from transformers.cache_utils import DynamicLayer as _DynamicLayer
except ImportError:  # transformers without per-layer caches: _preallocate does nothing
    _DynamicLayer = None


def _preallocate(cache, extra: int) -> None:
    """Give each plain dynamic layer of `cache` room for `extra` more tokens, so a decode step writes
    its keys in place instead of concatenating (copying) the whole cache each step. Other cache types
    (sliding windows, hybrid models, older transformers) are left as they are."""
    if _DynamicLayer is None:
        return
    for index, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is _DynamicLayer and layer.is_initialized and layer.get_seq_length() > 0:
            cache.layers[index] = _GrowingLayer(layer, extra)


class _GrowingLayer(_DynamicLayer or object):
    """A dynamic cache layer over a preallocated buffer: keys/values are views of its first `length` slots."""

    def __init__(self, layer, extra: int) -> None:
        super().__init__()
        batch, heads, length, dim = layer.keys.shape
        self.device, self.is_initialized, self.length = layer.keys.device, True, length
        self._keys = layer.keys.new_empty((batch, heads, length + extra, dim))
        self._values = layer.values.new_empty((batch, heads, length + extra, layer.values.shape[-1]))
        self._keys[:, :, :length], self._values[:, :, :length] = layer.keys, layer.values
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        end = self.length + key_states.shape[-2]  # the decode loop never writes past the room it reserved
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keys = self._keys.repeat_interleave(repeats, dim=0)
        self._values = self._values.repeat_interleave(repeats, dim=0)
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._views()


def draw_tokens(scores: torch.Tensor, warpers) -> torch.Tensor:
    """One token per row from softmax(warpers(scores)), scores (A, V) float32 -> (A,) ids.

    The Gumbel-max trick, argmax(s - log E) with E ~ Exp(1): the categorical distribution that
    generate's multinomial draws from, in one cheap pass (filtered tokens stay at -inf)."""
    warped = warpers(None, scores)
    return (warped - torch.empty_like(warped).exponential_().log()).argmax(dim=-1)


@torch.no_grad()
def _sample_chunk(
    model, prompts: list[torch.Tensor], group_size: int, settings: SamplingSettings, eos_ids: list[int], pad_id: int,
    return_logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample group_size completions for each prompt. -> (generated (B*G, T) ids, pad after the
    first EOS; log-probs (B*G, T) or None). Row b*G + g is prompt b's g-th completion.

    The prompts are prefilled once (B rows); the cache, last logits and mask are then repeated G
    times. After each token, rows that emitted EOS are dropped from the batch and the cache."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id)  # (B, P)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # as generate builds them
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                logits_to_keep=1)
    cache = _output_cache(out)
    logits = out.logits[:, -1, :]  # (B, V)
    _preallocate(cache, settings.max_new_tokens)
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
        logits = logits.repeat_interleave(group_size, dim=0)
        attention_mask = attention_mask.repeat_interleave(group_size, dim=0)
    rows = logits.shape[0]
    budget = settings.max_new_tokens
    generated = torch.full((rows, budget), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, budget), dtype=torch.float32, device=device) if return_logprobs else None
    active = torch.arange(rows, device=device)  # original row of each batch row
    next_position = attention_mask.sum(dim=1)  # (A,) position id of the token being sampled
    eos = torch.tensor(eos_ids, device=device)
    warpers = settings.warpers()
    temperature = settings.temperature if settings.do_sample else 1.0
    for step in range(budget):
        scores = logits.float()  # (A, V)
        tokens = draw_tokens(scores, warpers) if settings.do_sample else scores.argmax(dim=-1)  # (A,)
        generated[active, step] = tokens
        if logprobs is not None:
            logprobs[active, step] = torch.log_softmax(scores / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
        if step == budget - 1:
            break
        running = ~torch.isin(tokens, eos)  # (A,)
        if not bool(running.all()):
            if not bool(running.any()):
                break
            keep = running.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            active, tokens = active[keep], tokens[keep]
            attention_mask, next_position = attention_mask[keep], next_position[keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=attention_mask, position_ids=next_position[:, None],
                    use_cache=True, **{_cache_keyword(model): cache})
        logits = out.logits[:, -1, :]
        next_position = next_position + 1
    return generated.cpu(), None if logprobs is None else logprobs.cpu()


def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    *,
    batch_size: int,
    group_size: int = 1,
    return_logprobs: bool = False,
    via_generate: bool = False,
    bucket: bool = False,
    generate_kwargs: dict | None = None,
) -> list[Completion]:
    """group_size completions for each entry of `prompts`, prompt-major (prompt 0's first).

    Rows are batched `batch_size` at a time (whole groups). With return_logprobs, each completion
    carries the log-probs of its tokens under the raw logits / temperature, the distribution the
    loss assumes (tests check scoring against it). The model should be in eval mode.

    By default the decode loop (_sample_chunk) runs; via_generate uses `model.generate` on
    group_size copies of each prompt instead (generate_kwargs passed on), and with bucket each call's
    rows are padded up to a power of two (at most batch_size) with copies of its first row, whose
    outputs are dropped, and the prompt width up to a multiple of BUCKET_WIDTH, so a compiled decode
    sees few distinct shapes.
    """
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(model, tokenizer)
    results: list[Completion] = []
    for chunk in _prompt_chunks(prompts, group_size, batch_size):
        rows = [prompt for prompt in chunk for _ in range(group_size)]
        if via_generate:
            padded = rows + [rows[0]] * (bucket_size(len(rows), batch_size) - len(rows) if bucket else 0)
            generated, logprobs = _generate_chunk(model, padded, settings, eos_ids, pad_id, return_logprobs,
                                                  BUCKET_WIDTH if bucket else 1, generate_kwargs or {})
            generated = generated[: len(rows)]
            logprobs = None if logprobs is None else logprobs[: len(rows)]
        else:
            generated, logprobs = _sample_chunk(model, chunk, group_size, settings, eos_ids, pad_id, return_logprobs)
        results += _completions(rows, generated, eos_ids, tokenizer, logprobs)
    return results


@torch.no_grad()
def _generate_chunk(
    model, rows: list[torch.Tensor], settings: SamplingSettings, eos_ids: list[int], pad_id: int,
    return_logprobs: bool, width_multiple: int, generate_kwargs: dict,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model.generate` on left-padded rows -> (generated (N, T) ids, log-probs (N, T) or None)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(rows, pad_id, width_multiple)
    output = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), eos_token_id=eos_ids,
        pad_token_id=pad_id, return_dict_in_generate=True, output_logits=return_logprobs,
        **settings.generate_kwargs(), **generate_kwargs,
    )
    generated = output.sequences[:, input_ids.shape[1] :].cpu()  # (N, T)
    if not return_logprobs:
        return generated, None
    temperature = settings.temperature if settings.do_sample else 1.0
    stacked = torch.stack([step.float().cpu() for step in output.logits], dim=1) / temperature  # (N, T, V)
    return generated, torch.log_softmax(stacked, dim=-1).gather(-1, generated[..., None])[..., 0]


BUCKET_WIDTH = 64  # prompt widths are padded to a multiple of this in bucketed (compiled) generation


def bucket_size(rows: int, limit: int) -> int:
    """The smallest power of two >= rows, capped at max(rows, limit)."""
    size = 1
    while size < rows:
        size *= 2
    return min(size, max(rows, limit))


# ---------------------------------------------------------------- engines


class RolloutEngine(Protocol):
    """What collect needs from a rollout backend."""

    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, group_size: int
    ) -> list[Completion]:
        """group_size completions per prompt, prompt-major, with the semantics of this module's docstring."""

    def sync_weights(self) -> None:
        """Take the training model's current weights; the trainer calls it after every step's updates."""


@dataclass
class EngineSetup:
    """What an engine factory receives. model: the UNWRAPPED training model (float32 master weights)."""

    model: torch.nn.Module
    tokenizer: object
    batch_size: int  # rollout.generation_batch_size: most sequences per batch
    dtype: str  # rollout.dtype: auto | float32 | bfloat16
    compile: str  # rollout.compile: auto | on | off


ROLLOUT_ENGINES: dict[str, Callable[[EngineSetup], RolloutEngine]] = {}


def register_engine(name: str):
    """Class decorator: make `rollout.engine: <name>` build this engine from an EngineSetup."""

    def register(factory):
        ROLLOUT_ENGINES[name] = factory
        return factory

    return register


def engine_factory(name: str) -> Callable[[EngineSetup], RolloutEngine]:
    """The factory `rollout.engine` names (a registered name or 'pkg.module:Factory'); ConfigError if none.
    Cheap: the trainer calls it before loading the model."""
    from dapo_train.config import import_plugin
    from dapo_train.errors import ConfigError

    if name in ROLLOUT_ENGINES:
        return ROLLOUT_ENGINES[name]
    if ":" in name:
        return import_plugin(name, "rollout.engine")
    raise ConfigError("rollout.engine", f"unknown engine {name!r}; built in: {', '.join(ROLLOUT_ENGINES)}, "
                      "or 'pkg.module:Factory'")


def build_engine(rollout_cfg, model, tokenizer) -> RolloutEngine:
    """The engine of a RolloutConfig for an UNWRAPPED model."""
    setup = EngineSetup(model=model, tokenizer=tokenizer, batch_size=rollout_cfg.generation_batch_size,
                        dtype=rollout_cfg.dtype, compile=rollout_cfg.compile)
    return engine_factory(rollout_cfg.engine)(setup)


ROLLOUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def rollout_dtype(setting: str, device: torch.device) -> torch.dtype:
    """rollout.dtype -> the dtype the rollout's weights use. auto: bfloat16 on CUDA, float32 elsewhere."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return ROLLOUT_DTYPES[setting]


class _HFEngineBase:
    """Shared by the transformers engines: the sampling model, a copy in rollout.dtype when it differs
    from the training weights (synced after each update), eval mode while generating."""

    def __init__(self, setup: EngineSetup) -> None:
        self.model, self.tokenizer, self.batch_size = setup.model, setup.tokenizer, setup.batch_size
        device = next(self.model.parameters()).device
        dtype = rollout_dtype(setup.dtype, device)
        self.copy = None
        if dtype != next(self.model.parameters()).dtype:
            self.copy = copy.deepcopy(self.model).to(dtype).eval().requires_grad_(False)
            logger.info("rollout: sampling from a %s copy of the weights, refreshed after every step's updates",
                        str(dtype).removeprefix("torch."))
        self.compiled = setup.compile == "on" or (setup.compile == "auto" and device.type == "cuda")

    @property
    def sampler(self) -> torch.nn.Module:
        return self.copy if self.copy is not None else self.model

    def sync_weights(self) -> None:
        if self.copy is None:
            return
        with torch.no_grad():
            for target, source in zip(self.copy.parameters(), self.model.parameters()):
                target.copy_(source)

    def generate(self, prompts, settings: SamplingSettings, group_size: int) -> list[Completion]:
        model = self.sampler
        was_training = model.training
        model.eval()  # the KV cache; training mode would turn it off under gradient checkpointing
        try:
            return self._generate(model, prompts, settings, group_size)
        finally:
            model.train(was_training)

    def _generate(self, model, prompts, settings, group_size) -> list[Completion]:
        raise NotImplementedError


@register_engine("hf")
class HFEngine(_HFEngineBase):
    """The decode loop (prefill once per group, finished rows dropped); with rollout.compile, transformers'
    static-cache compiled generate on bucketed batch shapes."""

    def _generate(self, model, prompts, settings, group_size) -> list[Completion]:
        compiled = {"via_generate": True, "bucket": True, "generate_kwargs": {"cache_implementation": "static"}}
        return generate_completions(model, self.tokenizer, prompts, settings, batch_size=self.batch_size,
                                    group_size=group_size, **(compiled if self.compiled else {}))


@register_engine("hf-generate")
class HFGenerateEngine(_HFEngineBase):
    """Plain `model.generate` on G copies of each prompt: the reference semantics."""

    def _generate(self, model, prompts, settings, group_size) -> list[Completion]:
        return generate_completions(model, self.tokenizer, prompts, settings, batch_size=self.batch_size,
                                    group_size=group_size, via_generate=True)
