"""Scoring: model forward -> per-token log-probs and entropy of completion tokens.

Two things keep the update cheap:

- Shared prompt prefix, packed rows: each group's prompt once, several groups to a row, under a 4-D
  attention mask (layout.py lays the rows out); needs an attention kernel that takes a 4-D mask
  (PREFIX_SHARING_ATTENTION), which _model_mask gives in the form the kernel wants.
- The LM head on valid tokens only, in bounded memory. The LM head is swapped, for the scoring
  forward, for one that takes the final hidden states at the positions that predict a genuine
  completion token (EOS included), flattened: prompt positions, padding after an EOS and an empty
  completion never reach it. It computes their log-probs chunk by chunk; the
  backward recomputes each chunk's logits instead of saving them (LinearHeadLogprobs), so no
  (N, T, V) tensor exists in forward or backward: at most `chunk_mib` of float32 logits (plus
  their softmax) at a time.

Logits are divided by the rollout temperature first: the loss must see the distribution the rollout
sampled from. Position ids are built by layout.padded_position_ids, as the rollout's decode loop
builds them, so scoring reproduces generation-time log-probs.
"""

from __future__ import annotations

import torch

from dapo_train.model.layout import TokenBatch

Tensor = torch.Tensor

# Attention implementations that accept a prepared 4-D mask (and the mask format each wants).
PREFIX_SHARING_ATTENTION = ("sdpa", "eager")


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
    weight in the compute dtype and the (M,) logsumexp; backward recomputes each chunk's logits. Gradients
    flow to hidden, weight and bias (a tied embedding receives the head's share through the shared weight).

    Under autocast over float32 weights the weight is cast to the compute dtype once per call, in the
    forward, and that cast is what the backward reads: one (V, H) cast per micro-batch however many chunks
    (a cast per chunk would read the whole head again for every 110 rows at Qwen's vocabulary)."""

    @staticmethod
    def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scale: float) -> Tensor:
        """One chunk's scaled float32 logits; weight and bias are already in `dtype`."""
        logits = hidden.to(dtype) @ weight.T  # (c, V)
        if bias is not None:
            logits = logits + bias
        return logits.float() * scale

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, scale: float, rows: int):
        dtype = _compute_dtype(hidden, weight)
        m = hidden.shape[0]
        log_norm = torch.empty(m, dtype=torch.float32, device=hidden.device)
        picked = torch.empty(m, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(m, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            low_weight = weight.to(dtype)  # (V, H): the call's one cast (none when the weights are in dtype)
            low_bias = None if bias is None else bias.to(dtype)
            for start in range(0, m, rows):
                part = slice(start, start + rows)
                logits = LinearHeadLogprobs._logits(hidden[part], low_weight, low_bias, dtype, scale)
                log_norm[part], picked[part], entropy[part] = _chunk_stats(logits, ids[part])
        ctx.save_for_backward(hidden, low_weight, low_bias, ids, log_norm)
        ctx.scale, ctx.rows, ctx.dtype = scale, rows, dtype
        ctx.weight_dtype, ctx.bias_dtype = weight.dtype, None if bias is None else bias.dtype
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        hidden, weight, bias, ids, log_norm = ctx.saved_tensors  # weight and bias in the compute dtype
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
                    grad_hidden[part] = (grad_logits @ weight).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += (grad_logits.T @ hidden[part].to(dtype)).float()
                if grad_bias is not None:
                    grad_bias += grad_logits.float().sum(dim=0)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(ctx.weight_dtype),
            None if grad_bias is None else grad_bias.to(ctx.bias_dtype),
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
