"""What "correct" means comes from the task (data.correctness): a non-numeric task, graded by a
plugin, is read, rewarded, filtered (Eq. 11) and evaluated with its own check; the numeric
default would drop or zero all of it. Also dapo.filter_metric's three kinds."""

import json

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.config.schema import RewardSpec
from dapo_train.errors import ConfigError, UserError
from dapo_train.evaluation.generate import completion_records
from dapo_train.evaluation.stats import summarize_records
from dapo_train.rewards import build_rewards, rewards_from_config, score
from dapo_train.rollout import Completion, build_engine
from dapo_train.task.answers import ANSWER_CHECKS, answer_check
from dapo_train.task.locations import TINY_MODEL_DIR
from dapo_train.task.prompts import Prompt, PromptSampler, load_prompts
from dapo_train.train.collect.rounds import GroupBuffer

from conftest import EOS2_ID, EOS_ID, IdTokenizer, collect_step, make_random_model

WORDS = "data.correctness=word_task:same_word"


@pytest.fixture
def word_task(tmp_path, monkeypatch):
    """A jsonl task whose gold answers are colour words."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    rows = [
        {"question_zh-cn": f"第{i}个是什么颜色？", "answer_only": colour}
        for i, colour in enumerate(["red", "Blue", "green"])
    ]
    path = tmp_path / "colours" / "test.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path.parent


def test_a_word_task_loads_with_its_check_and_not_with_the_numeric_one(word_task):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    cfg = load_config(None, [f"data.path={word_task}", WORDS])
    prompts, stats = load_prompts(cfg.data, tokenizer, "test")
    assert [p.gold for p in prompts] == ["red", "Blue", "green"] and stats.dropped_unreadable_answer == 0
    numeric = load_config(None, [f"data.path={word_task}"])
    with pytest.raises(UserError, match="3 unreadable answer"):
        load_prompts(numeric.data, tokenizer, "test")


def test_rewards_and_correct_bits_use_the_tasks_check():
    cfg = load_config(None, [WORDS, "rewards=[{name: accuracy}, {name: correctness}]"])
    texts = ["<answer>\nblue\n</answer>", "<answer>\nred\n</answer>", "<answer>\n7\n</answer>"]
    scores = score(rewards_from_config(cfg), texts, ["Blue", "Blue", "Blue"])
    assert scores.correct == [True, False, False]
    assert scores.per_reward == {"accuracy": [1.0, -1.0, -1.0], "correctness": [2.0, 0.0, 0.0]}
    numeric = score(rewards_from_config(load_config(None, ["rewards=[{name: accuracy}]"])), texts, ["Blue"] * 3)
    assert numeric.correct == [False, False, False]  # a number check cannot read "Blue"


def _collect(prompts: list[Prompt], *overrides: str):
    """One step's collection (3 prompts x G=4, at most 2 rounds) by a random model -> (groups, metrics)."""
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6", "train.prompts_per_step=3",
                             "train.micro_batch_size=4", "dapo.max_gen_rounds=2", *overrides])
    model, tokenizer = make_random_model(seed=2), IdTokenizer(EOS_ID, EOS2_ID)
    torch.manual_seed(0)
    engine = build_engine(cfg.rollout, model, tokenizer)
    return collect_step(engine, rewards_from_config(cfg), PromptSampler(prompts, 0), GroupBuffer(), cfg)


def test_dynamic_sampling_filters_on_the_tasks_correct_bits():
    """Gold 'even'/'odd' on the token count: a random model's varied lengths make informative
    groups under the parity check; the numeric check calls every completion wrong and drops all."""
    prompts = [Prompt(f"train:{i}", f"q{i}", ("even", "odd")[i % 2], f"p{i}", (3 + i, 4, 5)) for i in range(12)]
    groups, _ = _collect(prompts, "data.correctness=word_task:parity", "rewards=[{name: accuracy}]")
    assert groups
    for group in groups:
        bits = [("even", "odd")[len(c.text.split()) % 2] == group.prompt.gold for c in group.completions]
        assert group.correct.tolist() == bits and 0 < sum(bits) < 4
    groups, metrics = _collect(prompts, "data.correctness=numeric", "rewards=[{name: accuracy}]")
    assert groups == [] and metrics["groups_dropped_all_wrong"] == 6


def test_eval_records_grade_with_the_tasks_check():
    prompts = [Prompt("test:0", "q", "red", "p", (3,))]
    texts = ["<answer>\nRed\n</answer>", "<answer>\nred\n</answer>", "<answer>\nblue\n</answer>"]
    completions = [Completion(torch.tensor([3]), torch.tensor([4, EOS_ID]), False, t) for t in texts]
    records = completion_records(prompts, completions, 3, answer_check("word_task:same_word"))
    assert [r["extracted"] for r in records] == ["Red", "red", "blue"]
    assert [r["correct"] for r in records] == [True, True, False]
    metrics = summarize_records(records, 3)
    assert metrics["accuracy"] == pytest.approx(2 / 3) and metrics["maj@3"] == 1.0  # votes: Red, red, blue -> Red


def test_an_unknown_or_broken_check_fails_naming_the_key():
    with pytest.raises(ConfigError, match="data.correctness.*unknown check 'numerc'"):
        rewards_from_config(load_config(None, ["data.correctness=numerc"]))
    with pytest.raises(ConfigError, match="data.correctness.*no attribute"):
        rewards_from_config(load_config(None, ["data.correctness=word_task:nope"]))
    assert set(ANSWER_CHECKS) == {"numeric"}


# --------------------------------------------------------------------------------------------
# dapo.filter_metric: correct, total, reward:<name>.


def test_filter_metric_reward_name_picks_one_rewards_values():
    """Only the overlong reward varies with length: filtering on it keeps groups that the accuracy
    reward alone (all -1 for a random model) would drop."""
    prompts = [Prompt(f"train:{i}", f"q{i}", "7", f"p{i}", (3 + i, 4, 5)) for i in range(12)]
    rewards = "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 5}}]"
    kept = {metric: _collect(prompts, rewards, f"dapo.filter_metric={metric}")[0]
            for metric in ("reward:overlong", "reward:accuracy", "correct")}
    assert kept["reward:overlong"] and kept["reward:accuracy"] == [] and kept["correct"] == []
    for group in kept["reward:overlong"]:
        assert len(set(group.per_reward["overlong"])) > 1


def test_filter_metric_is_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="dapo.filter_metric.*no configured reward is called 'digit'"):
        rewards_from_config(load_config(None, ["dapo.filter_metric=reward:digit"]))
    with pytest.raises(ConfigError, match="dapo.filter_metric.*allowed: correct, total, reward:<name"):
        load_config(None, ["dapo.filter_metric=rewards"])


def test_the_old_filter_metric_value_reads_as_total(caplog):
    cfg = load_config(None, ["dapo.filter_metric=reward"])
    assert cfg.dapo.filter_metric == "total"
    assert "dapo.filter_metric=reward is now called dapo.filter_metric=total" in caplog.text


def test_build_rewards_binds_the_check_only_where_a_reward_asks_for_it():
    reward_set = build_rewards(
        [RewardSpec(name="accuracy"), RewardSpec(name="digit")],
        max_new_tokens=8,
        is_correct=lambda text, gold: text == gold,
    )
    scores = score(reward_set, ["<answer>\n5\n</answer>", "x"], ["x", "x"])
    assert scores.per_reward["accuracy"] == [-1.0, 1.0] and scores.correct == [False, True]
    assert scores.per_reward["digit"] == [0.5, 0.0]  # digit has no is_correct: still numeric
