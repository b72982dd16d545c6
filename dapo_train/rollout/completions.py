"""Completions: the record every rollout engine returns (Completion), built from a decoder's rows, and how the
transformers engines and the evals sample them (sample_completions: calls of whole groups within a row budget).

Semantics every engine keeps: the sampling settings are passed explicitly (a checkpoint's
generation_config, e.g. Qwen2.5's repetition penalty and top_p/top_k, must not silently change the
distribution the loss assumes); a completion's valid tokens run up to AND including the first EOS,
where EOS is any id of generation_config.eos_token_id or the tokenizer's (Qwen's pad id is also an
EOS id, so masks come from the first EOS position, never from comparing with the pad id); a row
with no EOS within max_new_tokens is truncated. The EOS is in the loss, so the model learns to stop.
With rollout.tools (docs/tools.md), an EOS that ends a turn with calls continues the row with the
tool turn, context the policy did not sample (Completion.policy_mask), up to the same budget
(RolloutEngine.generate).
Each completion carries the behaviour log-probs of its tokens, those of the distribution it was
sampled from (sampling.behaviour_distribution), and under top-k / top-p truncation the log of the
probability mass the truncation kept at each token (kept_log_mass): the trainer corrects the rollout
against the training forward before truncation, and reports the truncation apart (docs/training.md,
Sampling from what is scored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dapo_train.rollout.decoding import Decoded, decode_loop
from dapo_train.rollout.fitting import GenerationRows, decode_fitting
from dapo_train.rollout.sampling import SamplingSettings


@dataclass
class Completion:
    """One sampled completion. L = number of valid tokens (EOS included when present)."""

    prompt_ids: torch.Tensor  # (P,) the prompt's tokens, no padding
    completion_ids: torch.Tensor  # (L,) valid generated tokens, no padding
    truncated: bool  # no EOS within max_new_tokens
    text: str  # decoded completion, special tokens skipped; with tools the whole transcript (transcript_text)
    behaviour_logprobs: torch.Tensor | None = None  # (L,) float32 under the sampling distribution; every engine sets it
    # (L,) float32 <= 0: log of the probability top-k / top-p kept where each token was sampled, so
    # behaviour_logprobs + kept_log_mass are the rollout's log-probs before truncation; None: nothing truncated.
    kept_log_mass: torch.Tensor | None = None
    # (L,) bool, with tools: True on the policy's own tokens, False on the tool turns the engine fed in (context,
    # not actions: out of the loss, the log-probs' use, Eq. 12's count and the entropy); None: all the policy's.
    policy_mask: torch.Tensor | None = None
    tool_calls: list = field(default_factory=list)  # tools.turns.ToolCall of each call made, in order
    # ended by a turn whose calls would pass rollout.max_tool_calls (none of them run): its own end, not truncated
    over_calls: bool = False
    # [start, end) spans of `text` that are tool turns, in order (transcript_text); the rest is the policy's
    tool_turn_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.completion_ids.numel())

    @property
    def policy_tokens(self) -> int:
        """The tokens the policy sampled: its length less its tool turns'."""
        return self.length if self.policy_mask is None else int(self.policy_mask.sum())

    @property
    def policy_text(self) -> str:
        """What the policy wrote: `text` less its tool turns. The rewards and the answer check read this, so a
        tool's reply is never graded as the policy's answer (an <answer> block open across a call included)."""
        return policy_part(self.text, self.tool_turn_spans)

    @property
    def untruncated_logprobs(self) -> torch.Tensor | None:
        """(L,) the rollout's own log-probs before top-k / top-p truncation (its weights, logits / T): what
        the trainer compares with the training forward; the behaviour log-probs when nothing was truncated."""
        if self.behaviour_logprobs is None or self.kept_log_mass is None:
            return self.behaviour_logprobs
        return self.behaviour_logprobs + self.kept_log_mass


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


def transcript_text(tokenizer, ids: torch.Tensor, policy_mask: torch.Tensor | None,
                    ) -> tuple[str, list[tuple[int, int]]]:
    """A completion's text (special tokens skipped) and the [start, end) character spans of its tool turns:
    ids (L,), policy_mask (L,) bool, False on the tool turns' tokens (None: none). Each run of the policy's or
    a tool turn's tokens is decoded alone and the texts joined, so the spans are exact. An engine with tools
    fills Completion.text and tool_turn_spans with it."""
    if policy_mask is None or bool(policy_mask.all()):
        return tokenizer.decode(ids, skip_special_tokens=True), []
    starts = [0, *((policy_mask[1:] != policy_mask[:-1]).nonzero().flatten() + 1).tolist(), len(ids)]
    text, spans = "", []
    for start, end in zip(starts, starts[1:]):
        piece = tokenizer.decode(ids[start:end], skip_special_tokens=True)
        if not bool(policy_mask[start]):
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return text, spans


def policy_part(text: str, spans: Sequence[Sequence[int]]) -> str:
    """`text` less its tool turns' [start, end) spans (Completion.tool_turn_spans, in order)."""
    pieces, cursor = [], 0
    for start, end in spans:
        pieces.append(text[cursor:start])
        cursor = end
    return "".join(pieces) + text[cursor:]


def decoded_completions(prompts: Sequence[torch.Tensor], decoded: Decoded, eos_ids, tokenizer) -> list[Completion]:
    """A decoder's N rows (row i continues prompts[i]) -> Completions."""
    if decoded.lengths is None:
        mask, truncated = completion_mask(decoded.ids, eos_ids)
        lengths = mask.sum(dim=1).tolist()
    else:  # a transcript with tool turns holds EOS ids before its end
        lengths, truncated = decoded.lengths.tolist(), decoded.truncated
    valid = [decoded.ids[row, :length] for row, length in enumerate(lengths)]
    kept, policy = decoded.kept_log_mass, decoded.policy_mask
    if policy is None:
        texts = [(text, []) for text in tokenizer.batch_decode(valid, skip_special_tokens=True)]
    else:
        texts = [transcript_text(tokenizer, ids, policy[row, : lengths[row]]) for row, ids in enumerate(valid)]
    return [
        Completion(
            prompt_ids=prompts[row], completion_ids=ids, truncated=bool(truncated[row]), text=texts[row][0],
            behaviour_logprobs=decoded.behaviour_logprobs[row, : lengths[row]].clone(),
            kept_log_mass=None if kept is None else kept[row, : lengths[row]].clone(),
            policy_mask=None if policy is None else policy[row, : lengths[row]].clone(),
            tool_calls=[] if decoded.tool_calls is None else decoded.tool_calls[row],
            over_calls=decoded.over_calls is not None and bool(decoded.over_calls[row]), tool_turn_spans=texts[row][1],
        )
        for row, ids in enumerate(valid)
    ]


Decode = Callable[[torch.nn.Module, list[torch.Tensor], int, SamplingSettings, list[int], int], Decoded]


def sample_completions(
    model, tokenizer, prompts: Sequence[Sequence[int]], settings: SamplingSettings, *,
    batch_size: int | GenerationRows, group_size: int = 1, decode: Decode = decode_loop,
    seeds: Sequence[int] | None = None,
) -> list[Completion]:
    """group_size completions of each prompt, prompt-major (prompt 0's first), sampled from `model` as
    it is: evaluation samples the training model so; an engine passes its rollout model and decoder.

    decode(model, prompts (B,), group_size, settings, eos_ids, pad_id) -> Decoded (B*G rows) runs on whole
    groups of at most batch_size rows. seeds: one per row (prompt-major), passed on to decode for its
    chunk's rows (keyed draws). The model is in eval mode
    meanwhile: training mode would turn the KV cache off under gradient checkpointing. batch_size: the most
    rows of one call, or an engine's GenerationRows, which a call out of memory halves (fitting.py: the same
    rows redone in smaller calls, the same completions)."""
    eos_ids, pad_id = eos_token_ids(model, tokenizer), pad_token_id(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        rows = batch_size if isinstance(batch_size, GenerationRows) else GenerationRows(batch_size)
        tensors = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
        completions: list[Completion] = []
        while len(completions) < len(tensors) * group_size:  # calls of whole groups within rows.limit
            start = len(completions) // group_size
            chunk = tensors[start : start + max(1, rows.limit // group_size)]
            chunk_seeds = None if seeds is None else seeds[start * group_size : (start + len(chunk)) * group_size]
            for part, decoded in decode_fitting(decode, model, chunk, group_size, settings, eos_ids, pad_id,
                                                chunk_seeds, rows):
                completions += decoded_completions(group_rows(part, group_size), decoded, eos_ids, tokenizer)
        return completions
    finally:
        model.train(was_training)


def group_rows(prompts: list[torch.Tensor], group_size: int) -> list[torch.Tensor]:
    """Each prompt group_size times, in order: the rows of a chunk."""
    return [prompt for prompt in prompts for _ in range(group_size)]
