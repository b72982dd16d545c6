"""Rollout: prompts -> sampled completions with exact token masks.

Batched, left-padded `generate` (never one prompt at a time), with the sampling settings passed
explicitly: a checkpoint's generation_config (Qwen2.5 ships a repetition penalty and its own
top_p/top_k) must not silently change the distribution the loss assumes.

A completion's valid tokens run up to AND including the first EOS, where EOS is any id of the
model's generation_config.eos_token_id. Qwen's pad id (<|endoftext|>) is also an EOS id, so the
mask is found from the first EOS position, never by comparing with the pad id. A row with no EOS
within max_new_tokens is truncated. The EOS is in the loss, so the model learns to stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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


@dataclass
class Completion:
    """One sampled completion. L = number of valid tokens (EOS included when present)."""

    prompt_ids: torch.Tensor  # (P,) the prompt's tokens, no padding
    completion_ids: torch.Tensor  # (L,) valid generated tokens, no padding
    truncated: bool  # no EOS within max_new_tokens
    text: str  # decoded completion, special tokens skipped
    generation_logprobs: torch.Tensor | None = None  # (L,) from generate's raw logits / temperature

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


def left_pad(sequences: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors -> (ids (B, P), attention_mask (B, P))."""
    width = max(int(s.numel()) for s in sequences)
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


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: SamplingSettings,
    *,
    batch_size: int,
    return_logprobs: bool = False,
) -> list[Completion]:
    """Generate one completion per entry of `prompts` (repeat a prompt G times for a group).

    Rows are batched `batch_size` at a time with left padding. With return_logprobs, each
    completion carries the log-probs of its tokens under the raw logits / temperature, the
    distribution the loss assumes (used by tests to check scoring against generation).
    """
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(model, tokenizer)
    device = next(model.parameters()).device
    results: list[Completion] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts[start : start + batch_size]]
        input_ids, attention_mask = left_pad(chunk, pad_id)
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=return_logprobs,
            **settings.generate_kwargs(),
        )
        generated = output.sequences[:, input_ids.shape[1] :].cpu()  # (B, T)
        mask, truncated = completion_mask(generated, eos_ids)
        token_logprobs = _generation_logprobs(output.logits, generated, settings) if return_logprobs else None
        lengths = mask.sum(dim=1).tolist()
        valid = [generated[row, :length] for row, length in enumerate(lengths)]
        texts = tokenizer.batch_decode(valid, skip_special_tokens=True)
        for row, ids in enumerate(valid):
            results.append(
                Completion(
                    prompt_ids=chunk[row],
                    completion_ids=ids,
                    truncated=bool(truncated[row]),
                    text=texts[row],
                    generation_logprobs=None if token_logprobs is None else token_logprobs[row, : lengths[row]],
                )
            )
    return results


def _generation_logprobs(
    logits: Sequence[torch.Tensor], generated: torch.Tensor, settings: SamplingSettings
) -> torch.Tensor:
    """Per-token log-probs from generate's raw logits (T tensors of (B, V)) -> (B, T) float32."""
    temperature = settings.temperature if settings.do_sample else 1.0
    stacked = torch.stack([step.float().cpu() for step in logits], dim=1) / temperature  # (B, T, V)
    return torch.log_softmax(stacked, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
