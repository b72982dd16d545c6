"""Which groups a step's rollout records keep: a bounded sample drawn from the groups' places alone (so
a resume and another number of processes draw the same ones), dropped groups included, each kept
group's fate settled by the step's batch, and the records' fields taken from the group."""

import pytest
import torch

from dapo_train.rollout import Completion
from dapo_train.run.rollouts import FATES
from dapo_train.task.answers import answer_check
from dapo_train.task.prompts import Prompt
from dapo_train.train.collect.rollout_sample import EVERY_GROUP, RolloutSample, merge, priority
from dapo_train.train.records import Group, TrainedStats

EXTRACT = answer_check("numeric").extract


def _group(index: int, correct=(True, False)) -> Group:
    """Two completions; the first ends on the gold answer 7, the second on 8."""
    prompt = Prompt(f"train:{index}", f"question {index}", "7", "p", (3, 4))
    texts = ["<answer>\n7\n</answer>", "<answer>\n8\n</answer>"]
    completions = [Completion(torch.tensor([3, 4]), torch.tensor([5, 6, 2]), j == 1, text,
                              torch.tensor([-0.5, -1.0, -1.5]) if j == 0 else None) for j, text in enumerate(texts)]
    return Group(prompt=prompt, completions=completions, rewards=torch.tensor([1.0, -0.25]),
                 correct=torch.tensor(correct), advantages=torch.tensor([1.0, -1.0]),
                 per_reward={"accuracy": [1.0, -1.0], "overlong": [0.0, 0.75]})


def _offered(size: int, positions: list[int], step: int = 3, seed: int = 0) -> RolloutSample:
    """Round 1's groups at `positions`: even positions kept, odd ones dropped (all wrong)."""
    sample = RolloutSample(size, seed, step, EXTRACT)
    for position in positions:
        sample.offer(_group(position), 1, position, None if position % 2 == 0 else "dropped_all_wrong")
    return sample


def _places(records: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["round"], r["group"]) for r in records})


def test_the_sample_keeps_the_groups_of_lowest_priority_over_all_ranks():
    """Eight groups, three kept: the three positions of lowest priority, whichever order they came in,
    and the same when two ranks each offered half of them (batch[rank::2]). The draw is fixed (a resume
    and another version must record the same groups): at seed 0, step 3, round 1 the priorities of
    positions 0-7 are random.Random("rollouts:0:3:1:<position>").random() = 0.876, 0.442, 0.933, 0.678,
    0.163, 0.788, 0.775, 0.180, so positions 4, 7 and 1 (two of them dropped groups) are kept."""
    assert [round(priority(0, 3, 1, position), 3) for position in range(8)] == [
        0.876, 0.442, 0.933, 0.678, 0.163, 0.788, 0.775, 0.180]
    one = merge([_offered(3, list(range(8))).settle([])], 3)
    assert _places(one) == [(1, 1), (1, 4), (1, 7)]
    assert [r["fate"] for r in one] == ["dropped_all_wrong"] * 2 + ["carried"] * 2 + ["dropped_all_wrong"] * 2
    reordered = merge([_offered(3, list(range(8))[::-1]).settle([])], 3)
    two = merge([_offered(3, list(range(8))[rank::2]).settle([]) for rank in range(2)], 3)
    assert reordered == one and two == one
    assert len(one) == 3 * 2  # every completion of each kept group, once


def test_the_draw_follows_the_step_and_the_seed_and_its_size():
    draw = {(step, seed): _places(merge([_offered(2, list(range(8)), step, seed).settle([])], 2))
            for step in (3, 4) for seed in (0, 1)}
    assert len(set(map(tuple, draw.values()))) > 1  # another step or seed draws other groups
    assert _places(merge([_offered(EVERY_GROUP, list(range(8))).settle([])], EVERY_GROUP)) == [(1, p) for p in range(8)]
    empty = _offered(0, list(range(8)))
    assert empty.entries == [] and merge([empty.settle([])], 0) == []


def test_a_kept_group_is_trained_or_carried_and_a_trained_one_has_its_ratios():
    sample = RolloutSample(EVERY_GROUP, 0, 3, EXTRACT)
    trained, carried, dropped = _group(0), _group(1), _group(2, correct=(False, False))
    trained.trained = TrainedStats(ratio_mean=[1.25, None], clip_frac=[0.5, None])
    for position, group in enumerate((trained, carried)):
        sample.offer(group, 1, position, None)
    sample.offer(dropped, 2, 0, "dropped_all_wrong")
    records = merge([sample.settle([trained])], EVERY_GROUP)
    assert [(r["round"], r["group"], r["sample"], r["fate"]) for r in records] == [
        (1, 0, 0, "trained"), (1, 0, 1, "trained"), (1, 1, 0, "carried"), (1, 1, 1, "carried"),
        (2, 0, 0, "dropped_all_wrong"), (2, 0, 1, "dropped_all_wrong")]
    assert [(r["ratio_mean"], r["clip_frac"]) for r in records] == [(1.25, 0.5), (None, None)] + [(None, None)] * 4


def test_a_group_whose_optimizer_steps_were_all_skipped_is_recorded_as_not_trained():
    """The step took both groups, but the update applied no optimizer step to the first (non-finite, or
    fp16's scaler skipped it) and never reached the second (the update ended first): neither trained."""
    sample = RolloutSample(EVERY_GROUP, 0, 3, EXTRACT)
    skipped, unreached, trained = _group(0), _group(1), _group(2)
    skipped.trained = TrainedStats(ratio_mean=[None, None], clip_frac=[None, None], applied=False)
    trained.trained = TrainedStats(ratio_mean=[1.0, 1.0], clip_frac=[0.0, 0.0])
    for position, group in enumerate((skipped, unreached, trained)):
        sample.offer(group, 1, position, None)
    records = merge([sample.settle([skipped, unreached, trained])], EVERY_GROUP)
    assert [r["fate"] for r in records] == ["update_skipped"] * 4 + ["trained"] * 2
    assert FATES["update_skipped"].startswith("not trained: ")


def test_a_record_holds_the_completion_its_answer_and_every_reward():
    sample = RolloutSample(EVERY_GROUP, 0, 5, EXTRACT)
    sample.offer(_group(4), 2, 1, "dropped_no_variance")
    first, second = merge([sample.settle([])], EVERY_GROUP)
    assert first == {
        "step": 5, "round": 2, "group": 1, "sample": 0, "uid": "train:4", "question": "question 4", "gold": "7",
        "completion": "<answer>\n7\n</answer>", "length": 3, "truncated": False, "extracted": "7", "correct": True,
        "rewards": {"accuracy": 1.0, "overlong": 0.0}, "reward": 1.0, "advantage": 1.0,
        "fate": "dropped_no_variance", "behaviour_logprob_mean": pytest.approx(-1.0), "ratio_mean": None,
        "clip_frac": None, "tool_calls": [], "over_calls": False, "tool_turn_spans": [],  # no rollout.tools
    }
    assert (second["extracted"], second["truncated"], second["rewards"], second["reward"]) == (
        "8", True, {"accuracy": -1.0, "overlong": 0.75}, -0.25)
    assert second["behaviour_logprob_mean"] is None  # the engine recorded none
