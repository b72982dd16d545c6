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
