"""The memory-bounded vocabulary maths of dapo_train.logprobs: chunked entropy and the chosen
tokens' log-probs with a chunked backward, against plain log_softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.logprobs import entropy_from_logits, selected_logprobs

FAST = settings(max_examples=50, deadline=None)


@pytest.mark.parametrize("chunk", [1, 3, 4, 100])
def test_entropy_matches_reference(chunk):
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    expected = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    out = entropy_from_logits(logits, chunk)
    assert out.shape == (2, 5) and torch.allclose(out, expected, atol=1e-5)


def test_entropy_hand_values():
    # Uniform over V = 8: log 8. One logit 100 above the rest: essentially certain, entropy ~ 0.
    uniform = torch.zeros(3, 8, dtype=torch.bfloat16)
    out = entropy_from_logits(uniform, 2)
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full((3,), math.log(8)), atol=1e-6)
    peaked = torch.zeros(1, 8)
    peaked[0, 3] = 100.0
    assert entropy_from_logits(peaked, 1).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_selected_logprobs_value_and_gradient(chunk):
    g = torch.Generator().manual_seed(chunk)
    logits = torch.randn(3, 4, 9, generator=g, dtype=torch.float64).float()
    ids = torch.randint(0, 9, (3, 4), generator=g)
    weights = torch.randn(3, 4, generator=g)  # a non-uniform upstream gradient
    ours = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    out = selected_logprobs(ours, ids, chunk)
    expected = torch.log_softmax(theirs, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-5)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-5)


def test_selected_logprobs_saves_no_float32_copy_for_backward():
    # Plain autograd over chunks would keep every chunk's float32 copy (M * V * 4 bytes) alive
    # until backward; ours may keep only the bf16 logits themselves plus (M,) vectors.
    logits = torch.randn(4, 16, 64).to(torch.bfloat16).requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = selected_logprobs(logits, torch.zeros(4, 16, dtype=torch.long), 8)
    rows = 4 * 16
    allowed = logits.numel() * 2 + rows * (8 + 4) + 1024  # bf16 logits + int64 ids + float32 logsumexp
    assert sum(t.numel() * t.element_size() for t in saved) <= allowed
    out.sum().backward()


def test_selected_logprobs_bf16_and_chunk_checks():
    logits = torch.randn(2, 3, 5).to(torch.bfloat16).requires_grad_(True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    out = selected_logprobs(logits, ids, 4)
    expected = torch.log_softmax(logits.detach().float(), -1)[..., 0]
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="chunk_size"):
        selected_logprobs(logits, ids, 0)
    with pytest.raises(ValueError, match="token_ids"):
        selected_logprobs(logits, ids[:, :2], 4)


@FAST
@given(st.integers(1, 4), st.integers(1, 6), st.integers(2, 30), st.integers(1, 10), st.integers(0, 10_000))
def test_property_selected_logprobs(n, t, v, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, t, v, generator=g)
    ids = torch.randint(0, v, (n, t), generator=g)
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(selected_logprobs(logits, ids, chunk), expected, atol=1e-5)
