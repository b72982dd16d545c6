"""The objectives beside Eq. 10 (GSPO, CISPO) and the Dr. GRPO reduction, as pure maths: hand-computed
values and gradients, the bounds each clip metric follows, exact accumulation over any micro-batch
split, and rows masked out entirely (overlong filtering) neither adding nor counting."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.algo import loss_normalizer, policy_loss

FAST = settings(max_examples=40, deadline=None)
OBJECTIVES = ("clip", "gspo", "cispo")
REDUCTIONS = ("token", "sample", "constant")


def random_batch(seed: int, n: int, t: int):
    """Log-probs near the old ones and ragged masks (some rows empty), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    new = old + 0.3 * torch.randn(n, t, generator=g)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return new, old, torch.randn(n, generator=g), mask


def loss_and_grad(new, old, adv, mask, objective, eps=(0.2, 0.28), **kw):
    new = new.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(new, old, adv, mask, *eps, objective=objective, **kw)
    loss.backward()
    return loss.detach(), new.grad, metrics


# ---------------------------------------------------------------- GSPO by hand


def gspo_batch():
    """Three completions, token log-ratios (old log-probs 0): seq 0 (A = +1) 0.1, 0.3 (mean 0.2);
    seq 1 (A = -1) -0.5, -0.3, -0.1 (mean -0.3); seq 2 (A = +1) 0.6 and one padded slot."""
    new = torch.tensor([[0.1, 0.3, 0.0], [-0.5, -0.3, -0.1], [0.6, 9.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    return new, torch.zeros(3, 3), torch.tensor([1.0, -1.0, 1.0]), mask


def test_gspo_shares_each_completions_clipped_ratio_over_its_tokens():
    """Bounds [0.8, 1.3]. Sequence ratios s = e^0.2 = 1.2214 (inside), e^-0.3 = 0.7408 (below 0.8 with
    A < 0: clipped, loss 0.8 per token), e^0.6 = 1.8221 (above 1.3 with A > 0: clipped, loss -1.3).
    Token reduction: (2 x -1.2214 + 3 x 0.8 - 1.3) / 6 tokens. Only seq 0 gets gradient: -A s = -1.2214
    per token (d s_i,t / d logp_t = s_i), over the 6 tokens; the clipped sequences get exactly 0."""
    new, old, adv, mask = gspo_batch()
    s0 = math.exp(0.2)
    loss, grad, metrics = loss_and_grad(new, old, adv, mask, "gspo", eps=(0.2, 0.3))
    assert loss.item() == pytest.approx((-2 * s0 + 3 * 0.8 - 1.3) / 6, abs=1e-6)
    expected = torch.tensor([[-s0 / 6, -s0 / 6, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    # Clip fractions count tokens: seq 2's one token from above, seq 1's three from below, of 6.
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["clip_frac_low"] == pytest.approx(3 / 6)
    assert metrics["clip_frac"] == pytest.approx(4 / 6)
    # The per-token clip sees each token's own ratio (seq 0's e^0.3 = 1.35 is clipped there): another loss.
    clip, _, _ = loss_and_grad(new, old, adv, mask, "clip", eps=(0.2, 0.3))
    assert abs(clip.item() - loss.item()) > 1e-3


def test_gspo_with_the_sample_reduction_is_the_papers_sequence_objective():
    """Per-sequence means -1.2214, 0.8, -1.3, averaged over 3 sequences; seq 0's gradient -s0 / (2 x 3)
    on each of its two tokens, i.e. d/d logp_t of -(1/3) s0 with s0 = exp(mean of its 2 log-ratios)."""
    new, old, adv, mask = gspo_batch()
    s0 = math.exp(0.2)
    loss, grad, _ = loss_and_grad(new, old, adv, mask, "gspo", eps=(0.2, 0.3), reduction="sample")
    assert loss.item() == pytest.approx((-s0 + 0.8 - 1.3) / 3, abs=1e-6)
    assert grad[0, :2].tolist() == pytest.approx([-s0 / 6, -s0 / 6], abs=1e-6)
    assert grad[1:].abs().sum() == 0.0


@FAST
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000))
def test_property_gspo_token_form_equals_the_sequence_ratio_objective(n, t, seed):
    """Against an independent formula: J = -(1/#seq) sum_i min(s_i A_i, clip(s_i) A_i), with s_i the
    differentiable exp(mean log-ratio) (no stop-gradient trick): same value and gradient."""
    new, old, adv, mask = random_batch(seed, n, t)
    loss, grad, _ = loss_and_grad(new, old, adv, mask, "gspo", eps=(0.05, 0.08), reduction="sample")
    direct = new.detach().clone().requires_grad_(True)
    valid = mask.float()
    s = torch.exp(((direct - old) * valid).sum(-1) / valid.sum(-1).clamp(min=1))  # (N,)
    per_seq = -torch.minimum(s * adv, s.clamp(0.95, 1.08) * adv)
    kept = mask.any(-1)
    expected = (per_seq * kept).sum() / kept.sum().clamp(min=1)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(grad, direct.grad * valid, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- CISPO by hand


def test_cispo_clips_the_weight_and_keeps_the_gradient_of_clipped_tokens():
    """Tokens (A = +1) with log-probs ln 0.5 and ln 0.2 at ratios 1.5 and 8 (cap 1 + 4 = 5): weights
    1.5 and 5, token losses -1.5 ln 0.5 and -5 ln 0.2, gradients -1.5 and -5 (halved: 2 tokens). The
    8x token, which Eq. 10 would give no gradient, still gets -5 / 2."""
    new = torch.log(torch.tensor([[0.5, 0.2]]))
    old = new - torch.log(torch.tensor([[1.5, 8.0]]))
    loss, grad, metrics = loss_and_grad(new, old, torch.tensor([1.0]), torch.ones(1, 2), "cispo", eps=(1.0, 4.0))
    assert loss.item() == pytest.approx((-1.5 * math.log(0.5) - 5.0 * math.log(0.2)) / 2, rel=1e-6)
    assert grad[0].tolist() == pytest.approx([-1.5 / 2, -5.0 / 2], rel=1e-6)
    assert metrics["clip_frac_high"] == 0.5 and metrics["clip_frac_low"] == 0.0
    _, clip_grad, _ = loss_and_grad(new, old, torch.tensor([1.0]), torch.ones(1, 2), "clip", eps=(0.2, 4.0))
    assert clip_grad[0, 1] == 0.0  # Eq. 10 drops the 8x token


def test_cispo_lower_bound_floors_the_weight_whatever_the_advantage():
    """A = -1 at ratio 0.5: with cispo_eps_low 0.2 the weight is 0.8 (gradient +0.8), with 1 (no
    floor) it is 0.5; a ratio of 6 with A = -1 is capped too (weight 5), and counted as clipped."""
    old = torch.log(torch.tensor([[0.5, 0.5]])) - torch.log(torch.tensor([[0.5, 6.0]]))
    new = torch.log(torch.tensor([[0.5, 0.5]]))
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 2)
    _, floored, m_floor = loss_and_grad(new, old, adv, mask, "cispo", eps=(0.2, 4.0), reduction="sample")
    _, free, m_free = loss_and_grad(new, old, adv, mask, "cispo", eps=(1.0, 4.0), reduction="sample")
    assert floored[0].tolist() == pytest.approx([0.8 / 2, 5.0 / 2], rel=1e-6)
    assert free[0].tolist() == pytest.approx([0.5 / 2, 5.0 / 2], rel=1e-6)
    assert (m_floor["clip_frac_low"], m_floor["clip_frac_high"]) == (0.5, 0.5)
    assert (m_free["clip_frac_low"], m_free["clip_frac_high"]) == (0.0, 0.5)


def test_cispo_keeps_the_gradient_of_a_token_beyond_the_log_ratio_clamp():
    """Two tokens, A = +1, cap 5: log r = 25 (past the +-20 clamp, algo.LOG_RATIO_LIMIT) and -0.2. CISPO's
    loss is -sg(w) A log pi, so the clamp may bound the weight (e^20 capped to 5) but not cut log pi's
    gradient: -5 / 2 and -e^-0.2 / 2 = -0.409 (2 tokens), as verl and TRL give. Eq. 10 gives the
    clamped token none (it is clipped), and its other token the same -0.409."""
    new = torch.tensor([[-1.0, -2.0]])
    old = new - torch.tensor([[25.0, -0.2]])
    _, grad, _ = loss_and_grad(new, old, torch.tensor([1.0]), torch.ones(1, 2), "cispo", eps=(1.0, 4.0))
    assert grad[0].tolist() == pytest.approx([-2.5, -math.exp(-0.2) / 2], rel=1e-6)
    _, clip_grad, _ = loss_and_grad(new, old, torch.tensor([1.0]), torch.ones(1, 2), "clip")
    assert clip_grad[0].tolist() == pytest.approx([0.0, -math.exp(-0.2) / 2], rel=1e-6)


# ---------------------------------------------------------------- each bound moves its own clip metric


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_each_clip_bound_moves_its_clip_fraction(objective):
    """Wider bounds clip fewer tokens, each side its own metric; the other side's metric stays."""
    new, old, adv, mask = random_batch(seed=3, n=40, t=12)
    tight, wide = (1e-3, 1e-3), (0.5, 0.5)
    fractions = {}
    for name, (low, high) in {"tight": (tight[0], tight[1]), "wide high": (tight[0], wide[1]),
                              "wide low": (wide[0], tight[1])}.items():
        _, _, metrics = loss_and_grad(new, old, adv, mask, objective, eps=(low, high))
        fractions[name] = metrics["clip_frac_low"], metrics["clip_frac_high"]
    assert fractions["tight"][1] > fractions["wide high"][1] and fractions["tight"][0] == fractions["wide high"][0]
    assert fractions["tight"][0] > fractions["wide low"][0] and fractions["tight"][1] == fractions["wide low"][1]


# ---------------------------------------------------------------- Dr. GRPO's constant normaliser


def test_constant_reduction_divides_by_sequences_times_the_budget():
    """Rows of 3, 0 and 2 valid tokens, L_max 8: the empty row (overlong filtering) is no sequence of
    the loss, so the normaliser is 2 x 8 = 16 whatever the lengths."""
    masks = [torch.tensor([[1, 1, 1], [0, 0, 0]]), torch.tensor([[1, 1, 0]])]
    assert loss_normalizer(masks, "constant", max_tokens=8) == 16.0
    assert loss_normalizer(masks, "constant") == 6.0  # without a budget: 2 sequences x each mask's width 3
    with pytest.raises(ValueError, match="max_tokens"):
        loss_normalizer(masks, "constant", max_tokens=0)
    new, old = torch.zeros(1, 3), torch.zeros(1, 3)  # ratio 1: clip's token loss is -A
    loss, _ = policy_loss(new, old, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]), 0.2, 0.28,
                          reduction="constant", normalizer=16.0)
    assert loss.item() == pytest.approx(-2.0 * 2 / 16)  # two tokens of -2, over 16
    default, _ = policy_loss(new, old, torch.tensor([2.0]), torch.tensor([[1, 1, 0]]), 0.2, 0.28,
                             reduction="constant")
    assert default.item() == pytest.approx(-2.0 * 2 / 3)  # one sequence x its width 3


def test_constant_reduction_gives_no_length_bias():
    """Doubling one completion's length doubles its share of the gradient under "constant", and
    leaves it unchanged under "sample" (GRPO's 1/|o_i|)."""
    new, old, adv = torch.zeros(2, 4), torch.zeros(2, 4), torch.tensor([1.0, 1.0])
    short, long = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    shares = {}
    for reduction in ("constant", "sample"):
        norm = [loss_normalizer([m], reduction, max_tokens=4) for m in (short, long)]
        _, g_short, _ = loss_and_grad(new, old, adv, short, "clip", reduction=reduction, normalizer=norm[0])
        _, g_long, _ = loss_and_grad(new, old, adv, long, "clip", reduction=reduction, normalizer=norm[1])
        shares[reduction] = float(g_long[0].sum() / g_short[0].sum())
    assert shares == pytest.approx({"constant": 2.0, "sample": 1.0})


# ---------------------------------------------------------------- exact over micro-batches, masked rows


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_every_objective_and_reduction_accumulates_to_one_batch(objective, reduction, parts):
    """k micro-batches, each divided by the whole step's units, give the loss and gradient of one."""
    new, old, adv, mask = random_batch(seed=parts, n=11, t=7)
    rows = torch.arange(11).tensor_split(parts)
    normalizer = loss_normalizer([mask[r] for r in rows], reduction, max_tokens=7)
    full_loss, full_grad, _ = loss_and_grad(new, old, adv, mask, objective, reduction=reduction, normalizer=normalizer)
    pieces = [loss_and_grad(new[r], old[r], adv[r], mask[r], objective, reduction=reduction, normalizer=normalizer)
              for r in rows]
    assert sum(p[0] for p in pieces).item() == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in pieces]), full_grad, atol=1e-6, rtol=0)


@FAST
@given(st.integers(2, 10), st.integers(1, 6), st.integers(0, 10_000), st.sampled_from(OBJECTIVES),
       st.sampled_from(REDUCTIONS))
def test_property_a_masked_row_neither_adds_nor_counts(n, t, seed, objective, reduction):
    """A completion masked out entirely (overlong filtering) changes neither the loss, the others'
    gradient nor the normaliser: the batch without it gives the same; it gets no gradient; all finite."""
    new, old, adv, mask = random_batch(seed, n, t)
    mask[0] = False
    old[0] = float("nan")  # whatever a filtered row holds never reaches the result
    normalizer = loss_normalizer([mask], reduction, max_tokens=t)
    assert normalizer == loss_normalizer([mask[1:]], reduction, max_tokens=t)
    loss, grad, metrics = loss_and_grad(new, old, adv, mask, objective, reduction=reduction,
                                        normalizer=normalizer or None)
    rest, rest_grad, _ = loss_and_grad(new[1:], old[1:], adv[1:], mask[1:], objective, reduction=reduction,
                                       normalizer=normalizer or None)
    assert torch.isfinite(grad).all() and grad[0].abs().sum() == 0.0
    assert loss.item() == pytest.approx(rest.item(), abs=1e-6)
    torch.testing.assert_close(grad[1:], rest_grad, atol=1e-6, rtol=0)
    assert 0.0 <= metrics["clip_frac"] <= 1.0
    assert metrics["clip_frac"] == pytest.approx(metrics["clip_frac_high"] + metrics["clip_frac_low"], abs=1e-6)


# ---------------------------------------------------------------- objective x rollout correction


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_token_weights_compose_with_every_objective_token_by_token(objective, reduction):
    """The rollout correction's weights scale each token's objective loss and nothing else, whatever
    the objective: the weighted loss and gradient are sum_t w_t times the loss and gradient with a
    one-hot weight on token t (a weight inside GSPO's sequence ratio or CISPO's clip would break this
    linearity), the normaliser does not move with the weights, and the k3 KL term is added unweighted."""
    new, old, adv, mask = random_batch(seed=7, n=4, t=5)
    mask[:, 0] = True  # every row has a token, so no row drops out of the sample/constant units
    weight = 0.5 + torch.rand(4, 5, generator=torch.Generator().manual_seed(3))
    loss, grad, _ = loss_and_grad(new, old, adv, mask, objective, reduction=reduction, token_weight=weight)
    want_loss, want_grad = torch.zeros(()), torch.zeros_like(new)
    for i, j in mask.nonzero().tolist():
        one_hot = torch.zeros_like(weight)
        one_hot[i, j] = 1.0
        part, part_grad, _ = loss_and_grad(new, old, adv, mask, objective, reduction=reduction, token_weight=one_hot)
        want_loss, want_grad = want_loss + weight[i, j] * part, want_grad + weight[i, j] * part_grad
    assert loss.item() == pytest.approx(want_loss.item(), abs=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=0)
    unweighted, _, _ = loss_and_grad(new, old, adv, mask, objective, reduction=reduction)
    assert abs(unweighted.item() - loss.item()) > 1e-4  # the weights did act
    ref = old + 0.2
    kl_terms = [loss_and_grad(new, old, adv, mask, objective, reduction=reduction, token_weight=w, ref_logprobs=ref,
                              beta=0.1)[0] - loss_and_grad(new, old, adv, mask, objective, reduction=reduction,
                                                           token_weight=w)[0] for w in (weight, None)]
    assert kl_terms[0].item() == pytest.approx(kl_terms[1].item(), abs=1e-6) and kl_terms[1].item() > 0


# ---------------------------------------------------------------- per completion (per_row, for the rollout records)


def test_per_row_gives_each_completions_mean_ratio_and_clipped_share():
    """clip with bounds [0.8, 1.28], old log-probs 0. Row 0 (A = +1): ratios e^0.5 = 1.6487 (above 1.28:
    clipped) and e^0 = 1 -> mean 1.3244, clipped 1/2. Row 1 (A = -1): e^-0.5 = 0.6065 (below 0.8:
    clipped), e^0.1 = 1.1052, e^0 = 1 -> mean 0.9039, clipped 1/3. Row 2 has no valid token: NaN.
    The step's figures are the token-weighted means of the rows': ratio (1.6487 + 1 + 0.6065 + 1.1052
    + 1) / 5, clip_frac 2 / 5."""
    new = torch.tensor([[0.5, 0.0, 7.0], [-0.5, 0.1, 0.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    _, metrics = policy_loss(new, torch.zeros(3, 3), torch.tensor([1.0, -1.0, 1.0]), mask, 0.2, 0.28, per_row=True)
    e = math.exp
    ratios = metrics["row_ratio_mean"]
    assert ratios[:2] == pytest.approx([(e(0.5) + 1) / 2, (e(-0.5) + e(0.1) + 1) / 3], abs=1e-6)
    assert metrics["row_clip_frac"][:2] == pytest.approx([1 / 2, 1 / 3])
    assert math.isnan(ratios[2]) and math.isnan(metrics["row_clip_frac"][2])
    assert metrics["ratio_mean"] == pytest.approx((e(0.5) + 1 + e(-0.5) + e(0.1) + 1) / 5, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_per_row_leaves_the_loss_and_the_step_metrics_as_they_were(objective):
    """per_row adds two lists and changes nothing else; without it no per-token tensor leaks into the
    metrics (the objectives' clipped tokens are taken out)."""
    new, old, adv, mask = random_batch(5, 6, 7)
    loss, grad, plain = loss_and_grad(new, old, adv, mask, objective)
    loss_rows, grad_rows, rows = loss_and_grad(new, old, adv, mask, objective, per_row=True)
    assert torch.equal(loss, loss_rows) and torch.equal(grad, grad_rows)
    assert {key: value for key, value in rows.items() if not key.startswith("row_")} == plain
    assert all(isinstance(value, float) for value in plain.values())
    assert len(rows["row_ratio_mean"]) == len(rows["row_clip_frac"]) == 6


def test_an_objective_that_reports_no_clipped_tokens_has_no_clipped_share():
    from dapo_train.algo import POLICY_LOSSES

    POLICY_LOSSES["plain"] = lambda logprobs, old, adv, valid, settings: (-adv * logprobs, {})
    try:
        _, metrics = policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), 0.2, 0.28,
                                 objective="plain", per_row=True)
    finally:
        del POLICY_LOSSES["plain"]
    assert metrics["row_ratio_mean"] == [1.0] and math.isnan(metrics["row_clip_frac"][0])
