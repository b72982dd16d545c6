"""Paired statistics (evaluation/stats.py) against answers computed here independently, and
`dapo-train compare --baseline` (study/compare.py) on hand-written runs with per-item records."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from dapo_train.config.load import load_config, save_config
from dapo_train.errors import UserError
from dapo_train.evaluation.stats import (
    bootstrap_difference,
    change_from_start,
    change_metrics,
    mcnemar,
    sign_test,
    student_t_quantile,
    t_interval,
)
from dapo_train.run.eval_items import FINAL, PERIODIC, write_items
from dapo_train.study.compare import compare_with_baseline

Z_95 = 1.959963984540054


# --------------------------------------------------------------------------------------------
# The bootstrap interval.


def _single_runs(both, baseline_only, other_only, neither):
    """(1, N) correctness rows of two runs built from the four paired counts."""
    baseline = [1] * both + [1] * baseline_only + [0] * other_only + [0] * neither
    other = [1] * both + [0] * baseline_only + [1] * other_only + [0] * neither
    return np.array([baseline]), np.array([other])


def test_the_interval_of_two_single_runs_is_the_paired_normal_one():
    """2000 items: 700 both right, 300 only the baseline, 400 only the other. Per item
    d = other - baseline is +1 on 400, -1 on 300, 0 else: mean 0.05, population variance
    (300 + 400) / 2000 - 0.05^2 = 0.3475, so the paired normal interval is 0.05 +- 1.96
    sqrt(0.3475 / 2000) = 0.05 +- 0.02584. Unpaired (accuracies 0.50 and 0.55 treated as independent)
    it would be +- 1.96 sqrt((0.25 + 0.2475) / 2000) = +- 0.0309: the tolerance below (0.0015, five
    times the Monte Carlo error of a 10,000-draw percentile) cannot be met by an unpaired bootstrap."""
    result = bootstrap_difference(*_single_runs(700, 300, 400, 600), seeds_paired=True)
    half = Z_95 * math.sqrt(0.3475 / 2000)
    assert (result.baseline_accuracy, result.accuracy, result.difference) == pytest.approx((0.5, 0.55, 0.05))
    assert result.low == pytest.approx(0.05 - half, abs=0.0015)
    assert result.high == pytest.approx(0.05 + half, abs=0.0015)
    assert result.std == pytest.approx(math.sqrt(0.3475 / 2000), rel=0.03)
    assert abs((result.high - result.low) / 2 - Z_95 * math.sqrt(0.4975 / 2000)) > 0.004  # far from unpaired


def test_an_exactly_known_bootstrap_distribution():
    """Three items, the other run right on the first only: a replicate's difference is k / 3 with
    k ~ Binomial(3, 1/3) the number of draws of that item. P(k = 0) = 8/27 > 2.5%, so the lower end
    is 0; P(k = 3) = 1/27 = 3.7% > 2.5%, so the upper end is 1."""
    result = bootstrap_difference(np.array([[0, 0, 0]]), np.array([[1, 0, 0]]), seeds_paired=True)
    assert (result.low, result.high) == (0.0, 1.0)
    assert result.difference == pytest.approx(1 / 3)


def _anova(table):
    """Population variances of the row effects, column effects and residual of a 2-D table."""
    mean = table.mean()
    rows, cols = table.mean(axis=1) - mean, table.mean(axis=0) - mean
    residual = table - mean - rows[:, None] - cols[None, :]
    return (rows**2).mean(), (cols**2).mean(), (residual**2).mean()


def _pigeonhole_variance(table):
    """Var of the mean of a (S, N) table when rows and columns are resampled independently
    (Owen 2007): var_rows / S + var_cols / N + var_residual / (S N), derived in evaluation/stats.py's terms."""
    seeds, items = table.shape
    rows, cols, residual = _anova(table)
    return rows / seeds + cols / items + residual / (seeds * items)


def _seeded_tables(seeds, items, rng, shift):
    """0/1 tables whose rows (seeds) differ a lot in accuracy, so the seed term matters."""
    rates = rng.uniform(0.2, 0.8, size=(seeds, 1))
    baseline = (rng.random((seeds, items)) < rates).astype(float)
    other = (rng.random((seeds, items)) < np.clip(rates + shift * rng.uniform(-1, 3, size=(seeds, 1)), 0, 1))
    return baseline, other.astype(float)


def test_seeds_and_items_paired_match_the_two_way_bootstrap_variance():
    baseline, other = _seeded_tables(8, 300, np.random.default_rng(1), shift=0.05)
    expected = _pigeonhole_variance(other - baseline)  # seeds paired: one table of differences
    seed_share = _anova(other - baseline)[0] / 8 / expected
    assert seed_share > 0.3  # an items-only bootstrap would miss a third of the variance: this test sees that
    result = bootstrap_difference(baseline, other, seeds_paired=True)
    # 10,000 replicates estimate a standard deviation to about 0.7%; 4% is far outside that noise.
    assert result.std == pytest.approx(math.sqrt(expected), rel=0.04)
    assert result.difference == pytest.approx((other - baseline).mean())


def test_unpaired_seeds_add_both_points_seed_variances():
    """Different seeds: each point's seeds are drawn on their own, the items once for both, so the
    variance is each point's seed and residual terms plus the item term of the column differences."""
    rng = np.random.default_rng(2)
    baseline, _ = _seeded_tables(6, 300, rng, shift=0.0)
    other, _ = _seeded_tables(4, 300, rng, shift=0.0)
    a_rows, _, a_res = _anova(baseline)
    b_rows, _, b_res = _anova(other)
    columns = other.mean(axis=0) - baseline.mean(axis=0)
    expected = a_rows / 6 + b_rows / 4 + columns.var() / 300 + a_res / (6 * 300) + b_res / (4 * 300)
    result = bootstrap_difference(baseline, other, seeds_paired=False)
    assert result.std == pytest.approx(math.sqrt(expected), rel=0.04)
    with pytest.raises(ValueError, match="as many"):
        bootstrap_difference(baseline, other, seeds_paired=True)


# --------------------------------------------------------------------------------------------
# McNemar and Student t, by hand.


@pytest.mark.parametrize(
    ("b", "c", "p", "method"),
    [
        (2, 8, 2 * (1 + 10 + 45) / 1024, "exact"),  # 2 P(X <= 2), X ~ Bin(10, 1/2): C(10,0..2) = 1, 10, 45
        (8, 2, 2 * (1 + 10 + 45) / 1024, "exact"),  # symmetric
        (5, 5, 1.0, "exact"),  # 2 P(X <= 5) = 2 * 638/1024 > 1: capped at 1
        (0, 0, 1.0, "exact"),  # no discordant item: no evidence either way
        (0, 6, 2 / 64, "exact"),  # 2 P(X = 0), X ~ Bin(6, 1/2)
        # 60 discordant: chi2 = (|20 - 40| - 1)^2 / 60 = 6.0167, sqrt = 2.4529; the normal table gives
        # Phi(2.45) = 0.99286, Phi(2.46) = 0.99305, so p = 2 (1 - 0.99292) = 0.0142.
        (20, 40, 0.0142, "chi2"),
    ],
)
def test_mcnemar_by_hand(b, c, p, method):
    result = mcnemar(b, c)
    assert (result.baseline_only, result.other_only, result.method) == (b, c, method)
    assert result.p == pytest.approx(p, abs=1e-4 if method == "chi2" else 1e-12)


@pytest.mark.parametrize(
    ("lost", "gained", "p"),
    [
        (4, 0, 1 / 16),  # P(X >= 4), X ~ Bin(4, 1/2): all four lost, the case (two-sided it is 1/8)
        (0, 4, 1.0),  # all gained: no evidence of worse
        (2, 2, (6 + 4 + 1) / 16),  # P(X >= 2) over C(4, 2..4) = 6, 4, 1
        (8, 2, (45 + 10 + 1) / 1024),  # P(X >= 8), X ~ Bin(10, 1/2): C(10, 8..10) = 45, 10, 1
        (13, 0, 2**-13),  # the fewest losses that pass 0.01 / 60 with nothing gained (2^-12 = 2.4e-4 does not)
        (0, 0, 1.0),  # no discordant item: no evidence either way
    ],
)
def test_the_one_sided_sign_test_by_hand(lost, gained, p):
    result = sign_test(lost, gained)
    assert (result.lost, result.gained) == (lost, gained)
    assert result.p == pytest.approx(p, rel=1e-12)


def test_the_sign_test_never_rejects_more_often_than_its_level():
    """Its size, computed here from the binomial law on its own: under 'no worse' every discordant item is a fair
    coin, and for every count of them the chance that p <= level is at most the level (exact, not asymptotic)."""
    for n in range(0, 121):
        for level in (0.05, 0.01, 0.01 / 8, 0.01 / 60):
            size = sum(math.comb(n, k) for k in range(n + 1) if sign_test(k, n - k).p <= level) / 2**n
            assert size <= level


def test_student_t_quantiles_and_interval():
    # df = 1 is the Cauchy: P(|T| <= t) = 2 atan(t) / pi; df = 2: P(|T| <= t) = t / sqrt(t^2 + 2).
    assert student_t_quantile(1) == pytest.approx(math.tan(0.95 * math.pi / 2), rel=1e-9)
    assert student_t_quantile(2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-9)
    assert student_t_quantile(5000) == pytest.approx(Z_95, abs=1e-3)  # the normal limit
    assert student_t_quantile(4) == pytest.approx(2.776, abs=1e-3)  # the printed table value
    # 1, 2, 3: mean 2, sample std 1, half-width t_{0.975, 2} / sqrt(3).
    interval = t_interval([1.0, 2.0, 3.0])
    half = 0.95 * math.sqrt(2 / (1 - 0.95**2)) / math.sqrt(3)
    assert (interval.mean, interval.low, interval.high, interval.n) == pytest.approx((2, 2 - half, 2 + half, 3))
    assert t_interval([0.5]) == type(interval)(0.5, None, None, 1)  # one pair: no interval


# --------------------------------------------------------------------------------------------
# compare --baseline on hand-written runs.


def _records(correct, uids=None, gold="1"):
    uids = uids or [f"test:{i}" for i in range(len(correct))]
    return [{"uid": uid, "gold": gold, "extracted": "1" if ok else "2", "correct": bool(ok), "format_ok": True,
             "length": 10, "truncated": False, "completion": ""} for uid, ok in zip(uids, correct)]


def make_run(run_dir, overrides, entropy, final=None, step_items=None, steps=2):
    """A run folder: config, metrics rows (entropy per step), and per-item files: `final` the
    correctness of the end-of-run eval at the last step, `step_items` {step: correctness}."""
    run_dir.mkdir(parents=True)
    save_config(load_config(None, [*overrides, f"output_dir={run_dir}"]), run_dir / "config.yaml")
    rows = [{"step": step, "entropy": entropy, "seconds_step": 1.0} for step in range(1, steps + 1)]
    if final is not None:
        rows[-1][FINAL.accuracy] = sum(final) / len(final)
        write_items(run_dir, FINAL, steps, _records(final))
    for step, correct in (step_items or {}).items():
        write_items(run_dir, PERIODIC, step, _records(correct))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run_dir


def test_two_single_runs_get_mcnemar_and_the_bootstrap(tmp_path):
    # 10 items: both right on 0-3, only the baseline on 4, only the other on 5-7 -> b = 1, c = 3.
    base = make_run(tmp_path / "a", ["dapo.eps_high=0.28"], 0.5, final=[1, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    other = make_run(tmp_path / "b", ["dapo.eps_high=0.5"], 0.6, final=[1, 1, 1, 1, 0, 1, 1, 1, 0, 0])
    rows = json.loads(compare_with_baseline([str(base), str(other)], str(base), as_json=True))
    assert rows[0]["paired"] == {"is_baseline": True}
    paired = rows[1]["paired"]
    assert (paired["eval"], paired["items"], paired["seeds_paired"]) == ("final", 10, True)
    assert paired["difference"] == pytest.approx(0.2)  # 0.7 - 0.5
    assert paired["mcnemar"] == {"baseline_only": 1, "other_only": 3, "p": 2 * (1 + 4) / 16, "method": "exact"}
    assert paired["low"] <= 0.2 <= paired["high"]
    assert paired["run_outcomes"]["entropy_last"] == {"mean": pytest.approx(0.1), "low": None, "high": None, "n": 1}
    text = compare_with_baseline([str(base), str(other)], "eps_high=0.28")
    assert "+0.200" in text and "1/3" in text and "0.625 exact" in text


def test_seeds_are_paired_and_entropy_gets_a_t_interval(tmp_path):
    for seed, (entropy, shift) in enumerate([(0.5, 0.1), (0.4, 0.2), (0.6, 0.3)], start=1):
        make_run(tmp_path / f"a{seed}", ["dapo.eps_high=0.28", f"seed={seed}"], entropy, final=[1, 0, 0, 1, 0, 0])
        make_run(tmp_path / f"b{seed}", ["dapo.eps_high=0.5", f"seed={seed}"], entropy + shift,
                 final=[1, 1, 0, 1, 0, 0])
    rows = json.loads(compare_with_baseline([str(tmp_path)], "dapo.eps_high=0.28", as_json=True))
    paired = rows[1]["paired"]
    assert paired["seeds"] == [1, 2, 3] and paired["seeds_paired"]
    assert paired["difference"] == pytest.approx(1 / 6) and paired["mcnemar"] is None
    # entropy differences 0.1, 0.2, 0.3: mean 0.2, sample std 0.1, half-width t_{0.975,2} 0.1 / sqrt(3)
    half = 0.95 * math.sqrt(2 / (1 - 0.95**2)) * 0.1 / math.sqrt(3)
    entropy = paired["run_outcomes"]["entropy_last"]
    assert (entropy["mean"], entropy["low"], entropy["high"]) == pytest.approx((0.2, 0.2 - half, 0.2 + half))


def _cost_rows(run_dir, generated, trained, seconds):
    """Rewrite a run's two training rows: each generated `generated` and trained `trained` tokens in
    `seconds` seconds (the final eval row make_run wrote is kept)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[:2]:
        row.update(generated_tokens=generated, trained_tokens=trained, seconds_step=seconds)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_generation_cost_and_wall_time_are_paired_by_seed(tmp_path):
    """What a setting costs, seed by seed: generated per trained token 2.0 vs 1.5, 1.4, 1.3 (differences
    -0.5, -0.6, -0.7) and wall time 2 x 10 s vs 2 x (12, 13, 14) s (differences 4, 6, 8)."""
    for seed, (ratio, seconds) in enumerate([(1.5, 12.0), (1.4, 13.0), (1.3, 14.0)], start=1):
        base = make_run(tmp_path / f"a{seed}", ["dapo.screen_size=0", f"seed={seed}"], 0.5, final=[1, 0])
        _cost_rows(base, 200, 100, 10.0)
        other = make_run(tmp_path / f"b{seed}", ["dapo.screen_size=2", f"seed={seed}"], 0.5, final=[1, 0])
        _cost_rows(other, ratio * 100, 100, seconds)
    rows = json.loads(compare_with_baseline([str(tmp_path)], "screen_size=0", as_json=True))
    outcomes = rows[1]["paired"]["run_outcomes"]
    half = 0.95 * math.sqrt(2 / (1 - 0.95**2)) / math.sqrt(3)  # t_{0.975,2} / sqrt(3); sample stds 0.1 and 2
    cost, wall = outcomes["generated_per_trained_token"], outcomes["wall_seconds"]
    assert (cost["mean"], cost["low"], cost["high"]) == pytest.approx((-0.6, -0.6 - 0.1 * half, -0.6 + 0.1 * half))
    assert (wall["mean"], wall["low"], wall["high"]) == pytest.approx((6, 6 - 2 * half, 6 + 2 * half))
    text = compare_with_baseline([str(tmp_path)], "screen_size=0")
    assert "Δ gen tok/trained" in text and "-0.600" in text and "Δ wall s" in text and "+6.000" in text


def test_the_latest_common_step_is_used_without_a_final_eval(tmp_path):
    base = make_run(tmp_path / "a", ["dapo.eps_high=0.28"], 0.5, step_items={0: [0, 0], 2: [1, 0]})
    make_run(tmp_path / "b", ["dapo.eps_high=0.5"], 0.5, step_items={0: [0, 0], 2: [1, 1]},
             final=[1, 1])  # a final eval only one side has cannot be paired
    paired = json.loads(compare_with_baseline([str(tmp_path)], str(base), as_json=True))[1]["paired"]
    assert (paired["eval"], paired["difference"]) == ("step 2", 0.5)


@pytest.mark.parametrize(
    ("other_final", "other_uids", "needle"),
    [
        ([1, 0, 1], None, "different items (final: 3 vs 2 items"),  # another subset
        ([1, 0], ["test:0", "test:9"], "different items"),  # the same count, other items
        (None, None, "share no eval with per-item records"),  # an old run without records
    ],
)
def test_unpairable_points_are_refused_in_one_line(tmp_path, other_final, other_uids, needle):
    make_run(tmp_path / "a", ["dapo.eps_high=0.28"], 0.5, final=[1, 0])
    other = make_run(tmp_path / "b", ["dapo.eps_high=0.5"], 0.5, final=other_final)
    if other_uids:
        write_items(other, FINAL, 2, _records(other_final, other_uids))
    with pytest.raises(UserError) as err:
        compare_with_baseline([str(tmp_path)], "eps_high=0.28")
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_baseline_must_name_one_point(tmp_path):
    make_run(tmp_path / "a", ["dapo.eps_high=0.28", "train.learning_rate=0.001"], 0.5, final=[1, 0])
    make_run(tmp_path / "b", ["dapo.eps_high=0.28", "train.learning_rate=0.01"], 0.5, final=[1, 0])
    make_run(tmp_path / "c", ["dapo.eps_high=0.5", "train.learning_rate=0.01"], 0.5, final=[1, 0])
    for name, needle in [
        ("eps_high=0.28", "matches 2 points"),
        ("eps_high=0.3", "names none of the points"),
        ("beta=0", "'beta' is not a setting that differs"),
        ("nonsense", "neither a run or sweep folder nor KEY=VALUE"),
    ]:
        with pytest.raises(UserError, match=needle):
            compare_with_baseline([str(tmp_path)], name)
    rows = json.loads(compare_with_baseline([str(tmp_path)], "eps_high=0.28 learning_rate=0.01", as_json=True))
    assert [row["paired"].get("is_baseline", False) for row in rows] == [False, True, False]
    with pytest.raises(UserError, match="at least two points"):
        compare_with_baseline([str(tmp_path / "a")], str(tmp_path / "a"))
    # Issue 59 item 15: a baseline that names nothing said "needs at least two points" of one run.
    with pytest.raises(UserError, match=r"^--baseline nope: neither a run or sweep folder nor KEY=VALUE settings"):
        compare_with_baseline([str(tmp_path / "a")], "nope")
    with pytest.raises(UserError, match=r"^--baseline runs/a2: no such run or sweep folder"):
        compare_with_baseline([str(tmp_path / "a")], "runs/a2")


def test_compare_a_b_baseline_a_on_the_command_line(tmp_path):
    make_run(tmp_path / "A", ["dapo.eps_high=0.28"], 0.5, final=[1, 0, 0, 0])
    make_run(tmp_path / "B", ["dapo.eps_high=0.5"], 0.5, final=[1, 1, 1, 0])
    result = subprocess.run([sys.executable, "-m", "dapo_train", "compare", "A", "B", "--baseline", "A"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("0.5 ") and "final" in line)
    assert "+0.500" in line and "0/2" in line  # 0.75 - 0.25, two items only B got right
    bad = subprocess.run([sys.executable, "-m", "dapo_train", "compare", "A", "B", "--baseline", "eps_high=9"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "names none" in bad.stderr


def test_compare_pairs_the_answer_accuracy_too(tmp_path):
    """The same strict grades on both points, the other's answers read on 3 more of 4 items (its format): per item
    the answer difference is +1 on 3 items and 0 on 1, so a replicate is k / 4 with k ~ Binomial(4, 3/4).
    P(k = 0) = 0.4% < 2.5% <= P(k <= 1) = 5.1%: the lower end is 1/4; the upper end is 4/4."""
    base = make_run(tmp_path / "a", ["dapo.eps_high=0.28"], 0.5, final=[1, 0, 0, 0])
    other = make_run(tmp_path / "b", ["dapo.eps_high=0.5"], 0.5, final=[1, 0, 0, 0])
    for run, answers in ((base, [1, 0, 0, 0]), (other, [1, 1, 1, 1])):
        write_items(run, FINAL, 2, [{**record, "answer_correct": bool(answer)}
                                    for record, answer in zip(_records([1, 0, 0, 0]), answers)])
    paired = json.loads(compare_with_baseline([str(base), str(other)], str(base), as_json=True))[1]["paired"]
    assert paired["difference"] == 0.0
    answer = paired["answer"]
    assert (answer["baseline_accuracy"], answer["accuracy"], answer["difference"]) == (0.25, 1.0, 0.75)
    assert (answer["low"], answer["high"]) == (0.25, 1.0)
    text = compare_with_baseline([str(base), str(other)], str(base))
    assert "Δ answer" in text and "+0.750  [+0.250, +1.000]" in text
    unpaired = make_run(tmp_path / "c", ["dapo.eps_high=0.6"], 0.5, final=[1, 0, 0, 0])  # records before answer_correct
    assert json.loads(compare_with_baseline([str(base), str(unpaired)], str(base), as_json=True))[1]["paired"][
        "answer"] is None


def test_the_change_from_step_0_pairs_the_items_both_evals_hold():
    """Step 0 on items 0-2; the later eval on items 2, 1, 0 (another order), item 3 (not at step 0) and item 1 with
    another gold (another item under the same uid): three pairs. Strict: 0, 0, 0 -> 1, 0, 0 on items 0-2, the
    exactly known distribution above: +1/3 in [0, 1]. Answer: 1, 1, 1 -> 1, 1, 0: -1/3 in [-1, 0]. The sign test
    reads only the items graded differently: strict 0 lost, 1 gained (p = P(X >= 0) = 1); answer 1 lost, 0 gained
    (p = P(X >= 1), X ~ Bin(1, 1/2) = 1/2)."""
    def record(uid, gold, correct, answer):
        return {"uid": uid, "gold": gold, "correct": correct, "answer_correct": answer}

    start = [record("test:0", "1", False, True), record("test:1", "2", False, True), record("test:2", "3", False, True)]
    later = [record("test:2", "3", False, False), record("test:1", "2", False, True), record("test:0", "1", True, True),
             record("test:3", "4", True, True), record("test:1", "9", True, True)]
    change = change_from_start(start, later)
    assert (change.strict.items, change.strict.difference, change.strict.low, change.strict.high) == \
        (3, pytest.approx(1 / 3), 0.0, 1.0)
    assert (change.answer.difference, change.answer.low, change.answer.high) == (pytest.approx(-1 / 3), -1.0, 0.0)
    assert change_metrics(change) == {
        "change_items": 3, "change": change.strict.difference, "change_low": 0.0, "change_high": 1.0,
        "change_lost": 0, "change_gained": 1, "change_p": 1.0,
        "answer_change": change.answer.difference, "answer_change_low": -1.0, "answer_change_high": 0.0,
        "answer_change_lost": 1, "answer_change_gained": 0, "answer_change_p": 0.5}
    assert change_from_start(start, [record("test:7", "1", True, True)]) is None  # no item in common
    assert change_metrics(None) == {}
    old = [{key: value for key, value in r.items() if key != "answer_correct"} for r in start]  # before answer_correct
    assert change_from_start(old, later).answer is None and "answer_change" not in change_metrics(
        change_from_start(old, later))
