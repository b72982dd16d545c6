"""How a micro-batch is laid out in rows for the scoring forward (scoring.py runs it).

One sample per row: the left-padded prompt, then the right-padded completion, under a 2-D mask.

Shared prompt prefix, packed rows (`share_prefix`). The G completions of a group share one prompt.
`collate` lays a micro-batch out in rows that hold each group as its prompt once, then each of its
completions, several groups back to back (shared_rows: nearly full rows), under a 4-D attention mask
in which a completion sees its own group's prompt and its own earlier tokens only, with position ids
restarting at each prompt and after it for each completion. The forward's cost then follows prompt +
G x completion tokens instead of G x (prompt + completion), with the same log-probs (float rounding
aside). Needs an attention kernel that takes a 4-D mask (scoring.PREFIX_SHARING_ATTENTION).

The dense mask and the attention weights grow with rows x width x width, so the rows' width, not only
the micro-batch's tokens, sets the forward's memory. Under a token budget (train.micro_batch_tokens)
rows are filled up to a width that follows the budget (row_limit), so a micro-batch's memory stays
put however long the completions get; without one, rows are as wide as the micro-batch's widest
group, at most SHARED_ROW_LIMIT tokens. A group wider than a row is cut between rows, its prompt
repeated; a sequence wider gets a row of its own; a layout that would not be smaller than one row
per sample keeps one row per sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# Widest shared-prefix row (tokens).
SHARED_ROW_LIMIT = 4096
ROWS_PER_BUDGET = 2  # under a token budget, rows at most budget / ROWS_PER_BUDGET tokens wide


def row_limit(budget: int) -> int:
    """The packed rows' width (tokens) for a token budget per micro-batch: half the budget, at most
    SHARED_ROW_LIMIT; 0 without a budget (rows no wider than the widest group). Attention's memory per
    micro-batch then follows budget x width, fixed by the budget, where rows as wide as a group would
    follow the completions' lengths."""
    return 0 if budget <= 0 else max(1, min(SHARED_ROW_LIMIT, budget // ROWS_PER_BUDGET))


@dataclass
class TokenBatch:
    """A collated micro-batch: N samples laid out in R rows of width W; T = padded completion width.

    One sample per row (R = N): left-padded prompt ++ right-padded completion, a 2-D attention mask.
    Shared prefix: each run of consecutive samples with the same prompt as the prompt once and then
    each completion, several runs back to back in a row (a run cut between rows repeats its prompt);
    attention_mask is (R, 1, W, W) bool (True = may attend).
    """

    input_ids: Tensor  # (R, W)
    attention_mask: Tensor  # (R, W) long, or (R, 1, W, W) bool when prefixes are shared
    position_ids: Tensor  # (R, W)
    completion_ids: Tensor  # (N, T)
    completion_mask: Tensor  # (N, T) float, the loss mask: 1 on valid completion tokens (EOS included), 0 on tool turns
    rows: Tensor  # (N,) long: the row holding sample i
    positions: Tensor  # (N, T) long: the row position whose hidden state predicts completion token t
    # (N, T) bool: the completions' own tokens (not a tool turn's), what the head scores; unlike completion_mask it
    # stays when a token leaves the loss (overlong filtering, the rollout correction), whose log-prob is still read
    valid_mask: Tensor
    padding_tokens: int  # positions of the R x W the forward computes that hold no prompt or completion token

    def to(self, device: torch.device) -> TokenBatch:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})

    @property
    def shared_prefix(self) -> bool:
        return self.attention_mask.dim() == 4

    @property
    def forward_tokens(self) -> int:
        """Token positions the forward computes (rows x width): the update's work."""
        return int(self.input_ids.numel())

    @property
    def head_tokens(self) -> int:
        """Positions the LM head scores: the completions' own tokens."""
        return int(self.valid_mask.sum())


def collate(
    prompts: Sequence[Tensor], completions: Sequence[Tensor], pad_id: int, share_prefix: bool = False,
    row_tokens: int = 0, policy_masks: Sequence[Tensor | None] | None = None,
) -> TokenBatch:
    """(prompt ids (P_i,), completion ids (L_i,)) pairs -> TokenBatch; completions keep their EOS.
    row_tokens: with share_prefix, the packed rows' width (row_limit), 0 = as wide as the widest group.
    policy_masks: per completion (L_i,) bool or None, False on tokens the policy did not sample (a tool
    turn): they stay in the sequence, as context, and leave completion_mask and valid_mask (the head
    does not score them)."""
    n = len(prompts)
    width_t = max(1, max(int(c.numel()) for c in completions))
    completion_ids = torch.full((n, width_t), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((n, width_t), dtype=torch.float32)
    for i, completion in enumerate(completions):
        completion_ids[i, : completion.numel()] = completion
        completion_mask[i, : completion.numel()] = 1.0
        if policy_masks is not None and policy_masks[i] is not None:
            completion_mask[i, : completion.numel()] *= policy_masks[i]
    valid_mask = completion_mask.bool()
    if share_prefix:
        shared = _collate_shared(prompts, completions, pad_id, completion_ids, completion_mask, valid_mask,
                                 row_tokens)
        if shared is not None:
            return shared
    width_p = max(int(p.numel()) for p in prompts)
    input_ids = torch.full((n, width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_t), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        p, c = int(prompt.numel()), int(completion.numel())
        input_ids[row, width_p - p : width_p] = prompt
        input_ids[row, width_p : width_p + c] = completion
        attention_mask[row, width_p - p : width_p + c] = 1
    position_ids = padded_position_ids(attention_mask)
    # Hidden state i predicts token i+1: completion token t is predicted at width_p - 1 + t.
    positions = (width_p - 1 + torch.arange(width_t)).expand(n, width_t).clone()
    padding = int(attention_mask.numel() - attention_mask.sum())
    return TokenBatch(input_ids, attention_mask, position_ids, completion_ids, completion_mask, torch.arange(n),
                      positions, valid_mask, padding)


def padded_position_ids(attention_mask: Tensor) -> Tensor:
    """attention_mask (R, W) 0/1 -> position ids (R, W): each row counts its own tokens from 0, as
    `generate` does for left padding; padding gets 0."""
    return (attention_mask.cumsum(dim=1) - 1).masked_fill(attention_mask == 0, 0)


def _collate_shared(prompts, completions, pad_id, completion_ids, completion_mask, valid_mask, row_tokens: int
                    ) -> TokenBatch | None:
    """Samples cut, in order, into rows that hold each run of consecutive samples with equal prompts
    as the prompt once, then each completion, several runs back to back: the fewest rows of at most
    row_tokens (0: the widest run's, at most SHARED_ROW_LIMIT; the dense 4-D mask and attention grow
    with rows x width x width), balanced (shared_rows), so rows are nearly full and the forward
    computes almost no padding; a run cut between two rows repeats its prompt, a sample wider than
    the rows gets a row of its own. The mask keeps every run to itself. None when that saves no work:
    the caller then uses one row per sample."""
    n, width_t = len(prompts), completion_ids.shape[1]
    starts = [i == 0 or not torch.equal(prompts[i - 1], prompts[i]) for i in range(n)]
    prompt_lengths = [int(p.numel()) for p in prompts]
    completion_lengths = [int(c.numel()) for c in completions]
    widest, run = 0, 0
    for i in range(n):
        run = (prompt_lengths[i] if starts[i] else run) + completion_lengths[i]
        widest = max(widest, run)
    plain_tokens = n * (max(prompt_lengths) + width_t)
    cuts = shared_rows(prompt_lengths, completion_lengths, starts, row_tokens or min(widest, SHARED_ROW_LIMIT))
    width = max(tokens for _, _, tokens in cuts)
    if len(cuts) * width >= plain_tokens:
        return None
    shape = (len(cuts), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    owner = torch.full(shape, -1, dtype=torch.long)  # the run a position belongs to in its row, -1 padding
    segment = torch.full(shape, -1, dtype=torch.long)  # 0 prompt, k + 1 the run's k-th completion
    rows = torch.zeros(n, dtype=torch.long)
    positions = torch.zeros((n, width_t), dtype=torch.long)
    for r, (first, last, _) in enumerate(cuts):
        start, run, k, prompt_end, p = 0, -1, 0, 0, 0
        for i in range(first, last):
            if i == first or starts[i]:  # a run begins in this row: its prompt
                p, run, k = prompt_lengths[i], run + 1, 0
                input_ids[r, start : start + p], position_ids[r, start : start + p] = prompts[i], torch.arange(p)
                owner[r, start : start + p], segment[r, start : start + p] = run, 0
                prompt_end, start = start + p - 1, start + p
            c = completion_lengths[i]
            input_ids[r, start : start + c] = completions[i]
            position_ids[r, start : start + c] = torch.arange(p, p + c)
            owner[r, start : start + c], segment[r, start : start + c] = run, k + 1
            rows[i] = r
            # Token 0 is predicted by the prompt's last position, token t >= 1 by the token before it; an
            # empty completion (a plugin engine may return one) has no token and points at the prompt.
            positions[i, :] = prompt_end
            positions[i, 1:c] = torch.arange(start, start + max(c - 1, 0))
            start, k = start + c, k + 1
    same_run = (owner[:, :, None] == owner[:, None, :]) & (owner[:, None, :] >= 0)  # (R, W, W)
    query, key = segment[:, :, None], segment[:, None, :]  # (R, W, 1), (R, 1, W)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = causal & same_run & ((key == 0) | (key == query))
    mask |= torch.eye(width, dtype=torch.bool)  # padding attends to itself: no empty softmax row
    return TokenBatch(input_ids, mask[:, None], position_ids, completion_ids, completion_mask, rows, positions,
                      valid_mask, len(cuts) * width - sum(tokens for _, _, tokens in cuts))


def shared_rows(prompt_lengths: Sequence[int], completion_lengths: Sequence[int], starts: Sequence[bool],
                cap: int) -> list[tuple[int, int, int]]:
    """Samples (their prompt and completion lengths; starts[i]: sample i's prompt differs from the one
    before) cut in order into rows, each run's prompt once per row: the fewest rows of at most `cap`
    tokens (a sample that alone exceeds it gets a row of its own), then the smallest cap that keeps
    that many, so the rows carry similar tokens. -> (first, end, tokens) per row."""
    n = len(prompt_lengths)
    added = [0]  # prefix sums of what each sample adds to a row it does not begin
    for i in range(n):
        added.append(added[-1] + completion_lengths[i] + (prompt_lengths[i] if starts[i] else 0))

    def cut(limit: int) -> list[tuple[int, int, int]]:
        parts, first = [], 0
        while first < n:
            begin = added[first] - (0 if starts[first] else prompt_lengths[first])  # the first sample brings its prompt
            end = first + 1
            while end < n and added[end + 1] - begin <= limit:
                end += 1
            parts.append((first, end, added[end] - begin))
            first = end
        return parts

    fewest = len(cut(cap))
    low, high = 1, max(cap, 1)
    while low < high:
        middle = (low + high) // 2
        if len(cut(middle)) <= fewest:
            high = middle
        else:
            low = middle + 1
    return cut(low)
