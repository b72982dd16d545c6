"""The behaviour-vs-training maths (dapo_train.algo.correction, and the truncated behaviour distribution of
decoding): hand-computed corrections, mismatch sums and token weights. (Eq. 12 under a correction:
tests/algo/test_algo.py, tests/train/update/test_passes.py, tests/test_distributed.py.)"""

import math

import pytest
import torch

from dapo_train.algo import policy_loss
from dapo_train.algo.correction import ROLLOUT_CORRECTIONS, RolloutCorrection, rollout_mismatch
from dapo_train.rollout.sampling import SamplingSettings, behaviour_distribution

# Two rows. Row 0: four tokens whose weights pi_old / pi_behav are 3, 1/4, 1.5, 1. Row 1: two tokens with
# weights 2.5 and 2, then a padded slot holding garbage (NaN) that must not reach anything.
WEIGHTS = [[3.0, 0.25, 1.5, 1.0], [2.5, 2.0, 1.0, 1.0]]
BEHAVIOUR = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.2, -0.7, float("nan"), 0.0]])
OLD = BEHAVIOUR + torch.log(torch.tensor(WEIGHTS))
VALID = torch.tensor([[True, True, True, True], [True, True, False, False]])


def test_token_level_tis_truncates_each_weight_at_the_cap():
    weight, masked, changed = RolloutCorrection("tis", cap=2.0)(OLD, BEHAVIOUR, VALID)
    # min(w, 2): 3 -> 2 and 2.5 -> 2; the rest as they are; off the mask 1.
    torch.testing.assert_close(weight, torch.tensor([[2.0, 0.25, 1.5, 1.0], [2.0, 2.0, 1.0, 1.0]]))
    assert not masked.any()
    assert changed.tolist() == [[True, False, False, False], [True, False, False, False]]


def test_token_level_mis_masks_the_tokens_whose_weight_leaves_the_interval():
    weight, masked, changed = RolloutCorrection("mis", cap=2.0)(OLD, BEHAVIOUR, VALID)
    # Kept: 1/2 <= w <= 2, i.e. 1.5, 1 and 2 (the bound itself); masked: 3, 1/4 and 2.5.
    assert masked.tolist() == [[True, True, False, False], [True, False, False, False]]
    assert torch.equal(changed, masked) and torch.equal(weight, torch.ones(2, 4))


def test_sequence_level_forms_use_the_product_of_a_rows_weights():
    # Row 0: 3 x 1/4 x 1.5 x 1 = 1.125, inside [1/2, 2]: weight 1.125 everywhere, nothing masked.
    # Row 1: 2.5 x 2 = 5 > 2: seq-tis weighs both tokens 2, seq-mis masks the whole row.
    weight, masked, changed = RolloutCorrection("seq-tis", cap=2.0)(OLD, BEHAVIOUR, VALID)
    torch.testing.assert_close(weight, torch.tensor([[1.125] * 4, [2.0, 2.0, 1.0, 1.0]]))
    assert not masked.any() and changed.tolist() == [[False] * 4, [True, True, False, False]]
    weight, masked, changed = RolloutCorrection("seq-mis", cap=2.0)(OLD, BEHAVIOUR, VALID)
    assert masked.tolist() == [[False] * 4, [True, True, False, False]] and torch.equal(changed, masked)
    assert torch.equal(weight, torch.ones(2, 4))


def test_off_changes_nothing_and_bad_settings_are_refused():
    weight, masked, changed = RolloutCorrection("off")(OLD, BEHAVIOUR, VALID)
    assert torch.equal(weight, torch.ones(2, 4)) and not masked.any() and not changed.any()
    assert set(ROLLOUT_CORRECTIONS) == {"off", "tis", "mis", "seq-tis", "seq-mis"}
    with pytest.raises(ValueError, match="unknown mode 'is'"):
        RolloutCorrection("is")(OLD, BEHAVIOUR, VALID)
    with pytest.raises(ValueError, match="cap must be > 1"):
        RolloutCorrection("tis", cap=1.0)(OLD, BEHAVIOUR, VALID)


def test_the_mismatch_sums_by_hand():
    """Training log-probs -1 and -2 against behaviour -1.5 and -2 (d = 0.5 and 0), a third token masked:
    k3 = expm1(0.5) - 0.5 = 0.14872 (0 for d = 0); |d| sums to 0.5; weights e^0.5 + 1 = 2.64872; with
    cap 1.5 tis truncates e^0.5 = 1.6487 (one token), mis keeps it (|0.5| < ln 2 at cap 2), and mode
    off reports what tis would truncate."""
    training = torch.tensor([[-1.0, -2.0, 7.0]])
    behaviour = torch.tensor([[-1.5, -2.0, float("nan")]])
    valid = torch.tensor([[True, True, False]])
    sums, largest = rollout_mismatch(training, behaviour, valid, RolloutCorrection("tis", cap=1.5))
    assert sums["tokens"] == 2.0 and float(largest) == pytest.approx(0.5)
    assert float(sums["kl"]) == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-6)
    assert float(sums["logprob_diff"]) == pytest.approx(0.5, rel=1e-6)
    assert float(sums["is_weight"]) == pytest.approx(math.exp(0.5) + 1.0, rel=1e-6)
    assert float(sums["is_clipped"]) == 1.0
    assert float(rollout_mismatch(training, behaviour, valid, RolloutCorrection("mis", cap=2.0))[0]["is_clipped"]) == 0
    assert float(rollout_mismatch(training, behaviour, valid, RolloutCorrection("off", cap=1.5))[0]["is_clipped"]) == 1


def test_a_huge_mismatch_stays_finite():
    sums, largest = rollout_mismatch(torch.tensor([[0.0]]), torch.tensor([[-200.0]]), torch.ones(1, 1, dtype=bool),
                                     RolloutCorrection("tis"))
    assert all(math.isfinite(float(v)) for v in sums.values()) and float(largest) == 20.0  # algo.LOG_RATIO_LIMIT


def test_top_p_truncation_by_hand():
    """softmax([2, 1, 0.5, -1, 0]) = [0.563, 0.207, 0.126, 0.028, 0.076]; top_p 0.7 keeps the smallest set
    whose mass reaches 0.7, the first two (0.770), renormalised: log(p_i / 0.770), -inf for the rest."""
    scores = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    got = behaviour_distribution(scores, SamplingSettings(1, top_p=0.7))
    p = torch.softmax(scores[0], -1)
    kept = p[0] + p[1]
    torch.testing.assert_close(got[0, :2], torch.log(p[:2] / kept))
    assert torch.isinf(got[0, 2:]).all()
    greedy = behaviour_distribution(scores, SamplingSettings(1, do_sample=False, top_k=1, temperature=0.5))
    torch.testing.assert_close(greedy, torch.log_softmax(scores, -1))  # greedy: no temperature, no truncation


def test_token_weights_scale_the_objective_but_not_the_kl():
    """Ratio 1 and A = 1: each token's clip loss is -1; weights 2 and 0.5 make the loss (-2 - 0.5) / 2 and
    the gradient -w / 2 per token. The k3 term (ref = logp here, so 0) is added unweighted."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    weight = torch.tensor([[2.0, 0.5]])
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.28,
                          token_weight=weight)
    assert float(loss.detach()) == pytest.approx(-1.25)
    loss.backward()
    assert logprobs.grad.tolist() == [[-1.0, -0.25]]
    ref = torch.tensor([[-1.0 + math.log(2.0), -2.0]])
    with_kl, metrics = policy_loss(logprobs.detach(), logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2),
                                   0.2, 0.28, token_weight=weight, ref_logprobs=ref, beta=0.1)
    k3 = 2.0 - math.log(2.0) - 1.0  # exp(ln 2) - ln 2 - 1 on the first token, 0 on the second
    assert float(with_kl) == pytest.approx(-1.25 + 0.1 * k3 / 2, rel=1e-6)
