"""Decoding with a transformers model: prompt ids in, generated ids and behaviour log-probs out.

The token-level work behind hf_engines.py's transformers engines (which add the chunking, the records
and the rollout weights):

- `decode_loop`: a loop over the model's forward. Each prompt is prefilled ONCE and its KV cache
  repeated for its G completions; rows leave the batch (and the cache) as soon as they emit EOS, and
  the cache's layers are preallocated, so no step copies the cache or works on finished rows.
- `generate_rows`: `model.generate` on rows given as they are (G copies of each prompt), with the
  behaviour log-probs recorded while it runs (BehaviourRecorder) at O(N x V) memory.

Both return a `Decoded` on the CPU (ids padded after the first EOS, behaviour log-probs, and under
top-k / top-p the log of the mass the truncation kept), row b*G + g being prompt b's g-th completion.
The distribution they sample from and record, and the token draw, are sampling.py's.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from dapo_train.model.layout import padded_position_ids
from dapo_train.rollout.sampling import SamplingSettings, draw_tokens, sampling_distribution
from dapo_train.rollout.tool_rows import ToolRows
from dapo_train.tools.turns import ToolTurns

Tensor = torch.Tensor


@dataclass
class Decoded:
    """What a decoder returns for N rows, on the CPU. T = the longest row's tokens."""

    ids: Tensor  # (N, T) generated ids, padded after the first EOS (with tools: after `lengths`)
    behaviour_logprobs: Tensor  # (N, T) float32 under the distribution sampled from
    kept_log_mass: Tensor | None = None  # (N, T) float32 log of the mass top-k / top-p kept; None: no truncation
    # With tools (rollout/tool_rows.py) a transcript holds EOS ids before its end, so its extent is given:
    lengths: Tensor | None = None  # (N,) long valid tokens per row; None: up to the first EOS
    truncated: Tensor | None = None  # (N,) bool; None: no EOS within the budget
    over_calls: Tensor | None = None  # (N,) bool: ended by a turn past rollout.max_tool_calls; None: none did
    policy_mask: Tensor | None = None  # (N, T) bool, False on the tool turns' forced tokens; None: all True
    tool_calls: list[list] | None = None  # per row, its tools.turns.ToolCall in order


def _picked(distribution: Tensor, tokens: Tensor) -> Tensor:
    """distribution (A, V), tokens (A,) -> (A,) the tokens' entries."""
    return distribution.gather(-1, tokens[:, None])[:, 0]


def left_pad(sequences: Sequence[Tensor], pad_id: int, multiple: int = 1) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D id tensors -> (ids (B, P), attention_mask (B, P)); P is rounded up to `multiple`."""
    width = -(-max(int(s.numel()) for s in sequences) // multiple) * multiple
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq.numel():
            ids[row, width - seq.numel() :] = seq
            mask[row, width - seq.numel() :] = 1
    return ids, mask


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


@contextmanager
def decode_region(model, compute_dtype: torch.dtype | None):
    """One generate call's precision: over float32 weights with a compute dtype (train.mixed_precision's autocast),
    one autocast region for the whole call, so autocast's cache casts each weight once per call and serves every
    decode step after the first (accelerate wraps each forward in a region of its own, whose cache ends with the
    forward: a recast of every weight per token). Weights already in a low precision (the rollout's copy) or no
    compute dtype: nothing to do."""
    weights = next(model.parameters())
    if compute_dtype is None or weights.dtype != torch.float32:
        yield model
        return
    with torch.autocast(weights.device.type, dtype=compute_dtype):
        yield model


def _cache_dtype(keys: Tensor) -> torch.dtype:
    """The element dtype a decode's KV cache holds: under autocast its compute dtype (the attention reads keys
    and values in it; RoPE would otherwise leave the keys in float32, 1.5x the cache the memory model counts),
    else the keys' own."""
    device = keys.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else keys.dtype


def _preallocate(cache, extra: int) -> None:
    """Give each plain dynamic layer of `cache` room for `extra` more tokens, so a decode step writes
    its keys in place instead of concatenating (copying) the whole cache each step, in the compute dtype
    (_cache_dtype). Other cache types (sliding windows, hybrid models, older transformers) are left as they are."""
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
        dtype = _cache_dtype(layer.keys)
        self._keys = layer.keys.new_empty((batch, heads, length + extra, dim), dtype=dtype)
        self._values = layer.values.new_empty((batch, heads, length + extra, layer.values.shape[-1]), dtype=dtype)
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

    def batch_select_indices(self, indices: Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._views()


@torch.no_grad()
def decode_loop(
    model, prompts: list[Tensor], group_size: int, settings: SamplingSettings, eos_ids: list[int], pad_id: int,
    seeds: Sequence[int] | None = None, tools: ToolTurns | None = None,
) -> Decoded:
    """Sample group_size completions for each prompt -> Decoded (B*G rows).

    The prompts are prefilled once (B rows); the cache, last logits and mask are then repeated G
    times. After each token, rows that emitted EOS are dropped from the batch and the cache. seeds:
    one per row, each row drawing from its own generator (draw_tokens), else the global stream.
    tools: a row whose assistant turn ends with calls goes on, fed the tool turn (tool_rows.py)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id)  # (B, P)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=padded_position_ids(attention_mask),
                use_cache=True, logits_to_keep=1)
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
    logprobs = torch.zeros((rows, budget), dtype=torch.float32, device=device)
    kept = torch.zeros((rows, budget), dtype=torch.float32, device=device) if settings.truncates(logits.shape[-1]) \
        else None
    active = torch.arange(rows, device=device)  # original row of each batch row
    next_position = attention_mask.sum(dim=1)  # (A,) position id of the token being sampled
    eos = torch.tensor(eos_ids, device=device)
    generators = None if seeds is None else [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    tool_rows = None if tools is None else ToolRows(tools, rows, budget)
    for step in range(budget):
        distribution, mass = sampling_distribution(logits.float(), settings)  # (A, V), (A,) or None
        sampled = settings.do_sample
        own = None if generators is None else [generators[row] for row in active.tolist()]
        tokens = draw_tokens(distribution, settings.top_k, own) if sampled else distribution.argmax(dim=-1)  # (A,)
        forced = None if tool_rows is None else tool_rows.force(active.tolist(), tokens, step)  # (A,) bool
        generated[active, step] = tokens
        picked = _picked(distribution, tokens)  # (A,)
        logprobs[active, step] = picked if forced is None else picked.masked_fill(forced, 0.0)
        if kept is not None:
            kept[active, step] = mass if forced is None else mass.masked_fill(forced, 0.0)
        running = ~torch.isin(tokens, eos)  # (A,)
        if tool_rows is not None:
            running = tool_rows.running(active.tolist(), ~running, forced, step, generated)
        if step == budget - 1:
            break
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
    decoded = Decoded(generated.cpu(), logprobs.cpu(), None if kept is None else kept.cpu())
    if tool_rows is not None:
        decoded.lengths, decoded.truncated, decoded.over_calls = tool_rows.lengths, tool_rows.truncated, \
            tool_rows.over_calls
        decoded.policy_mask, decoded.tool_calls = tool_rows.policy_mask, tool_rows.calls
    return decoded


# ---------------------------------------------------------------- model.generate


class BehaviourRecorder(LogitsProcessor):
    """The one logits processor of `generate`: turns each step's scores into the behaviour distribution
    (temperature, top-k, top-p: behaviour_distribution) and hands it back for generate to sample from,
    recording the log-prob of each token it picks. It holds one step's distribution (N, V) instead of
    every step's logits (`output_logits` keeps (N, T, V): gigabytes at Qwen's vocabulary).

    generate runs its own processors first and its warpers after the user's; with the fresh
    generation config of SamplingSettings.generation_config it has neither, so this sees the float32
    logits and its output is what generate samples from. The newest column of input_ids is the token
    picked from the previous step's distribution; the last one is looked up once generate has returned."""

    def __init__(self, settings: SamplingSettings) -> None:
        self.settings = settings
        self.distribution: Tensor | None = None  # (N, V) the latest step's
        self.picked: list[Tensor] = []  # (N,) one per token whose successor was scored
        self.kept: list[Tensor] = []  # (N,) the kept log-mass of every step scored (truncation only)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.distribution is not None:
            self.picked.append(_picked(self.distribution, input_ids[:, -1]))
        self.distribution, mass = sampling_distribution(scores, self.settings)
        if mass is not None:
            self.kept.append(mass)
        return self.distribution

    def decoded(self, generated: Tensor) -> Decoded:
        """generated (N, T), on the model's device -> Decoded, on the CPU."""
        width = generated.shape[1]
        picked = self.picked[:width]  # generate may have undone steps it had scored
        if len(picked) < width:
            picked.append(_picked(self.distribution, generated[:, len(picked)]))
        kept = torch.stack(self.kept[:width], dim=1).cpu() if self.kept else None
        return Decoded(generated.cpu(), torch.stack(picked, dim=1).cpu(), kept)


@contextmanager
def _generation_config(model, config):
    """generate fills every field a passed config leaves unset from the model's own generation_config:
    the model holds `config` meanwhile, so nothing of the checkpoint's reaches the rollout."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT generates with the base
    saved = base.generation_config
    base.generation_config = config
    try:
        yield
    finally:
        base.generation_config = saved


@torch.no_grad()
def generate_rows(
    model, rows: list[Tensor], settings: SamplingSettings, eos_ids: list[int], pad_id: int, *,
    width_multiple: int = 1, **generate_kwargs,
) -> Decoded:
    """`model.generate` on rows, left-padded to a multiple of width_multiple (generate_kwargs passed
    on) -> Decoded (N rows)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(rows, pad_id, width_multiple)
    recorder = BehaviourRecorder(settings)
    config = settings.generation_config(eos_ids, pad_id)
    model_kwargs = config.update(**generate_kwargs)  # generation fields (cache_implementation) go in the config
    with _generation_config(model, config):
        sequences = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config,
            logits_processor=LogitsProcessorList([recorder]), **model_kwargs,
        )
    return recorder.decoded(sequences[:, input_ids.shape[1] :])  # (N, T)
