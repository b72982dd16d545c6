"""scripts/studies/screening_on_paper.py: its closed forms against a simulation of prompts and groups."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def paper():
    path = ROOT / "scripts" / "studies" / "screening_on_paper.py"
    spec = importlib.util.spec_from_file_location("screening_on_paper", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _simulate(a, b, group, screen, drop, prompts=400_000, seed=0):
    """Draw pass rates and G Bernoulli completions per prompt; screen on the first k; count."""
    rng = np.random.default_rng(seed)
    p = rng.beta(a, b, prompts)
    right = rng.random((prompts, group)) < p[:, None]  # (prompts, G)
    count = right.sum(axis=1)
    mixed = (count > 0) & (count < group)
    if screen == 0:
        return mixed.size * group / (mixed.sum() * group), mixed.mean()
    first = right[:, :screen].sum(axis=1)
    out = np.zeros(prompts, dtype=bool)
    if "all_right" in drop:
        out |= first == screen
    if "all_wrong" in drop:
        out |= first == 0
    generated = screen * prompts + (group - screen) * (~out).sum()
    trained = (mixed & ~out).sum()
    return generated / (trained * group), trained / prompts


@pytest.mark.parametrize("a, b, group, screen, drop", [
    (7, 3, 4, 0, ()), (7, 3, 4, 2, ("all_wrong", "all_right")), (1.4, 0.6, 16, 8, ("all_right",)),
    (0.35, 0.15, 16, 2, ("all_wrong", "all_right")), (0.35, 0.15, 4, 2, ("all_wrong",)),
])
def test_the_closed_forms_match_a_simulation(paper, a, b, group, screen, drop):
    expected = paper.cost(a, b, group, screen, drop)
    per_trained, trained = _simulate(a, b, group, screen, drop)
    assert expected.generated_per_trained == pytest.approx(per_trained, rel=0.02)
    assert expected.trained_groups == pytest.approx(trained, abs=0.004)


def test_alike_prompts_match_the_binomial_by_hand(paper):
    """A huge concentration makes every prompt's pass rate 0.7: at G = 4, 0.7^4 = 0.2401 of the groups are
    all right and 0.3^4 = 0.0081 all wrong, so 1 / 0.7518 = 1.330 completions are generated per trained one."""
    a, b = paper.beta(0.7, 1e7)
    assert paper.moment(a, b, 4) == pytest.approx(0.2401, abs=1e-5)
    assert paper.cost(a, b, 4).generated_per_trained == pytest.approx(1 / 0.7518, abs=1e-4)


def _simulate_kept(p, group, screen, drop, prompts=400_000, seed=0):
    """Draw G Bernoulli(p) completions per prompt, screen on the first k, keep the mixed groups not ruled out:
    (kept per prompt, right answers per kept group, Eq. 9's mean advantage of a right and of a wrong answer, and
    the sum of the right answers' advantages per prompt drawn: sqrt(c (G - c)) a kept group)."""
    rng = np.random.default_rng(seed)
    right = rng.random((prompts, group)) < p  # (prompts, G)
    count = right.sum(axis=1)
    kept = (count > 0) & (count < group)
    first = right[:, :screen].sum(axis=1)
    if screen and "all_right" in drop:
        kept &= first != screen
    if screen and "all_wrong" in drop:
        kept &= first != 0
    rewards = right[kept].astype(float)  # (kept, G)
    advantages = (rewards - rewards.mean(axis=1, keepdims=True)) / rewards.std(axis=1, keepdims=True)
    pushed = (advantages * rewards).sum() / prompts
    return kept.mean(), count[kept].mean(), advantages[rewards == 1].mean(), advantages[rewards == 0].mean(), pushed


@pytest.mark.parametrize("p, group, screen, drop", [
    (0.1, 8, 0, ()), (0.1, 8, 2, ("all_wrong", "all_right")), (0.1, 8, 2, ("all_wrong",)),
    (0.7, 8, 2, ("all_wrong", "all_right")), (0.3, 16, 4, ("all_right",)),
])
def test_what_a_kept_group_holds_matches_a_simulation(paper, p, group, screen, drop):
    expected = paper.kept(p, group, screen, drop)
    per_prompt, right, advantage_right, advantage_wrong, update = _simulate_kept(p, group, screen, drop)
    assert expected.per_prompt == pytest.approx(per_prompt, abs=0.003)
    assert expected.right == pytest.approx(right, abs=0.01)
    assert expected.advantage_right == pytest.approx(advantage_right, abs=0.01)
    assert expected.advantage_wrong == pytest.approx(advantage_wrong, abs=0.01)
    assert expected.update == pytest.approx(update, rel=0.01)


def test_a_kept_group_by_hand(paper):
    """p = 0.1, G = 8, k = 2 (issue 47, item 15): without a screen E[c | 0 < c < 8] = (8p - 8p^8) / (1 - 0.9^8 -
    0.1^8) = 0.8 / 0.5695 = 1.405 (the mean of Bin(8, p) less the all-right groups' share); a screen ruling
    out both sides keeps only screens with 1 right of 2, and the 6 more add 6p: 1.60. At p = 0.5 both keep 4
    on average, by symmetry."""
    assert paper.kept(0.1, 8).right == pytest.approx((0.8 - 8 * 0.1**8) / (1 - 0.9**8 - 0.1**8), abs=1e-9)
    assert paper.kept(0.1, 8, 2).right == pytest.approx(1.6, abs=1e-9)
    assert paper.kept(0.5, 8).right == pytest.approx(4.0) and paper.kept(0.5, 8, 2).right == pytest.approx(4.0)


def test_the_docs_say_what_a_screen_does_to_the_kept_groups(paper):
    """docs/training.md holds the closed forms' table (G = 8, k = 2), and nothing claims any more that Eq. 9
    and Eq. 11 see a screened group as without a screen (issue 47, item 15)."""
    assert paper.kept_table(8, 2) in (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    sources = [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "dapo_train").rglob("*.py")]
    claims = [path.name for path in sources if "as without a screen" in path.read_text(encoding="utf-8")]
    assert claims == []
