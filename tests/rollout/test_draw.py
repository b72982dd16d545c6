"""The token draw of the decode loop (rollout/sampling.py): the inverse-CDF draw and Gumbel-max give
the behaviour distribution's frequencies (chi-square goodness of fit, a test shown to reject a wrong
distribution), never a truncated token, and follow the temperature."""

import math
import statistics

import pytest
import torch

from dapo_train.rollout import sampling
from dapo_train.rollout.sampling import SamplingSettings, behaviour_distribution, draw_tokens

DRAWS = {"inverse-cdf": sampling.inverse_cdf_draw, "gumbel-max": sampling.gumbel_max_draw}
VOCAB = 300  # not a square: the inverse-CDF draw's last block is short


def chi_square_quantile(level: float, dof: int) -> float:
    """The chi-square quantile (Wilson-Hilferty: within 1% for dof >= 10; no scipy here)."""
    z = statistics.NormalDist().inv_cdf(level)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(drawn: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of drawn ids against probs (V,), tokens merged (in order of probability) into
    bins of expected count >= 5. -> (statistic, degrees of freedom)."""
    counts = torch.bincount(drawn, minlength=probs.numel()).double()
    expected = probs.double() * drawn.numel()
    order = expected.argsort(descending=True)
    bins, observed, wanted = [], 0.0, 0.0
    for index in order.tolist():
        observed, wanted = observed + float(counts[index]), wanted + float(expected[index])
        if wanted >= 5:
            bins.append((observed, wanted))
            observed, wanted = 0.0, 0.0
    if wanted:  # the rest joins the last bin
        bins[-1] = (bins[-1][0] + observed, bins[-1][1] + wanted)
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1


def _scores(seed: int = 0) -> torch.Tensor:
    """One row of logits over VOCAB: a few strong tokens and a long tail."""
    g = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(VOCAB, generator=g) + torch.linspace(3.0, -3.0, VOCAB)


def _draw(draw, settings: SamplingSettings, n: int = 30_000, seed: int = 1) -> torch.Tensor:
    distribution = behaviour_distribution(_scores()[None].expand(n, VOCAB).contiguous(), settings)
    torch.manual_seed(seed)
    return draw(distribution)


@pytest.mark.parametrize("name", DRAWS)
def test_frequencies_fit_the_tempered_distribution_and_the_test_rejects_another(name):
    """30,000 draws at temperature 0.7: chi-square below its 99.99% quantile against softmax(s / 0.7)
    (computed here by hand), and far above it against softmax(s), the temperature left out."""
    drawn = _draw(DRAWS[name], SamplingSettings(1, temperature=0.7))
    statistic, dof = chi_square(drawn, torch.softmax(_scores() / 0.7, -1))
    assert statistic < chi_square_quantile(0.9999, dof), (statistic, dof)
    wrong, wrong_dof = chi_square(drawn, torch.softmax(_scores(), -1))
    assert wrong > 10 * chi_square_quantile(0.9999, wrong_dof), (wrong, wrong_dof)


@pytest.mark.parametrize("name", DRAWS)
def test_temperature_moves_the_frequencies_as_it_should(name):
    """A low temperature concentrates the draws on the strongest token, a high one spreads them: the
    strongest token's frequency falls from T=0.5 to T=2, each within 1% of softmax(s / T)."""
    best = int(_scores().argmax())
    frequencies = {}
    for temperature in (0.5, 2.0):
        drawn = _draw(DRAWS[name], SamplingSettings(1, temperature=temperature), n=30_000)
        frequencies[temperature] = float((drawn == best).double().mean())
        expected = float(torch.softmax(_scores() / temperature, -1)[best])
        assert frequencies[temperature] == pytest.approx(expected, abs=0.01)
    assert frequencies[0.5] > frequencies[2.0] + 0.1


@pytest.mark.parametrize("name", DRAWS)
@pytest.mark.parametrize("settings", [SamplingSettings(1, temperature=1.3, top_p=0.6),
                                      SamplingSettings(1, temperature=0.9, top_k=7)])
def test_truncation_never_emits_an_excluded_token_and_keeps_the_renormalised_frequencies(name, settings):
    """Under top-p and top-k (drawn over the whole row, as the decode loop's full-vocabulary path does)
    no cut token is ever drawn, and the kept ones follow the renormalised distribution (chi-square)."""
    distribution = behaviour_distribution(_scores()[None], settings)[0]  # (V,), -inf where cut
    drawn = _draw(DRAWS[name], settings)
    kept = torch.isfinite(distribution)
    assert 1 < int(kept.sum()) < VOCAB and bool(kept[drawn].all())
    statistic, dof = chi_square(drawn, distribution.exp())
    assert statistic < chi_square_quantile(0.9999, dof), (statistic, dof)


def test_the_inverse_cdf_ends_at_the_first_and_last_tokens_of_positive_probability(monkeypatch):
    """The extreme uniforms, 0 and the largest below 1, draw the first and the last token with a
    positive probability, however small (here 1e-9 after a token of nearly all the mass): zero-probability
    tokens at either end and a whole block of them are skipped, and a long tail behind a heavy token is
    not rounded away (a float32 cumulative sum over the vocabulary stops growing after the heavy token,
    so its tail of tokens below 3e-8 could never be drawn)."""
    probs = torch.full((VOCAB,), 1e-9)
    probs[:3], probs[-2:], probs[40:80] = 0.0, 0.0, 0.0  # cut tokens: the first three, the last two, 40 blocks' worth
    probs[5] = 1.0 - float(probs.sum())
    distribution = probs.log()[None].expand(4, VOCAB)
    for fraction, token in ((0.0, 3), (1.0 - 2**-53, VOCAB - 3)):
        def constant(*shape, fraction=fraction, **kwargs):  # torch.rand with every entry `fraction`
            return torch.full(shape[0] if len(shape) == 1 else shape, fraction, **kwargs)

        monkeypatch.setattr(torch, "rand", constant)
        assert sampling.inverse_cdf_draw(distribution).tolist() == [token] * 4


def test_draw_tokens_takes_the_devices_full_vocabulary_draw(monkeypatch):
    """Without top-k the draw is FULL_VOCABULARY_DRAWS' entry for the tensor's device (the inverse-CDF
    draw on the CPU); with top-k it runs over the k candidates alone."""
    assert sampling.FULL_VOCABULARY_DRAWS["cpu"] is sampling.inverse_cdf_draw
    calls = []
    monkeypatch.setitem(sampling.FULL_VOCABULARY_DRAWS, "cpu", lambda d: calls.append(d.shape) or d.argmax(-1))
    draw_tokens(torch.log_softmax(_scores()[None].expand(3, VOCAB), -1))
    draw_tokens(behaviour_distribution(_scores()[None].expand(3, VOCAB), SamplingSettings(1, top_k=5)), top_k=5)
    assert calls == [(3, VOCAB)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", DRAWS)
def test_both_draws_fit_the_distribution_on_cuda(name):
    """The same goodness of fit on the GPU (scripts/bench/bench_cuda.sh runs `pytest -m gpu`), where the
    choice between the draws is open (FULL_VOCABULARY_DRAWS)."""
    settings = SamplingSettings(1, temperature=0.7, top_p=0.9)
    distribution = behaviour_distribution(_scores()[None].expand(30_000, VOCAB).contiguous().cuda(), settings)
    torch.manual_seed(1)
    drawn = DRAWS[name](distribution).cpu()
    statistic, dof = chi_square(drawn, distribution[0].exp().cpu())
    assert bool(torch.isfinite(distribution[0].cpu())[drawn].all())
    assert statistic < chi_square_quantile(0.9999, dof), (statistic, dof)


def test_a_row_of_diverged_weights_draws_an_index_inside_the_vocabulary():
    """Logits of NaN (train.learning_rate=1e10 on the demo) or a row of zero probability: the search found
    no cumulative sum above u and returned V, an index error in the decode loop; Gumbel-max's argmax gives
    an index below V, and so must this draw, leaving the non-finite step to the health check."""
    vocab = 553
    rows = torch.stack([torch.full((vocab,), float("nan")), torch.full((vocab,), float("-inf")),
                        torch.log_softmax(torch.randn(vocab), dim=-1)])
    for _ in range(20):
        ids = sampling.inverse_cdf_draw(rows)
        assert ids.shape == (3,) and bool(((ids >= 0) & (ids < vocab)).all()), ids
