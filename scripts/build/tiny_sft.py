"""The tiny builds' supervised fine-tuning: completion-only cross-entropy on (prompt, completion)
examples, AdamW with warmup and cosine decay, seeded batches. Build-time code for make_tiny_model.py
and make_tiny_tools_model.py (next to this file); deterministic for a given thread count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

SEED = 0  # the batch order's seed (the build's SEED)


def _batch(examples: list[tuple[list[int], ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids (B, T) and labels (B, T): -100 on the prompt and on padding.

    An example is (prompt, completion) or (prompt, completion, labels): labels, as long as the
    completion, -100 where a token is context rather than target (the tool turns of
    make_tiny_tools_model.py); by default the completion itself.

    Right padding needs no attention mask: causal attention never lets a real token see the pads
    that come after it, and position ids stay 0..T-1.
    """
    width = max(len(example[0]) + len(example[1]) for example in examples)
    input_ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    for row, (prompt, completion, *targets) in enumerate(examples):
        ids = prompt + completion
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, len(prompt) : len(ids)] = torch.tensor(targets[0] if targets else completion)
    return input_ids, labels


def shared_prefix_length(examples: list[tuple[list[int], list[int]]]) -> int:
    """Tokens every prompt starts with: the system turn and '<|im_start|>user\\n'."""
    first = examples[0][0]
    length = len(first)
    for prompt, *_ in examples:
        length = next((i for i, (a, b) in enumerate(zip(first[:length], prompt)) if a != b), min(length, len(prompt)))
    return length


def sft_loss(model, prefix: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean completion-token cross-entropy, running the shared prefix once per batch.

    Same value and gradient as a forward over the full sequences (the prefix keys and values are
    computed with grad and broadcast over the batch), but the ~100-token system turn is not
    recomputed for every row: about 2x faster on CPU.
    prefix (1, P); input_ids, labels (B, T): the rows after the prefix, right-padded.
    """
    cache = model.model(input_ids=prefix, use_cache=True).cache
    cache.batch_repeat_interleave(input_ids.shape[0])
    return model(input_ids=input_ids, labels=labels, cache=cache).loss


def _targets(example: tuple[list[int], ...]) -> int:
    """Tokens of an example's completion that carry a label (see _batch)."""
    return sum(label != -100 for label in example[2]) if len(example) > 2 else len(example[1])


def accumulate_batch(model, prefix: torch.Tensor, batch, pad_id: int, micro_batches: int) -> torch.Tensor:
    """Backward of the batch's mean completion-token loss, run as `micro_batches` length-sorted
    pieces, each weighted by its share of the batch's completion tokens; returns the loss.

    The gradient equals one backward over the whole batch up to float rounding, with less padding.
    """
    batch = sorted(batch, key=lambda row: len(row[0]) + len(row[1]))
    tokens = sum(_targets(row) for row in batch)
    loss = torch.zeros(())
    pieces = min(micro_batches, len(batch))
    for piece in range(pieces):
        part = batch[piece * len(batch) // pieces : (piece + 1) * len(batch) // pieces]
        share = sum(_targets(row) for row in part) / tokens
        part_loss = sft_loss(model, prefix, *_batch(part, pad_id)) * share
        part_loss.backward()
        loss += part_loss.detach()
    return loss


def lr_schedule(steps: int) -> Callable[[int], float]:
    """The SFT learning-rate factor per step: linear warmup over 5% of the steps, then a cosine to 10%."""
    warmup = max(1, steps // 20)
    return lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / steps))


def train_sft(
    model, examples, pad_id: int, steps: int, batch_size: int, lr: float, micro_batches: int = 2
) -> list[float]:
    """AdamW, linear warmup then cosine decay to 10%; a seeded permutation per epoch; each
    shuffled batch runs through accumulate_batch (about 20% faster on CPU than one piece).
    (Grouping rows of similar length across the whole set would save more padding, but made
    batches of one difficulty and learned several times slower.)
    """
    return train_mixed(model, [examples], [0], pad_id, steps, batch_size, lr, micro_batches)


def train_mixed(
    model, sources: list[list[tuple]], pattern: list[int], pad_id: int, steps: int, batch_size: int, lr: float,
    micro_batches: int = 2,
) -> list[float]:
    """train_sft over several example sets, each with its own shared prompt prefix: step s draws its
    batch from sources[pattern[s % len(pattern)]], a seeded permutation per set and epoch (one set:
    exactly train_sft's draws)."""
    prepared = []
    for examples in sources:
        shared = shared_prefix_length(examples)
        prefix = torch.tensor(examples[0][0][:shared])[None]
        prepared.append((prefix, [(prompt[shared:], *rest) for prompt, *rest in examples]))
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(steps))
    orders: list[list[int]] = [[] for _ in sources]
    losses = []
    model.train()
    for step in range(steps):
        source = pattern[step % len(pattern)]
        prefix, rows = prepared[source]
        if len(orders[source]) < batch_size:
            orders[source] += torch.randperm(len(rows), generator=generator).tolist()
        picked, orders[source] = orders[source][:batch_size], orders[source][batch_size:]
        loss = accumulate_batch(model, prefix, [rows[i] for i in picked], pad_id, micro_batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            which = f"  source {source}" if len(sources) > 1 else ""
            print(f"  sft step {step:4d}{which}  loss {loss.item():.4f}", flush=True)
    model.eval()
    return losses
