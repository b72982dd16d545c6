"""The sampled eval's scores, metrics and change from step 0 (evaluation/sampled.py) on hand-made completions,
every expected number worked out here from the records."""

import pytest

from dapo_train.evaluation.sampled import item_scores, sampled_change, sampled_metrics, sampled_text


def item(uid, gold, answers, answer_right=()):
    """K records of one item: `answers` the extracted answers (None: none), correct where equal to gold;
    answer_correct also at the sample indices `answer_right` (the gold number read outside the answer block)."""
    return [{"uid": uid, "gold": gold, "extracted": a, "correct": a == gold,
             "answer_correct": a == gold or k in answer_right, "sample": k, "length": 10 + k, "truncated": a is None}
            for k, a in enumerate(answers)]


# Step 0, K = 4. Item 0: 2 of 4 right, the majority "1" (2 votes) right -> pass@1 .5, maj 1, pass@k 1.
# Item 1: 1 of 4 right, the majority "4" wrong -> .25, 0, 1. Item 2: none right; "6" and "8" tie at one vote,
# the first seen ("6") wins and is wrong -> 0, 0, 0.
START = [*item("test:0", "1", ["1", "2", "1", "3"]), *item("test:1", "5", ["4", "4", "5", None]),
         *item("test:2", "7", ["6", "8", None, None])]
# Later, items in another order. Item 2: none right (answer accuracy: sample 0 has the gold number outside the
# block) -> 0, 0, 0 (answer .25). Item 0: all right -> 1, 1, 1. Item 1: 2 right, "5" and "4" tie at 2 votes, the
# first seen ("5") right -> .5, 1, 1.
LATER = [*item("test:2", "7", ["6", "8", None, None], answer_right=(0,)),
         *item("test:0", "1", ["1", "1", "1", "1"]), *item("test:1", "5", ["5", "4", "5", "4"])]


def test_each_item_is_scored_from_its_k_samples():
    assert item_scores(START, 4) == {
        ("test:0", "1"): {"pass_at_1": 0.5, "answer_pass_at_1": 0.5, "maj_at_k": 1.0, "pass_at_k": 1.0},
        ("test:1", "5"): {"pass_at_1": 0.25, "answer_pass_at_1": 0.25, "maj_at_k": 0.0, "pass_at_k": 1.0},
        ("test:2", "7"): {"pass_at_1": 0.0, "answer_pass_at_1": 0.0, "maj_at_k": 0.0, "pass_at_k": 0.0},
    }
    with pytest.raises(ValueError, match="N x 4 records"):
        item_scores(START[:-1], 4)


def test_the_metrics_of_step_0_are_the_means_over_items():
    metrics = sampled_metrics(START, 4)
    # pass@1 (.5 + .25 + 0) / 3; maj@k 1/3; pass@k 2/3; lengths 10-13 on each item: mean 11.5; 3 of 12 have no
    # answer (truncated in these records).
    assert metrics == {"pass_at_1": pytest.approx(0.25), "answer_pass_at_1": pytest.approx(0.25),
                       "maj_at_k": pytest.approx(1 / 3), "pass_at_k": pytest.approx(2 / 3), "samples": 4,
                       "num_items": 3, "completion_length_mean": 11.5, "truncated_rate": 0.25}
    assert sampled_text({f"eval/sampled/{k}": v for k, v in metrics.items()}, "eval/sampled/") == \
        "sampled x4: pass@1 0.250, maj@4 0.333, pass@4 0.667"


def test_a_later_eval_is_paired_with_step_0_item_by_item():
    """Per-item changes, paired by uid whatever the order: pass@1 (+.5, +.25, 0): mean +.25; maj (0, +1, 0):
    +1/3; pass@k (0, 0, 0): 0; answer pass@1 (+.5, +.25, +.25): +1/3. On 3 items a bootstrap replicate is the
    mean of 3 draws; each extreme (all three draws the same item) has probability 1/27 = 3.7% > 2.5%, so the
    95% interval runs from the smallest item change to the largest: pass@1 [0, .5], maj [0, 1], pass@k [0, 0],
    answer [.25, .5]."""
    metrics = sampled_metrics(LATER, 4, START)
    assert (metrics["pass_at_1"], metrics["maj_at_k"], metrics["pass_at_k"]) == (0.5, pytest.approx(2 / 3),
                                                                         pytest.approx(2 / 3))
    expected = {"pass_at_1": (0.25, 0.0, 0.5), "maj_at_k": (1 / 3, 0.0, 1.0), "pass_at_k": (0.0, 0.0, 0.0),
                "answer_pass_at_1": (1 / 3, 0.25, 0.5)}
    for name, (change, low, high) in expected.items():
        assert metrics[f"{name}_change"] == pytest.approx(change), name
        assert (metrics[f"{name}_change_low"], metrics[f"{name}_change_high"]) == (pytest.approx(low),
                                                                                     pytest.approx(high)), name
    assert metrics["change_items"] == 3
    text = sampled_text({f"eval/sampled/{k}": v for k, v in metrics.items()}, "eval/sampled/")
    assert text == ("sampled x4: pass@1 0.500 +0.250 [+0.000, +0.500], maj@4 0.667 +0.333 [+0.000, +1.000], "
                    "pass@4 0.667 +0.000 [+0.000, +0.000] over step 0")


def test_only_the_items_both_hold_are_paired_and_another_k_is_not():
    # Item 3 is new; item 1 comes with another gold (another item under the same uid): only item 0 pairs.
    other = [*item("test:3", "2", ["2", "2", "2", "2"]), *item("test:1", "9", ["9", "9", "9", "9"]),
             *item("test:0", "1", ["1", "1", "1", "1"])]
    change = sampled_change(START, other, 4)
    assert change["pass_at_1"].items == 1 and change["pass_at_1"].difference == 0.5  # 1 - .5 on item 0 alone
    assert sampled_change(START, item("test:9", "1", ["1"] * 4), 4) == {}  # no item in common
    two = [r for r in LATER if r["sample"] < 2]  # K = 2 against step 0's K = 4 (a resume changed eval.samples)
    two.sort(key=lambda r: r["uid"])
    assert sampled_change(START, two, 2) == {}
    assert "pass@1_change" not in sampled_metrics(two, 2, START)
    assert sampled_text({}, "eval/sampled/") == ""  # no sampled eval
