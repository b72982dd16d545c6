"""The memory-bounded LM-head maths of dapo_train.model.scoring: chosen tokens' log-probs (and entropy)
through the head chunk by chunk, with a recomputing backward, against plain log_softmax."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.model.scoring import LinearHeadLogprobs, chunk_rows, head_logprobs

FAST = settings(max_examples=40, deadline=None)


def _reference(head, hidden, ids, temperature, softcap=None):
    logits = head(hidden).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    logprobs = torch.log_softmax(logits, -1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, ids[..., None])[..., 0], entropy


def _compare(head, softcap=None, chunk_mib=1e-9, temperature=0.7, seed=0, vocab=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 8, generator=g)
    ids = torch.randint(0, vocab, (3, 5), generator=g)
    upstream = torch.randn(3, 5, generator=g)  # a non-uniform upstream gradient
    ours_hidden, theirs_hidden = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    got, entropy = head_logprobs(head, ours_hidden, ids, temperature=temperature, chunk_mib=chunk_mib,
                                 softcap=softcap)
    (got * upstream).sum().backward()
    ours_grads = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    expected, expected_entropy = _reference(head, theirs_hidden, ids, temperature, softcap)
    (expected * upstream).sum().backward()
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_hidden.grad, theirs_hidden.grad, atol=1e-5, rtol=0)
    for ours, theirs in zip(ours_grads, [p.grad for p in head.parameters()]):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_mib", [1e-9, 100 * 11 * 4 / 2**20, 64.0])  # 1 row, 100 rows, everything
@pytest.mark.parametrize("bias", [False, True])
def test_linear_head_value_entropy_and_gradients(chunk_mib, bias):
    torch.manual_seed(0)
    _compare(torch.nn.Linear(8, 11, bias=bias), chunk_mib=chunk_mib)


def test_any_other_head_module_and_logit_softcapping():
    """A head that is not a plain Linear (here a Linear subclass with a scale) and final-logit
    softcapping take the generic, checkpointed path with the same results."""

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    torch.manual_seed(1)
    _compare(ScaledLinear(8, 11))
    _compare(torch.nn.Linear(8, 11), softcap=3.0, seed=2)


def test_chunk_rows_bound_the_float32_logits():
    assert chunk_rows(151936, 64) == 64 * 2**20 // (4 * 151936) == 110
    assert chunk_rows(1000, 1e-9) == 1  # never less than a row


def test_only_hidden_states_weights_and_one_value_per_row_are_saved_for_backward():
    """The backward recomputes each chunk's logits: nothing of size rows x V is saved, unlike
    autograd through a (M, V) log_softmax."""
    rows, width, vocab = 64, 16, 4096
    hidden = torch.randn(rows, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = LinearHeadLogprobs.apply(hidden, weight, None, torch.zeros(rows, dtype=torch.long), 1.0, 8)
    allowed = hidden.numel() * 4 + weight.numel() * 4 + rows * (8 + 4)  # hidden, weight, ids, logsumexp
    assert sum(t.numel() * t.element_size() for t in saved) <= allowed < rows * vocab * 4
    out.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


def test_bf16_autocast_computes_the_head_in_bf16_and_returns_float32():
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = head_logprobs(head, hidden, ids, temperature=1.0, chunk_mib=1e-9)
    got.sum().backward()
    bf16_logits = (hidden.detach().bfloat16() @ head.weight.detach().bfloat16().T).float()
    expected = torch.log_softmax(bf16_logits, -1).gather(-1, ids[..., None])[..., 0]
    assert got.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_uniform_logits_have_log_v_entropy_and_bad_chunks_are_refused():
    head = torch.nn.Linear(4, 8, bias=False)
    torch.nn.init.zeros_(head.weight)
    _, entropy = head_logprobs(head, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), temperature=1.0,
                               chunk_mib=1.0)
    torch.testing.assert_close(entropy, torch.full((3,), math.log(8)))
    with pytest.raises(ValueError, match="chunk_mib"):
        head_logprobs(head, torch.randn(3, 4), torch.zeros(3, dtype=torch.long), temperature=1.0, chunk_mib=0)


@FAST
@given(st.integers(1, 4), st.integers(1, 6), st.integers(2, 30), st.integers(1, 10), st.integers(0, 10_000))
def test_property_head_logprobs(n, t, vocab, rows, seed):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(5, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(3 * torch.randn(vocab, 5, generator=g))
    hidden = torch.randn(n, t, 5, generator=g)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    got, _ = head_logprobs(head, hidden, ids, temperature=1.0, chunk_mib=rows * vocab * 4 / 2**20)
    expected, _ = _reference(head, hidden, ids, 1.0)
    torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=0)


def test_score_tokens_runs_the_head_inside_the_forward_and_restores_the_model():
    """score_tokens swaps the LM head's forward only for its own call (the model's own forward and
    logits are untouched afterwards) and applies a model's final-logit soft-capping exactly once."""
    from dapo_train.model.layout import collate
    from dapo_train.model.scoring import score_tokens

    from conftest import EOS2_ID, make_random_model

    model = make_random_model(seed=1)
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7])]
    completions = [torch.tensor([8, 9, 10]), torch.tensor([11])]
    batch = collate(prompts, completions, EOS2_ID)
    reference_logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             position_ids=batch.position_ids).logits.detach()
    model.config.final_logit_softcapping = 2.0  # Qwen2 itself ignores it; score_tokens must apply it once
    with torch.no_grad():
        got, _ = score_tokens(model, batch, temperature=0.5, chunk_mib=1e-9)
    assert model.config.final_logit_softcapping == 2.0 and "forward" not in model.lm_head.__dict__
    capped = torch.tanh(reference_logits[:, 2:-1] / 2.0) * 2.0 / 0.5  # positions predicting the completions
    expected = torch.log_softmax(capped, -1).gather(-1, batch.completion_ids[..., None])[..., 0]
    torch.testing.assert_close(got * batch.completion_mask, expected * batch.completion_mask, atol=1e-5, rtol=0)
    after = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    torch.testing.assert_close(after.logits, reference_logits)


# ---------------------------------------------------------------- the head on valid tokens only

# Mixed completion lengths: an empty completion (a plugin engine may return one), one that is only its
# EOS, a long one and a short one; two prompts of different lengths, each with consecutive samples.
_PROMPTS = [[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [7, 8], [7, 8]]
_COMPLETIONS = [[9, 10, 11, 12, 13, 1], [], [1], [14, 15, 16, 17, 18, 19, 20], [21, 1]]


def _untied_model():
    from conftest import make_random_model

    model = make_random_model(seed=4)
    config = model.config
    config.tie_word_embeddings = False
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(5)
    return Qwen2ForCausalLM(config).float().eval()


def _lora_model():
    from dapo_train.config.schema import LoraConfig
    from dapo_train.model import lora

    from conftest import make_random_model

    model = lora.apply_lora(make_random_model(seed=6), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                            "random")
    with torch.no_grad():  # B = 0 would make the adapters invisible: give them weights
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)))
    return model


def _per_sample_reference(model, temperature: float):
    """log_softmax(logits / T) of each completion token and its entropy, from a forward of the sample
    alone (no padding, no other sample), computed here by hand: (logprobs, entropy), lists of (L_i,)."""
    logprobs, entropies = [], []
    for prompt, completion in zip(_PROMPTS, _COMPLETIONS):
        if not completion:
            logprobs.append(torch.zeros(0))
            entropies.append(torch.zeros(0))
            continue
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0].float() / temperature  # (P + L, V)
        start = len(prompt) - 1
        scores = torch.log_softmax(logits[start : start + len(completion)], dim=-1)  # (L, V)
        logprobs.append(scores.gather(-1, torch.tensor(completion)[:, None])[:, 0])
        entropies.append(-(scores.exp() * scores).sum(-1).detach())
    return logprobs, entropies


@pytest.mark.parametrize("share_prefix", [False, True])
@pytest.mark.parametrize("kind", ["tied", "untied", "lora"])
def test_the_head_scores_valid_completion_tokens_only_with_full_logits_parity(monkeypatch, kind, share_prefix):
    """score_tokens gives each genuine completion token (EOS included) the log-prob, entropy and
    gradients of a plain full-logits forward of its sample alone, to 1e-5 in float32, for tied and
    untied embeddings and under LoRA adapters, in both layouts; and the LM head receives exactly those
    tokens' hidden states: no padding after an EOS, no prompt position, nothing for an empty completion."""
    from dapo_train.model import scoring
    from dapo_train.model.layout import collate
    from dapo_train.model.scoring import score_tokens

    from conftest import EOS2_ID, make_random_model

    model = {"tied": lambda: make_random_model(seed=3), "untied": _untied_model, "lora": _lora_model}[kind]()
    temperature = 0.7
    head_rows = []
    apply = LinearHeadLogprobs.apply
    monkeypatch.setattr(scoring.LinearHeadLogprobs, "apply",
                        lambda hidden, *rest: head_rows.append(hidden.shape[0]) or apply(hidden, *rest))
    batch = collate([torch.tensor(p) for p in _PROMPTS], [torch.tensor(c, dtype=torch.long) for c in _COMPLETIONS],
                    EOS2_ID, share_prefix=share_prefix)
    assert batch.shared_prefix == share_prefix
    g = torch.Generator().manual_seed(8)
    upstream = torch.randn(batch.completion_ids.shape, generator=g)  # (N, T): a non-uniform upstream gradient
    trained = [p for p in model.parameters() if p.requires_grad]

    got, entropy = score_tokens(model, batch, temperature=temperature, chunk_mib=3 * 64 * 4 / 2**20)  # 3 rows a chunk
    (got * upstream * batch.completion_mask).sum().backward()
    ours = [p.grad.clone() for p in trained]
    model.zero_grad()
    expected, expected_entropy = _per_sample_reference(model, temperature)
    sum((e * upstream[i, : e.numel()]).sum() for i, e in enumerate(expected)).backward()

    valid_tokens = sum(len(c) for c in _COMPLETIONS)
    assert sum(head_rows) == valid_tokens == 16  # one head row per genuine completion token, in every chunk
    for i, (e, h) in enumerate(zip(expected, expected_entropy)):
        torch.testing.assert_close(got[i, : e.numel()], e.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy[i, : e.numel()], h, atol=1e-5, rtol=0)
    assert batch.completion_mask.sum() == valid_tokens
    for mine, theirs in zip(ours, [p.grad for p in trained]):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_no_valid_token_scores_nothing_and_backpropagates_zero():
    """A micro-batch of empty completions gives the head no row: empty log-probs and entropy on both
    head paths (a plain Linear, and any other module with soft-capping), and a backward through them
    that leaves the hidden states a zero gradient."""
    for head, softcap in ((torch.nn.Linear(4, 9), None), (torch.nn.Linear(4, 9), 2.0)):
        hidden = torch.randn(0, 4, requires_grad=True)
        got, entropy = head_logprobs(head, hidden, torch.zeros(0, dtype=torch.long), temperature=0.7, chunk_mib=1.0,
                                     softcap=softcap)
        assert got.shape == entropy.shape == (0,) and got.dtype == torch.float32
        (got.sum() + hidden.sum()).backward()
        assert hidden.grad.shape == (0, 4)
