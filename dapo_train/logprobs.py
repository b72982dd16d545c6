"""Scoring: model forward -> per-token log-probs (and entropy) of completion tokens.

Memory-bounded for large vocabularies (Qwen: V = 151,936): the forward keeps logits only for the
completion positions (`logits_to_keep`), and the log-prob of each chosen token is its logit minus
a chunked logsumexp (algo.selected_logprobs), so no float32 log_softmax over (N, T, V) is ever
materialised. Logits are divided by the rollout temperature first: the loss must see the same
distribution the rollout sampled from.

Position ids and attention masks are built exactly as `generate` builds them for left-padded
prompts (cumulative sum of the mask minus one), so scoring reproduces generation-time log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dapo_train.algo import entropy_from_logits, selected_logprobs


@dataclass
class TokenBatch:
    """A collated micro-batch. N rows, P = padded prompt width, T = padded completion width."""

    input_ids: torch.Tensor  # (N, P+T) left-padded prompt ++ right-padded completion
    attention_mask: torch.Tensor  # (N, P+T) 1 on prompt tokens and valid completion tokens
    position_ids: torch.Tensor  # (N, P+T)
    completion_ids: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T) float, 1 on valid completion tokens (EOS included)

    def to(self, device: torch.device) -> "TokenBatch":
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.position_ids, self.completion_ids, self.completion_mask)))


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
