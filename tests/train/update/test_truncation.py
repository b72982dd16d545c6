"""Top-k / top-p and the rollout correction (docs/training.md, Sampling from what is scored): under
truncation pi_old / pi_behav is each position's kept mass Z <= 1, so weighing tokens by it degenerates
(the audit of issue 35, reproduced here on the shipped tiny model); the correction now weighs the numeric
gap between the rollout's forward and the training forward before truncation, and reports Z apart."""

import pytest
import torch

from dapo_train.algo.correction import RolloutCorrection
from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
from dapo_train.train.update.batching import TrainSample, collate_micro_batch

from conftest import full_distributions, shipped_tiny

MODES = ("tis", "mis", "seq-tis", "seq-mis")
# The shipped tiny model is peaked (entropy ~0.1 nat); at T = 2 top-k cuts real mass, as top-k 50 does on Qwen.
TEMPERATURE, TOKENS = 2.0, 32


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer, prompts = shipped_tiny()
    return model, tokenizer, prompts[:4]


def _sample(tiny, top_k: int, dtype: str = "float32"):
    """16 completions (4 prompts x G=4) of at most 32 tokens at T = 2, and each one's old log-probs: the
    float32 training forward, full softmax at T."""
    model, tokenizer, prompts = tiny
    engine = engine_factory("hf")(EngineSetup(model, tokenizer, 64, dtype=dtype, compile="off"))
    torch.manual_seed(0)
    completions = engine.generate(prompts, SamplingSettings(TOKENS, temperature=TEMPERATURE, top_k=top_k), 4)
    old = [full_distributions(model, c, TEMPERATURE).gather(-1, c.completion_ids[:, None])[:, 0] for c in completions]
    return completions, old


def _corrected(completions, old, mode: str, behaviour=None):
    """(weights on the valid tokens, masked tokens, rows with a masked token) of the trainer's collate under
    `mode` (cap 2); behaviour: per-completion log-probs to use instead of the recorded untruncated ones."""
    samples = [TrainSample(c.prompt_ids, c.completion_ids, 1.0, True, o,
                           c.untruncated_logprobs if behaviour is None else behaviour[i], 0)
               for i, (c, o) in enumerate(zip(completions, old))]
    micro = collate_micro_batch(samples, 0, "cpu", correction=RolloutCorrection(mode, 2.0))
    valid = torch.zeros_like(micro.batch.completion_mask, dtype=torch.bool)
    for row, c in enumerate(completions):
        valid[row, : c.length] = True
    masked = valid & (micro.batch.completion_mask == 0)
    return micro.correction_weight[valid], int(masked.sum()), int(masked.any(dim=1).sum())


def test_the_four_degenerate_cases_weighed_the_truncation_and_now_weigh_nothing(tiny):
    """The audit's four cases (its figures were taken at T = 1; the shipped model needs T = 2 for top-k 5 to
    cut as much; 16 completions of up to 32 tokens).
    Against the truncated behaviour log-probs (what the correction used before) every weight is Z <= 1:
    tis's cap 2 never acts and the mean weight is ~0.77, mis masks the uncertain tokens (Z < 1/2), seq-tis
    multiplies the Z's to ~0, seq-mis masks every sequence (with top-k 20 too). Against the rollout's
    untruncated log-probs -- the float32 decode loop IS the training forward, so the numeric gap is
    rounding -- every weight is 1 to 1e-4 and nothing is masked; the truncation is in kept_log_mass."""
    completions, old = _sample(tiny, top_k=5)
    tokens = sum(c.length for c in completions)
    assert len(completions) == 16 and tokens > 400
    truncated = [c.behaviour_logprobs for c in completions]
    before = {mode: _corrected(completions, old, mode, truncated) for mode in MODES}
    assert float(before["tis"][0].max()) <= 1.0 + 1e-5 and float(before["tis"][0].mean()) < 0.85
    assert 0 < before["mis"][1] < tokens  # the tokens where top-5 kept under half the mass
    assert float(before["seq-tis"][0].mean()) < 0.01
    assert before["seq-mis"][2] == 16
    completions20, old20 = _sample(tiny, top_k=20)
    assert _corrected(completions20, old20, "seq-mis", [c.behaviour_logprobs for c in completions20])[2] == 16

    for mode in MODES:
        weights, masked, rows = _corrected(completions, old, mode)
        assert (weights - 1.0).abs().max() < 1e-4 and masked == 0 and rows == 0, mode
    kept = torch.cat([c.kept_log_mass for c in completions])
    assert (kept <= 1e-6).all() and float(-kept.mean()) > 0.1  # what top-5 cut: KL(truncated || untruncated)
    for c, o in zip(completions, old):  # behaviour + log Z = the training forward's own log-prob
        torch.testing.assert_close(c.untruncated_logprobs, o, atol=1e-4, rtol=0)


def test_a_bf16_copys_numeric_gap_is_weighed_on_both_sides_of_one(tiny):
    """With a bf16 rollout copy the untruncated weights pi_old / pi_behav scatter around 1, above and below
    it (the cap can act on either side); the truncated ones sit at or below Z."""
    completions, old = _sample(tiny, top_k=5, dtype="bfloat16")
    weights, _, _ = _corrected(completions, old, "tis")
    above = float((weights > 1.0).float().mean())
    assert 0.2 < above < 0.8 and (weights - 1.0).abs().max() > 1e-3, above
    truncated, _, _ = _corrected(completions, old, "tis", [c.behaviour_logprobs for c in completions])
    assert float((truncated > 1.0).float().mean()) < above / 2


def test_top_k_of_the_whole_vocabulary_and_top_p_1_are_no_truncation(tiny):
    """top_k >= the vocabulary (553 here) and top_p 1 keep every token: no kept mass is recorded and the
    behaviour log-probs are the untruncated ones, bit for bit those of no truncation."""
    model = tiny[0]
    vocab = model.config.vocab_size
    plain, _ = _sample(tiny, top_k=0)
    for top_k in (vocab, 10 * vocab):
        whole, _ = _sample(tiny, top_k=top_k)
        assert all(c.kept_log_mass is None for c in whole)
        assert [c.completion_ids.tolist() for c in whole] == [c.completion_ids.tolist() for c in plain]
        assert all(torch.equal(a.behaviour_logprobs, b.behaviour_logprobs) for a, b in zip(whole, plain))
    assert SamplingSettings(1, top_k=vocab, top_p=1.0).truncates(vocab) is False
    assert SamplingSettings(1, top_k=vocab - 1).truncates(vocab) and SamplingSettings(1, top_p=0.99).truncates(vocab)
