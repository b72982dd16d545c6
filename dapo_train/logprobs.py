"""Scoring: model forward -> per-token log-probs (and entropy) of completion tokens.

Memory-bounded for large vocabularies (Qwen: V = 151,936): the forward keeps logits only for the
completion positions (`logits_to_keep`), and the log-prob of each chosen token is its logit minus
a chunked logsumexp (selected_logprobs below), so no float32 log_softmax over (N, T, V) is ever
materialised. Logits are divided by the rollout temperature first: the loss must see the same
distribution the rollout sampled from.

Position ids and attention masks are built exactly as `generate` builds them for left-padded
prompts (cumulative sum of the mask minus one), so scoring reproduces generation-time log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass
class TokenBatch:
    """A collated micro-batch. N rows, P = padded prompt width, T = padded completion width."""

    input_ids: torch.Tensor  # (N, P+T) left-padded prompt ++ right-padded completion
    attention_mask: torch.Tensor  # (N, P+T) 1 on prompt tokens and valid completion tokens
    position_ids: torch.Tensor  # (N, P+T)
    completion_ids: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T) float, 1 on valid completion tokens (EOS included)

    def to(self, device: torch.device) -> TokenBatch:
        return TokenBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate(prompts: Sequence[torch.Tensor], completions: Sequence[torch.Tensor], pad_id: int) -> TokenBatch:
    """(prompt ids (P_i,), completion ids (L_i,)) pairs -> TokenBatch; completions keep their EOS."""
    n = len(prompts)
    width_p = max(int(p.numel()) for p in prompts)
    width_t = max(1, max(int(c.numel()) for c in completions))
    input_ids = torch.full((n, width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_t), dtype=torch.long)
    completion_mask = torch.zeros((n, width_t), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        p, c = int(prompt.numel()), int(completion.numel())
        input_ids[row, width_p - p : width_p] = prompt
        input_ids[row, width_p : width_p + c] = completion
        attention_mask[row, width_p - p : width_p + c] = 1
        completion_mask[row, :c] = 1.0
    position_ids = (attention_mask.cumsum(dim=1) - 1).masked_fill(attention_mask == 0, 0)
    return TokenBatch(input_ids, attention_mask, position_ids, input_ids[:, width_p:], completion_mask)


def score_tokens(
    model,
    batch: TokenBatch,
    *,
    temperature: float,
    chunk_size: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (logprobs (N, T) float32, entropy (N, T) float32 or None). Differentiable in logprobs."""
    width_t = batch.completion_ids.shape[1]
    output = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=width_t + 1,
    )
    # Logits at position i predict token i+1: the kept T+1 positions start one before the
    # completion, so the first T of them score the T completion tokens.
    logits = output.logits[:, :-1, :]  # (N, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = selected_logprobs(logits, batch.completion_ids, chunk_size)  # (N, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), chunk_size)  # (N, T)
    return logprobs, entropy


# ---------------------------------------------------------------- memory-bounded vocabulary maths


def _rows(logits: Tensor, chunk_size: int) -> tuple[Tensor, list[slice]]:
    """Flatten (..., V) to (M, V) and cut M rows into slices of at most chunk_size."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])  # (M, V); a view when logits is contiguous
    return flat, [slice(start, start + chunk_size) for start in range(0, flat.shape[0], chunk_size)]


def entropy_from_logits(logits: Tensor, chunk_size: int) -> Tensor:
    """Per-token entropy H = logsumexp(x) - sum softmax(x) * x of the policy at each position.

    logits (..., V) any float dtype -> (...) float32. Rows (flattened leading dims) are processed
    chunk_size at a time in float32, so the extra memory is O(chunk_size * V) rather than a float32
    copy of all logits. A diagnostic (DAPO's entropy-collapse curve, the reason for clip-higher);
    call it under torch.no_grad(). A non-contiguous input is copied once by the flatten.
    """
    flat, chunks = _rows(logits, chunk_size)
    entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)  # (M,)
    for rows in chunks:
        block = flat[rows].to(torch.float32)  # (c, V)
        log_norm = torch.logsumexp(block, dim=-1)  # (c,)
        probs = torch.exp(block - log_norm[:, None])  # (c, V)
        entropy[rows] = log_norm - (probs * block).sum(dim=-1)
    return entropy.reshape(logits.shape[:-1])


class _SelectedLogprobs(torch.autograd.Function):
    """log softmax(x)[id] on (M, V) rows with a chunked forward AND backward.

    Plain autograd would save each chunk's float32 copy for backward, i.e. a float32 copy of all
    logits after all. Here only the (M,) logsumexp is saved and softmax is recomputed per chunk.
    """

    @staticmethod
    def forward(ctx, flat: Tensor, ids: Tensor, chunk_size: int) -> Tensor:  # (M, V), (M,) -> (M,)
        log_norm = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)  # (M,)
        for start in range(0, flat.shape[0], chunk_size):
            log_norm[start:start + chunk_size] = torch.logsumexp(flat[start:start + chunk_size].to(torch.float32), -1)
        ctx.save_for_backward(flat, ids, log_norm)
        ctx.chunk_size = chunk_size
        return flat.gather(-1, ids[:, None]).squeeze(-1).to(torch.float32) - log_norm

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # (M,) -> (M, V)
        flat, ids, log_norm = ctx.saved_tensors
        grad = torch.empty_like(flat)  # (M, V), the logits' dtype
        for start in range(0, flat.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            upstream = grad_out[rows].to(torch.float32)[:, None]  # (c, 1)
            block = -torch.exp(flat[rows].to(torch.float32) - log_norm[rows, None]) * upstream  # (c, V)
            block.scatter_add_(-1, ids[rows, None], upstream)  # d/dx_id log p_id has the extra +1
            grad[rows] = block.to(grad.dtype)
        return grad, None, None


def selected_logprobs(logits: Tensor, token_ids: Tensor, chunk_size: int) -> Tensor:
    """log pi(token | context) for the chosen tokens: the log-probs in the ratio of Eq. 10.

    logits (N, T, V) any float dtype (already divided by the sampling temperature), token_ids
    (N, T) integer -> (N, T) float32. Equals log_softmax(logits).gather(token_ids) but never
    materialises a float32 (N, T, V): logsumexp and its backward run chunk_size rows at a time.
    Differentiable with respect to logits. A non-contiguous input (e.g. logits[:, :-1]) is copied
    once, in its own dtype, by the flatten.
    """
    if token_ids.shape != logits.shape[:-1]:
        raise ValueError(f"selected_logprobs: token_ids shape {tuple(token_ids.shape)} "
                         f"!= logits {tuple(logits.shape[:-1])}")
    flat, _ = _rows(logits, chunk_size)
    picked = _SelectedLogprobs.apply(flat, token_ids.reshape(-1).to(torch.long), chunk_size)  # (M,)
    return picked.reshape(token_ids.shape)
