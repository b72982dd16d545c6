"""Scoring: model forward -> per-token log-probs and entropy of completion tokens.

Two things keep the update cheap:

- Shared prompt prefix, packed rows. The G completions of a group share one prompt. With
  `share_prefix`, `collate` lays a micro-batch out in rows that hold each group as its prompt once,
  then each of its completions, several groups back to back (shared_rows: nearly full rows), under a
  4-D attention mask in which a completion sees its own group's prompt and its own earlier tokens
  only, with position ids restarting at each prompt and after it for each completion. The forward's cost
  then follows prompt + G x completion tokens instead of G x (prompt + completion), with the same
  log-probs (float rounding aside). Needs an attention kernel that takes a 4-D mask (sdpa, eager);
  a micro-batch whose rows would be wider than SHARED_ROW_LIMIT tokens, or that would not get
  smaller, keeps one row per completion (long completions gain little from a shared prompt).
- The LM head on valid tokens only, in bounded memory. The LM head is swapped, for the scoring
  forward, for one that takes the final hidden states at the positions that predict a genuine
  completion token (EOS included), flattened: prompt positions, padding after an EOS and an empty
  completion never reach it. It computes their log-probs chunk by chunk; the
  backward recomputes each chunk's logits instead of saving them (LinearHeadLogprobs), so no
  (N, T, V) tensor exists in forward or backward: at most `chunk_mib` of float32 logits (plus
  their softmax) at a time.

Logits are divided by the rollout temperature first: the loss must see the distribution the rollout
sampled from. Position ids are built by `position_ids`, as the rollout's decode loop builds them, so
scoring reproduces generation-time log-probs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# Attention implementations that accept a prepared 4-D mask (and the mask format each wants).
PREFIX_SHARING_ATTENTION = ("sdpa", "eager")
# Widest shared-prefix row (tokens): beyond it a micro-batch is laid out one row per completion.
SHARED_ROW_LIMIT = 4096


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
    policy_masks: Sequence[Tensor | None] | None = None,
) -> TokenBatch:
    """(prompt ids (P_i,), completion ids (L_i,)) pairs -> TokenBatch; completions keep their EOS.
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
        shared = _collate_shared(prompts, completions, pad_id, completion_ids, completion_mask, valid_mask)
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


def _collate_shared(prompts, completions, pad_id, completion_ids, completion_mask, valid_mask
                    ) -> TokenBatch | None:
    """Samples cut, in order, into rows that hold each run of consecutive samples with equal prompts
    as the prompt once, then each completion, several runs back to back: the fewest rows no wider
    than the widest run, balanced (shared_rows), so rows are nearly full and the forward computes
    almost no padding; a run cut between two rows repeats its prompt. The mask keeps every run to
    itself. None when that saves no work or a run would be wider than SHARED_ROW_LIMIT (the dense 4-D
    mask and attention grow with the square of the row): the caller then uses one row per sample."""
    n, width_t = len(prompts), completion_ids.shape[1]
    starts = [i == 0 or not torch.equal(prompts[i - 1], prompts[i]) for i in range(n)]
    prompt_lengths = [int(p.numel()) for p in prompts]
    completion_lengths = [int(c.numel()) for c in completions]
    widest, run = 0, 0
    for i in range(n):
        run = (prompt_lengths[i] if starts[i] else run) + completion_lengths[i]
        widest = max(widest, run)
    plain_tokens = n * (max(prompt_lengths) + width_t)
    cuts = shared_rows(prompt_lengths, completion_lengths, starts, widest)
    width = max(tokens for _, _, tokens in cuts)
    if widest > SHARED_ROW_LIMIT or len(cuts) * width >= plain_tokens:
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


def attention_implementation(model) -> str:
    config = getattr(_unwrap(model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def supports_shared_prefix(model) -> bool:
    """True when the model's attention kernel takes a prepared 4-D mask."""
    return attention_implementation(model) in PREFIX_SHARING_ATTENTION


def _unwrap(model):
    """The transformers model inside DDP-like wrappers (`.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _model_mask(model, batch: TokenBatch) -> Tensor:
    """The attention mask in the form the model's kernel wants: sdpa a bool 4-D mask, eager an additive one."""
    if not batch.shared_prefix:
        return batch.attention_mask
    implementation = attention_implementation(model)
    if implementation == "sdpa":
        return batch.attention_mask
    if implementation == "eager":
        zero = torch.zeros((), dtype=torch.float32, device=batch.attention_mask.device)
        return torch.where(batch.attention_mask, zero, torch.finfo(torch.float32).min)
    raise ValueError(f"shared-prefix scoring needs an attention implementation in {PREFIX_SHARING_ATTENTION}, "
                     f"the model uses {implementation!r}")


def score_tokens(
    model,
    batch: TokenBatch,
    *,
    temperature: float,
    chunk_mib: float,
) -> tuple[Tensor, Tensor]:
    """-> (logprobs (N, T) float32, differentiable; entropy (N, T) float32, detached); both 0 off
    batch.valid_mask.

    The forward runs through `model` itself, so wrappers (DDP, FSDP, PEFT) see it, with the LM head's
    forward swapped for this call by one that returns the chosen tokens' log-probs: the head runs
    inside the model's forward (where FSDP has its weights whole) on the hidden states that predict
    the completions' own tokens only (batch.valid_mask, flattened to (M, H)), chunk by chunk
    (head_logprobs), and no logits are ever returned."""
    inner = _unwrap(model)
    head = inner.get_output_embeddings()
    config = getattr(inner, "config", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    plain_forward = head.forward
    scored: dict[str, Tensor] = {}

    valid = batch.valid_mask  # (N, T)
    # The row and position of the hidden state that predicts each valid token, (M,) each.
    rows, positions = batch.rows[:, None].expand(valid.shape)[valid], batch.positions[valid]

    def chosen_logprobs(hidden: Tensor) -> Tensor:  # hidden (R, W, H): the final norm's output
        logprobs, entropy = head_logprobs(  # (M,) each
            head, hidden[rows, positions], batch.completion_ids[valid], temperature=temperature, chunk_mib=chunk_mib,
            softcap=softcap, head_forward=plain_forward,
        )
        scored["logprobs"] = logprobs.new_zeros(valid.shape).index_put((valid,), logprobs)  # (N, T)
        scored["entropy"] = entropy.new_zeros(valid.shape).index_put((valid,), entropy)
        return scored["logprobs"]

    saved = head.__dict__.get("forward")  # an instance-level forward (a hook) to put back, if any
    head.forward = chosen_logprobs
    if softcap:
        config.final_logit_softcapping = None  # applied in head_logprobs; the model must not apply it again
    try:
        model(input_ids=batch.input_ids, attention_mask=_model_mask(model, batch),
              position_ids=batch.position_ids, use_cache=False, logits_to_keep=0)
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved
        if softcap:
            config.final_logit_softcapping = softcap
    return scored["logprobs"], scored["entropy"]


# ---------------------------------------------------------------- the LM head, chunk by chunk


def chunk_rows(vocab_size: int, chunk_mib: float) -> int:
    """Rows per chunk so that one float32 (rows, V) block of logits is at most chunk_mib MiB."""
    return max(1, int(chunk_mib * 2**20) // (4 * vocab_size))


def head_logprobs(
    head: torch.nn.Module, hidden: Tensor, token_ids: Tensor, *, temperature: float, chunk_mib: float,
    softcap: float | None = None, head_forward=None,
) -> tuple[Tensor, Tensor]:
    """log softmax(head(hidden) / temperature)[token] for hidden (..., H), token_ids (...) ->
    (logprobs (...) float32, entropy (...) float32 detached), never holding more than one chunk of
    logits; the entropy is a cheap extra pass over each chunk next to the head's matmul. A plain
    linear head (most causal LMs, tied or not) uses LinearHeadLogprobs; any other head (head_forward:
    how to call it, default the module) runs per chunk under activation checkpointing: the same
    memory bound, generic. softcap: a model's final-logit soft-capping."""
    if chunk_mib <= 0:
        raise ValueError(f"chunk_mib must be > 0, got {chunk_mib}")
    flat = hidden.reshape(-1, hidden.shape[-1])  # (M, H)
    ids = token_ids.reshape(-1).to(torch.long)  # (M,)
    if type(head) is torch.nn.Linear and not softcap:
        rows = chunk_rows(head.weight.shape[0], chunk_mib)
        picked, entropy = LinearHeadLogprobs.apply(flat, head.weight, head.bias, ids, 1.0 / temperature, rows)
    else:
        picked, entropy = _module_head_logprobs(head_forward or head, flat, ids, temperature, softcap, chunk_mib)
    return picked.reshape(token_ids.shape), entropy.reshape(token_ids.shape)


def _chunk_stats(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float32 logits (c, V) -> (logsumexp (c,), picked log-prob (c,), entropy (c,))."""
    log_norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, ids[:, None])[:, 0] - log_norm
    probs = torch.exp(logits - log_norm[:, None])
    entropy = log_norm - (probs * logits).sum(dim=-1)
    return log_norm, picked, entropy


def _compute_dtype(tensor: Tensor, weight: Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on (bf16 on CUDA), else the weights'."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(tensor.dtype, weight.dtype)


class LinearHeadLogprobs(torch.autograd.Function):
    """Per-token log-probs through a linear LM head, `rows` positions at a time, forward and backward.

    forward(hidden (M, H), weight (V, H), bias (V,) | None, ids (M,), inverse temperature, rows)
    -> (log-probs (M,) float32, entropy (M,) float32, not differentiable). Saves only hidden, the
    weight and the (M,) logsumexp; backward recomputes each chunk's logits. Gradients flow to hidden,
    weight and bias (a tied embedding receives the head's share through the shared weight)."""

    @staticmethod
    def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scale: float) -> Tensor:
        logits = hidden.to(dtype) @ weight.to(dtype).T  # (c, V)
        if bias is not None:
            logits = logits + bias.to(dtype)
        return logits.float() * scale

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, scale: float, rows: int):
        dtype = _compute_dtype(hidden, weight)
        m = hidden.shape[0]
        log_norm = torch.empty(m, dtype=torch.float32, device=hidden.device)
        picked = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, m, rows):
                part = slice(start, start + rows)
                logits = LinearHeadLogprobs._logits(hidden[part], weight, bias, dtype, scale)
                log_norm[part], picked[part], entropy[part] = _chunk_stats(logits, ids[part])
        ctx.save_for_backward(hidden, weight, bias, ids, log_norm)
        ctx.scale, ctx.rows, ctx.dtype = scale, rows, dtype
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        hidden, weight, bias, ids, log_norm = ctx.saved_tensors
        dtype, scale = ctx.dtype, ctx.scale
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], ctx.rows):
                part = slice(start, start + ctx.rows)
                upstream = grad_picked[part].float()[:, None]  # (c, 1)
                logits = LinearHeadLogprobs._logits(hidden[part], weight, bias, dtype, scale)
                # d log p_id / d logit_v = [v = id] - softmax_v; the logits are (h W^T + b) * scale.
                grad_logits = torch.exp(logits - log_norm[part, None]).mul_(-upstream)
                grad_logits.scatter_add_(-1, ids[part, None], upstream)
                grad_logits = (grad_logits * scale).to(dtype)  # (c, V)
                if grad_hidden is not None:
                    grad_hidden[part] = (grad_logits @ weight.to(dtype)).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad_logits.T @ hidden[part].to(dtype)).float()
                if grad_bias is not None:
                    grad_bias += grad_logits.float().sum(dim=0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None,
        )


def _module_head_logprobs(head, flat: Tensor, ids: Tensor, temperature: float, softcap, chunk_mib: float
                          ) -> tuple[Tensor, Tensor]:
    """Any head module: each chunk's logits are recomputed in backward (activation checkpointing);
    the entropy comes from the same logits, without gradient."""
    from torch.utils.checkpoint import checkpoint

    def chunk_stats(hidden: Tensor, chunk_ids: Tensor) -> tuple[Tensor, Tensor]:
        logits = head(hidden).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        _, picked, entropy = _chunk_stats(logits / temperature, chunk_ids)
        return picked, entropy.detach()

    if not flat.shape[0]:  # no valid token: no logits, and a gradient of zeros through an empty product
        return flat.sum(dim=-1).float(), flat.new_zeros(0, dtype=torch.float32)
    with torch.no_grad():
        vocab = head(flat[:1].detach()).shape[-1]
    rows = chunk_rows(vocab, chunk_mib)
    parts = [checkpoint(chunk_stats, flat[start : start + rows], ids[start : start + rows], use_reentrant=False)
             for start in range(0, flat.shape[0], rows)]
    return torch.cat([picked for picked, _ in parts]), torch.cat([entropy for _, entropy in parts])
