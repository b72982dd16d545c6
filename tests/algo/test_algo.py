"""Tests for dapo_train.algo: hand-computed numbers, accumulation equivalence, property tests."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.algo import (
    POLICY_LOSSES,
    LossSettings,
    group_advantages,
    informative_groups,
    is_informative_group,
    loss_normalizer,
    overlong_penalty,
    policy_loss,
    register_policy_loss,
)
from dapo_train.algo.correction import RolloutCorrection

FAST = settings(max_examples=50, deadline=None)


def log(x: float) -> float:
    return math.log(x)


def ratios_to_logprobs(ratios):
    """old log-probs 0 and new log-probs log(r), so exp(new - old) == r."""
    new = torch.log(torch.tensor(ratios, dtype=torch.float32))
    return new, torch.zeros_like(new)


def random_batch(seed: int, n: int, t: int, dtype=torch.float32):
    """Log-probs near the old ones (ratios spread around 1, some clipped) and ragged masks."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    new = (old + 0.4 * torch.randn(n, t, generator=g)).to(dtype)
    lengths = torch.randint(0, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    advantages = torch.randn(n, generator=g)
    return new, old, advantages, mask


# ---------------------------------------------------------------- Eq. 13


def test_overlong_penalty_hand_values():
    # L_max 20, L_cache 4: free up to 16 tokens, then -1/4 per extra token, -1 at 20 and beyond.
    assert overlong_penalty(10, 20, 4) == 0.0
    assert overlong_penalty(16, 20, 4) == 0.0
    assert overlong_penalty(17, 20, 4) == -0.25  # (16 - 17) / 4
    assert overlong_penalty(19, 20, 4) == -0.75  # (16 - 19) / 4
    assert overlong_penalty(20, 20, 4) == -1.0  # (16 - 20) / 4, meets the last piece
    assert overlong_penalty(25, 20, 4) == -1.0  # beyond L_max
    assert isinstance(overlong_penalty(17, 20, 4), float)


def test_overlong_penalty_tensor_keeps_shape():
    lengths = torch.tensor([[10, 16, 17], [18, 20, 30]])
    out = overlong_penalty(lengths, 20, 4)
    assert out.shape == (2, 3) and out.is_floating_point()
    expected = torch.tensor([[0.0, 0.0, -0.25], [-0.5, -1.0, -1.0]])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("cache", [0, -1, 21])
def test_overlong_penalty_rejects_bad_cache(cache):
    with pytest.raises(ValueError):
        overlong_penalty(5, 20, cache)


def test_overlong_penalty_cache_equal_to_max():
    # L_cache = L_max: the ramp starts at 0 tokens: |y| = 5 of 10 costs 0.5.
    assert overlong_penalty(5, 10, 10) == -0.5


# ---------------------------------------------------------------- Eq. 9


def test_group_advantages_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    eps = 1e-6
    pop = group_advantages(rewards, eps=eps, std="population")
    # Group 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps).
    a = 0.5 / (0.5 + eps)
    assert torch.allclose(pop[0], torch.tensor([a, -a, -a, a]), atol=1e-7)
    # Group 1: mean 0.75, population std sqrt(3/16) = 0.4330.
    s = math.sqrt(3 / 16) + eps
    assert torch.allclose(pop[1], torch.tensor([0.25 / s, 0.25 / s, 0.25 / s, -0.75 / s]), atol=1e-6)
    # Bessel: group 0 variance 1 / 3 (sum of squares 1 over G - 1 = 3).
    sample = group_advantages(rewards, eps=eps, std="sample")
    b = 0.5 / (math.sqrt(1 / 3) + eps)
    assert torch.allclose(sample[0], torch.tensor([b, -b, -b, b]), atol=1e-6)
    # "none": only centred.
    none = group_advantages(rewards, std="none")
    assert torch.equal(none, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))


def test_group_advantages_one_dimensional_and_integer_input():
    out = group_advantages(torch.tensor([2, 0]))  # mean 1, population std 1
    assert out.shape == (2,) and out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([1.0, -1.0]) / (1 + 1e-6))


@pytest.mark.parametrize("std", ["population", "sample", "none"])
def test_zero_variance_group_is_exactly_zero(std):
    # In float32 mean(0.9, 0.9, 0.9) is 0.9 - 6e-8; dividing that rounding error by std + eps
    # (~1e-6) would give A ~ 0.056 for a group that carries no signal. A must be 0 exactly.
    rewards = torch.tensor([[0.9, 0.9, 0.9], [0.0, 0.0, 0.0], [1.0, 0.0, 0.5]])
    out = group_advantages(rewards, std=std)
    assert torch.equal(out[:2], torch.zeros(2, 3))
    assert not torch.isnan(out).any() and out[2].abs().sum() > 0


def test_group_advantages_rejects_unknown_std():
    with pytest.raises(ValueError, match="allowed"):
        group_advantages(torch.zeros(2, 2), std="bessel")


# ---------------------------------------------------------------- Eq. 11


def test_is_informative_group():
    assert is_informative_group([True, False, False]) is True  # 0 < 1 correct < 3
    assert is_informative_group([True, True]) is False  # all correct: no signal
    assert is_informative_group(torch.tensor([0.0, 0.0, 0.0])) is False
    assert is_informative_group([0.5, 0.5, 0.25]) is True
    assert is_informative_group([]) is False
    with pytest.raises(ValueError, match="informative_groups"):
        is_informative_group([[1, 0]])


def test_informative_groups_batched():
    bits = torch.tensor([[True, True], [False, True], [False, False]])
    assert torch.equal(informative_groups(bits), torch.tensor([False, True, False]))
    assert informative_groups([[1.0, 2.0], [3.0, 3.0]]).tolist() == [True, False]


# ---------------------------------------------------------------- Eq. 10, 12: hand-computed loss


def hand_batch():
    """Two sequences. Seq 0 (A = +1) ratios 1.0, 1.5, 0.9; seq 1 (A = -1) ratios 0.5, 1.1, pad."""
    new, old = ratios_to_logprobs([[1.0, 1.5, 0.9], [0.5, 1.1, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return new, old, torch.tensor([1.0, -1.0]), mask


def test_policy_loss_token_hand_value():
    new, old, adv, mask = hand_batch()
    loss, metrics = policy_loss(new, old, adv, mask, 0.2, 0.28)
    # Token losses -min(rA, clip(r)A): seq 0: -1, -1.28 (1.5 capped at 1 + 0.28), -0.9;
    # seq 1 (A < 0): 0.8 (0.5 floored at 1 - 0.2), 1.1. Sum -1.28 over 5 valid tokens.
    assert loss.item() == pytest.approx(-1.28 / 5, abs=1e-6)
    assert metrics["num_tokens"] == 5.0
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)  # the 1.5 with A > 0
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)  # the 0.5 with A < 0
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.9 + 0.5 + 1.1) / 5, abs=1e-6)
    # approx_kl = mean(old - new) = -mean(log r) over the valid tokens.
    expected_kl = -(log(1.0) + log(1.5) + log(0.9) + log(0.5) + log(1.1)) / 5
    assert metrics["approx_kl"] == pytest.approx(expected_kl, abs=1e-6)
    assert "kl" not in metrics
    assert all(type(v) is float for v in metrics.values())


def test_policy_loss_sample_hand_value():
    new, old, adv, mask = hand_batch()
    loss, _ = policy_loss(new, old, adv, mask, 0.2, 0.28, reduction="sample")
    # Per-sequence means: (-1 - 1.28 - 0.9) / 3 = -1.06 and (0.8 + 1.1) / 2 = 0.95; mean -0.055.
    assert loss.item() == pytest.approx(-0.055, abs=1e-6)


def test_paper_clip_higher_example():
    # DAPO Sec. 3.1: with p_old = 0.01 and eps = 0.2 a token's probability can rise only to
    # 0.01 * 1.2 = 0.012 before the clip stops the gradient; with eps_high = 0.28, to 0.0128.
    old = torch.tensor([[log(0.01)]])
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 1)
    for eps_high, cap in [(0.2, 0.012), (0.28, 0.0128)]:
        new = torch.tensor([[log(0.02)]])  # far above the cap: the clipped term is the loss
        loss, _ = policy_loss(new, old, adv, mask, 0.2, eps_high)
        assert -loss.item() * 0.01 == pytest.approx(cap, rel=1e-5)  # loss = -(cap / p_old) * A
    # p_new = 0.0125 lies between the two caps: clipped (zero gradient) at eps 0.2 only.
    grads = []
    for eps_high in (0.2, 0.28):
        new = torch.tensor([[log(0.0125)]], requires_grad=True)
        policy_loss(new, old, adv, mask, 0.2, eps_high)[0].backward()
        grads.append(new.grad.item())
    assert grads[0] == 0.0
    assert grads[1] == pytest.approx(-1.25, rel=1e-5)  # d(-r A)/d logp = -r A with r = 1.25


def test_dual_clip_bounds_negative_advantage_loss():
    new, old = ratios_to_logprobs([[4.0, 2.0]])
    new.requires_grad_(True)
    adv = torch.tensor([-1.0])
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(new, old, adv, mask, 0.2, 0.28)
    # A < 0 and r > 1 + eps_high: not clipped by Eq. 10, so token losses are r * 1 = 4 and 2.
    assert plain.item() == pytest.approx((4.0 + 2.0) / 2, abs=1e-5)
    dual, _ = policy_loss(new, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    # Dual clip caps the first at -A * c = 3; the second (2 < 3) is unchanged.
    assert dual.item() == pytest.approx((3.0 + 2.0) / 2, abs=1e-5)
    dual.backward()
    assert new.grad[0, 0] == 0.0 and new.grad[0, 1] == pytest.approx(2.0 / 2, rel=1e-5)


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_rejects_c_at_most_one(c):
    new, old, adv, mask = hand_batch()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(new, old, adv, mask, 0.2, 0.28, clip_ratio_c=c)


def test_k3_kl_term():
    new = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    ref = torch.tensor([[log(0.5), 0.0]])
    mask = torch.ones(1, 2)
    adv = torch.zeros(1)  # A = 0: the PPO term vanishes, only beta * KL remains
    loss, metrics = policy_loss(new, old, adv, mask, 0.2, 0.28, ref_logprobs=ref, beta=0.1)
    # k3 with ref - logp = ln 0.5: 0.5 - ln 0.5 - 1 = 0.19315; with ref == logp it is 0.
    k3 = 0.5 - log(0.5) - 1.0
    assert metrics["kl"] == pytest.approx(k3 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(new, old, adv, mask, 0.2, 0.28, beta=0.1)


def test_the_kl_term_is_clamped_like_verls():
    """ref - logp = 99 overflows exp() (k3 = inf): as verl does, the log-ratio is clamped to +-20 and
    the per-token k3 to at most 10 (KL_TERM_LIMIT), so the loss is finite and that token's KL gives no
    gradient; a token inside the bounds keeps its exact k3 (0.5 - ln 0.5 - 1) and gradient (1 - 0.5)."""
    new = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[99.0, log(0.5)]])
    loss, metrics = policy_loss(new, torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), 0.2, 0.28,
                                ref_logprobs=ref, beta=0.1)
    loss.backward()
    k3 = 0.5 - log(0.5) - 1.0
    assert loss.item() == pytest.approx(0.1 * (10.0 + k3) / 2, rel=1e-6)
    assert metrics["kl"] == pytest.approx((10.0 + k3) / 2, rel=1e-6)
    assert new.grad[0].tolist() == pytest.approx([0.0, 0.1 * (1 - 0.5) / 2], rel=1e-6)


def test_rejects_unknown_reduction_and_bad_shapes():
    new, old, adv, mask = hand_batch()
    with pytest.raises(ValueError, match="allowed"):
        policy_loss(new, old, adv, mask, 0.2, 0.28, reduction="seq-mean")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(new, old, torch.zeros(3), mask, 0.2, 0.28)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(new, old, adv, mask[:, :2], 0.2, 0.28)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(new, old, adv, mask, 0.2, 0.28, normalizer=0)


def test_per_token_advantages_equal_broadcast_ones():
    new, old, adv, mask = hand_batch()
    a, _ = policy_loss(new, old, adv, mask, 0.2, 0.28)
    b, _ = policy_loss(new, old, adv[:, None].expand(2, 3), mask, 0.2, 0.28)
    assert torch.equal(a, b)


# ---------------------------------------------------------------- accumulation (Eq. 12)


def loss_and_grad(new, old, adv, mask, **kw):
    new = new.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(new, old, adv, mask, 0.2, 0.28, **kw)
    loss.backward()
    return loss.detach(), new.grad


def accumulated(new, old, adv, mask, parts, reduction, normalizer):
    total_loss, grads = torch.zeros(()), []
    for idx in torch.arange(new.shape[0]).tensor_split(parts):
        loss, grad = loss_and_grad(new[idx], old[idx], adv[idx], mask[idx], reduction=reduction, normalizer=normalizer)
        total_loss += loss
        grads.append(grad)
    return total_loss, torch.cat(grads)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_accumulation_equals_one_batch(parts, reduction):
    new, old, adv, mask = random_batch(seed=parts, n=11, t=7)
    full_loss, full_grad = loss_and_grad(new, old, adv, mask, reduction=reduction)
    step_normalizer = loss_normalizer([mask[idx] for idx in torch.arange(11).tensor_split(parts)], reduction)
    loss, grad = accumulated(new, old, adv, mask, parts, reduction, step_normalizer)
    assert abs(loss - full_loss) < 1e-6
    assert torch.allclose(grad, full_grad, atol=1e-6, rtol=0)


def _corrected_batch(seed: int, mode: str, n: int = 11, t: int = 7):
    """Random log-probs, behaviour log-probs off by up to +-0.8 and ragged masks, with `mode` applied as
    the planner does: weights on the tokens, masked tokens out of the mask before the normaliser."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    new = old + 0.3 * torch.randn(n, t, generator=g)
    behaviour = old + 1.6 * (torch.rand(n, t, generator=g) - 0.5)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    weight, masked, _ = RolloutCorrection(mode, cap=1.5)(old, behaviour, valid)
    return new, old, torch.randn(n, generator=g), valid & ~masked, weight


@pytest.mark.parametrize("mode", ["tis", "mis", "seq-tis", "seq-mis"])
@pytest.mark.parametrize("reduction", ["token", "sample"])
@pytest.mark.parametrize("parts", [2, 3, 5])
def test_accumulation_equals_one_batch_under_a_rollout_correction(mode, reduction, parts):
    """Eq. 12 stays exact: k micro-batches, each with its rows' weights and masks and the step's
    normaliser (counted from the corrected masks), add up to the loss and gradient of one batch; and the
    correction did act (another loss than without it)."""
    new, old, adv, mask, weight = _corrected_batch(parts, mode)

    def loss_and_grad(rows, normalizer):
        logprobs = new[rows].clone().requires_grad_(True)
        loss, _ = policy_loss(logprobs, old[rows], adv[rows], mask[rows], 0.2, 0.28, reduction=reduction,
                              normalizer=normalizer, token_weight=weight[rows])
        loss.backward()
        return loss.detach(), logprobs.grad

    everything = torch.arange(new.shape[0])
    full_loss, full_grad = loss_and_grad(everything, None)
    splits = everything.tensor_split(parts)
    step_normalizer = loss_normalizer([mask[rows] for rows in splits], reduction)
    results = [loss_and_grad(rows, step_normalizer) for rows in splits]
    assert abs(sum(loss for loss, _ in results) - full_loss) < 1e-6
    torch.testing.assert_close(torch.cat([grad for _, grad in results]), full_grad, atol=1e-6, rtol=0)
    uncorrected, _ = policy_loss(new, old, adv, _corrected_batch(parts, "off")[3], 0.2, 0.28, reduction=reduction)
    assert abs(float(uncorrected) - float(full_loss)) > 1e-4


def test_loss_normalizer_counts_each_reduction_in_its_own_units():
    # Rows of 3, 0 and 2 valid tokens, split over two micro-batches: 5 tokens; 2 sequences (the
    # empty row, e.g. a truncated completion under overlong filtering, is not a sequence of the loss).
    masks = [torch.tensor([[1, 1, 1], [0, 0, 0]]), torch.tensor([[1, 1, 0]])]
    assert loss_normalizer(masks, "token") == 5.0
    assert loss_normalizer(masks, "sample") == 2.0
    with pytest.raises(ValueError, match="unknown reduction"):
        loss_normalizer(masks, "mean")


def test_loss_settings_call_policy_loss_with_their_values():
    new, old, adv, mask = random_batch(seed=4, n=5, t=6)
    settings = LossSettings(eps_low=0.1, eps_high=0.5, reduction="sample", clip_ratio_c=2.0)
    expected = policy_loss(new, old, adv, mask, 0.1, 0.5, reduction="sample", clip_ratio_c=2.0, normalizer=7)
    assert settings(new, old, adv, mask, normalizer=7) == expected
    assert settings(new, old, adv, mask, normalizer=7) != LossSettings()(new, old, adv, mask, normalizer=7)


def _reinforce(logprobs, old_logprobs, advantages, valid, settings):
    """A toy objective defined outside the package: plain REINFORCE, -A * log pi per token, no ratio."""
    return -advantages * logprobs, {"toy_weight": advantages[valid].abs().mean()}


@pytest.fixture
def toy_objective():
    """`toy` registered through the public decorator for one test, then removed again."""
    register_policy_loss("toy")(_reinforce)
    yield "toy"
    del POLICY_LOSSES["toy"]


def test_an_objective_registered_outside_the_package_is_the_loss(toy_objective):
    """Two tokens with A = 2 (log-probs -1, -2) and one masked: loss = -(2 * -1 + 2 * -2) / 2 = 3 under
    the token reduction, its gradient -A / 2 = -1 on each valid log-prob and 0 on the masked one; its
    own metric reaches the caller beside the shared ones; the clip objective gives another loss."""
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = policy_loss(logprobs, old, torch.tensor([2.0]), mask, 0.2, 0.28, objective=toy_objective)
    assert float(loss) == pytest.approx(3.0)
    loss.backward()
    assert logprobs.grad.tolist() == [[-1.0, -1.0, 0.0]]
    assert metrics["toy_weight"] == pytest.approx(2.0) and metrics["num_tokens"] == 2.0
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.5) + 1.0) / 2, rel=1e-6)  # shared, from old
    assert "clip_frac_high" not in metrics  # the clip objective's metrics are its own
    clip, _ = policy_loss(logprobs.detach(), old, torch.tensor([2.0]), mask, 0.2, 0.28)
    assert float(clip) != pytest.approx(3.0)
    settings = LossSettings(objective=toy_objective)
    assert settings(logprobs.detach(), old, torch.tensor([2.0]), mask)[0] == pytest.approx(3.0)


def test_an_unknown_objective_is_refused_naming_the_registered_ones():
    new, old, adv, mask = random_batch(seed=1, n=2, t=3)
    with pytest.raises(ValueError, match="unknown objective 'ppo'.*clip"):
        policy_loss(new, old, adv, mask, 0.2, 0.28, objective="ppo")


def test_per_micro_batch_mean_is_not_the_batch_loss():
    # The bug Eq. 12 accumulation avoids: averaging each micro-batch by its own count.
    new, old, adv, mask = random_batch(seed=7, n=11, t=7)
    mask[0] = True  # make micro-batch counts unequal for sure
    mask[-1, 1:] = False
    full_loss, _ = loss_and_grad(new, old, adv, mask)
    parts = [loss_and_grad(new[i], old[i], adv[i], mask[i])[0] for i in torch.arange(11).tensor_split(2)]
    assert abs(sum(parts) / 2 - full_loss) > 1e-4


def test_token_and_sample_agree_only_for_equal_lengths():
    new, old, adv, _ = random_batch(seed=3, n=4, t=6)
    equal = torch.zeros(4, 6, dtype=torch.bool)
    equal[:, :4] = True  # every sequence 4 tokens: sum / 16 == mean of (sum_i / 4)
    tok, _ = policy_loss(new, old, adv, equal, 0.2, 0.28, reduction="token")
    smp, _ = policy_loss(new, old, adv, equal, 0.2, 0.28, reduction="sample")
    assert abs(tok - smp) < 1e-6
    ragged = equal.clone()
    ragged[0, 4:] = True  # sequence 0 now 6 tokens: token-level weighs it more
    tok, _ = policy_loss(new, old, adv, ragged, 0.2, 0.28, reduction="token")
    smp, _ = policy_loss(new, old, adv, ragged, 0.2, 0.28, reduction="sample")
    assert abs(tok - smp) > 1e-4


# ---------------------------------------------------------------- degenerate inputs and dtypes


def test_zero_variance_groups_give_zero_loss_and_gradient():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    adv = group_advantages(rewards).reshape(-1)  # (N,) = 0
    new, old, _, mask = random_batch(seed=1, n=4, t=5)
    loss, grad = loss_and_grad(new, old, adv, mask)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_all_masked_micro_batch_is_zero_not_nan(reduction):
    # Padding may hold anything, including -inf / NaN old log-probs; none of it may leak.
    new = torch.randn(2, 3)
    old = torch.tensor([[float("-inf"), float("nan"), 0.0], [50.0, -50.0, float("inf")]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.zeros(2, 3, dtype=torch.bool)
    ref = torch.full((2, 3), float("nan"))
    for normalizer in (None, 12):
        new_grad = new.clone().requires_grad_(True)
        loss, metrics = policy_loss(new_grad, old, adv, mask, 0.2, 0.28, reduction=reduction,
                                    normalizer=normalizer, ref_logprobs=ref, beta=0.1, clip_ratio_c=3.0)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.equal(new_grad.grad, torch.zeros(2, 3))
        assert all(v == 0.0 for v in metrics.values()), metrics


def test_padding_values_do_not_change_loss():
    new, old, adv, mask = hand_batch()
    dirty_old = old.clone()
    dirty_old[1, 2] = float("nan")  # the padded slot
    clean, _ = loss_and_grad(new, old, adv, mask)
    dirty, grad = loss_and_grad(new, dirty_old, adv, mask)
    assert torch.equal(clean, dirty) and not torch.isnan(grad).any()


def test_bf16_inputs_compute_in_float32():
    new, old, adv, mask = random_batch(seed=5, n=6, t=5, dtype=torch.bfloat16)
    new.requires_grad_(True)
    loss, _ = policy_loss(new, old.to(torch.bfloat16), adv.to(torch.bfloat16), mask, 0.2, 0.28)
    assert loss.dtype == torch.float32
    loss.backward()
    assert new.grad.dtype == torch.bfloat16
    # Same loss as the float32 computation on the bf16-rounded values.
    ref, _ = policy_loss(new.detach().float(), old.to(torch.bfloat16).float(),
                         adv.to(torch.bfloat16).float(), mask, 0.2, 0.28)
    assert abs(loss.item() - ref.item()) < 1e-6


# ---------------------------------------------------------------- properties


@FAST
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000), st.sampled_from(["token", "sample"]))
def test_property_loss_finite_metrics_bounded(n, t, seed, reduction):
    new, old, adv, mask = random_batch(seed, n, t)
    loss, grad = loss_and_grad(new, old, adv, mask, reduction=reduction)
    _, metrics = policy_loss(new, old, adv, mask, 0.2, 0.28, reduction=reduction)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))  # padding gets no gradient
    assert 0.0 <= metrics["clip_frac"] <= 1.0
    assert metrics["clip_frac"] == pytest.approx(metrics["clip_frac_high"] + metrics["clip_frac_low"], abs=1e-6)
    assert metrics["num_tokens"] == mask.sum().item()


@FAST
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 10_000))
def test_property_token_loss_matches_loop(n, t, seed):
    # An independent per-token Python loop of Eq. 10 + Eq. 12.
    new, old, adv, mask = random_batch(seed, n, t)
    total, count = 0.0, 0
    for i in range(n):
        for j in range(t):
            if mask[i, j]:
                r = math.exp(new[i, j].item() - old[i, j].item())
                a = adv[i].item()
                total += -min(r * a, min(max(r, 0.8), 1.28) * a)
                count += 1
    loss, _ = policy_loss(new, old, adv, mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(total / max(count, 1), abs=1e-5)


@FAST
@given(st.integers(2, 12), st.integers(1, 6), st.integers(0, 10_000), st.sampled_from(["token", "sample"]))
def test_property_accumulation_any_split(n, t, seed, reduction):
    new, old, adv, mask = random_batch(seed, n, t)
    parts = 1 + seed % n
    full_loss, full_grad = loss_and_grad(new, old, adv, mask, reduction=reduction)
    normalizer = loss_normalizer([mask[idx] for idx in torch.arange(n).tensor_split(parts)], reduction)
    loss, grad = accumulated(new, old, adv, mask, parts, reduction, normalizer)
    assert abs(loss - full_loss) < 1e-6 and torch.allclose(grad, full_grad, atol=1e-6, rtol=0)


@FAST
@given(st.lists(st.lists(st.floats(-5, 5), min_size=4, max_size=4), min_size=1, max_size=5))
def test_property_advantages_centred_and_scaled(rows):
    rewards = torch.tensor(rows, dtype=torch.float64)
    adv = group_advantages(rewards, eps=1e-12)
    assert torch.allclose(adv.mean(-1), torch.zeros(len(rows), dtype=torch.float64), atol=1e-9)
    spread = rewards.std(-1, correction=0) > 1e-3
    # With eps negligible, each informative group has population std 1 after scaling.
    if spread.any():
        scaled_std = adv[spread].std(-1, correction=0)
        assert torch.allclose(scaled_std, torch.ones_like(scaled_std), atol=1e-6)
    assert torch.equal(informative_groups(rewards), adv.abs().sum(-1) > 0)


@FAST
@given(st.integers(0, 40), st.integers(1, 20), st.integers(1, 20))
def test_property_overlong_penalty_monotone(length, max_extra, cache):
    max_length = cache + max_extra - 1
    now, nxt = overlong_penalty(length, max_length, cache), overlong_penalty(length + 1, max_length, cache)
    assert -1.0 <= nxt <= now <= 0.0
    assert overlong_penalty(torch.tensor([length]), max_length, cache).item() == pytest.approx(now)
