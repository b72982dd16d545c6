"""Decoding with a transformers model: prompt ids in, generated ids and behaviour log-probs out.

The token-level work behind rollout.py's transformers engines (which add the chunking, the records
and the rollout weights):

- `decode_loop`: a loop over the model's forward. Each prompt is prefilled ONCE and its KV cache
  repeated for its G completions; rows leave the batch (and the cache) as soon as they emit EOS, and
  the cache's layers are preallocated, so no step copies the cache or works on finished rows.
- `generate_rows`: `model.generate` on rows given as they are (G copies of each prompt), with the
  behaviour log-probs recorded while it runs (BehaviourRecorder) at O(N x V) memory.

Both return (generated (N, T) ids, padded after the first EOS; behaviour log-probs (N, T) float32)
on the CPU, row b*G + g being prompt b's g-th completion. The behaviour log-prob of a token is taken
from `behaviour_distribution`, the one definition every engine records.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from dapo_train.logprobs import padded_position_ids

Tensor = torch.Tensor


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
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList()
        if self.do_sample:
            if self.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k > 0:
                warpers.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


def behaviour_distribution(scores: Tensor, settings: SamplingSettings) -> Tensor:
    """The log-probs an engine records for its sampled tokens: raw logits (A, V) float32 -> (A, V).

    log_softmax(logits / temperature), the distribution the loss assumes (greedy: temperature 1)."""
    temperature = settings.temperature if settings.do_sample else 1.0
    return torch.log_softmax(scores / temperature, dim=-1)


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


def draw_tokens(scores: Tensor, warpers) -> Tensor:
    """One token per row from softmax(warpers(scores)), scores (A, V) float32 -> (A,) ids.

    The Gumbel-max trick, argmax(s - log E) with E ~ Exp(1): the categorical distribution that
    generate's multinomial draws from, in one cheap pass (filtered tokens stay at -inf)."""
    warped = warpers(None, scores)
    return (warped - torch.empty_like(warped).exponential_().log()).argmax(dim=-1)


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

    def batch_select_indices(self, indices: Tensor) -> None:
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._views()


@torch.no_grad()
def decode_loop(
    model, prompts: list[Tensor], group_size: int, settings: SamplingSettings, eos_ids: list[int], pad_id: int,
) -> tuple[Tensor, Tensor]:
    """Sample group_size completions for each prompt -> (generated (B*G, T), behaviour log-probs (B*G, T)).

    The prompts are prefilled once (B rows); the cache, last logits and mask are then repeated G
    times. After each token, rows that emitted EOS are dropped from the batch and the cache."""
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
    active = torch.arange(rows, device=device)  # original row of each batch row
    next_position = attention_mask.sum(dim=1)  # (A,) position id of the token being sampled
    eos = torch.tensor(eos_ids, device=device)
    warpers = settings.warpers()
    for step in range(budget):
        scores = logits.float()  # (A, V)
        tokens = draw_tokens(scores, warpers) if settings.do_sample else scores.argmax(dim=-1)  # (A,)
        generated[active, step] = tokens
        logprobs[active, step] = _picked(behaviour_distribution(scores, settings), tokens)
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
    return generated.cpu(), logprobs.cpu()


# ---------------------------------------------------------------- model.generate


class BehaviourRecorder(LogitsProcessor):
    """Records, while `generate` runs, the behaviour log-prob of each token it picks, holding one step's
    distribution (N, V) instead of every step's logits (`output_logits` keeps (N, T, V): gigabytes at
    Qwen's vocabulary).

    generate calls a user-supplied processor on each step's float32 logits before its temperature,
    top-k and top-p warpers (transformers' _get_logits_processor appends those after the user's), so
    this sees the raw logits; the newest column of input_ids is the token picked from the previous
    step's distribution, and the last token is looked up once generate has returned."""

    def __init__(self, settings: SamplingSettings) -> None:
        self.settings = settings
        self.distribution: Tensor | None = None  # (N, V) the latest step's
        self.picked: list[Tensor] = []  # (N,) one per token whose successor was scored

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.distribution is not None:
            self.picked.append(_picked(self.distribution, input_ids[:, -1]))
        self.distribution = behaviour_distribution(scores, self.settings)
        return scores

    def logprobs(self, generated: Tensor) -> Tensor:
        """generated (N, T), on the model's device -> behaviour log-probs (N, T)."""
        picked = self.picked[: generated.shape[1]]  # generate may have undone steps it had scored
        if len(picked) < generated.shape[1]:
            picked.append(_picked(self.distribution, generated[:, len(picked)]))
        return torch.stack(picked, dim=1)


@torch.no_grad()
def generate_rows(
    model, rows: list[Tensor], settings: SamplingSettings, eos_ids: list[int], pad_id: int, *,
    width_multiple: int = 1, **generate_kwargs,
) -> tuple[Tensor, Tensor]:
    """`model.generate` on rows, left-padded to a multiple of width_multiple (generate_kwargs passed
    on) -> (generated (N, T), behaviour log-probs (N, T))."""
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(rows, pad_id, width_multiple)
    recorder = BehaviourRecorder(settings)
    sequences = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), eos_token_id=eos_ids,
        pad_token_id=pad_id, logits_processor=LogitsProcessorList([recorder]), **settings.generate_kwargs(),
        **generate_kwargs,
    )
    generated = sequences[:, input_ids.shape[1] :]  # (N, T)
    return generated.cpu(), recorder.logprobs(generated).cpu()
