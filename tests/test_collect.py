"""Dynamic sampling (Eq. 11): rounds until the batch is full, carry-over, and a dry spell that
ends the step instead of crashing or looping forever."""


import torch

from dapo_train.collect import GroupBuffer, collect_groups
from dapo_train.config import RewardSpec, load_config
from dapo_train.data import Prompt, PromptSampler
from dapo_train.rewards import build_rewards

from conftest import IdTokenizer, EOS2_ID, EOS_ID, make_random_model


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"train:{i}", question=f"q{i}", gold="7", text=f"p{i}", input_ids=(3 + i, 4, 5)) for i in range(n)]


def _cfg(*extra):
    return load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=4", "train.prompts_per_step=3",
                              "train.micro_batch_size=4", "dapo.max_gen_rounds=2", "rewards=[{name: accuracy}]", *extra])


def test_rounds_run_out_and_the_step_reports_why():
    """A random model never writes '<answer>7</answer>': every group is all-wrong, so both rounds
    drop everything; collect returns no group and metrics say so (the trainer then skips)."""
    model, tokenizer = make_random_model(), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg()
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    sampler = PromptSampler(_prompts(10), seed=0)
    groups, metrics = collect_groups(model, tokenizer, rewards, sampler, GroupBuffer(), cfg)
    assert groups == []
    assert metrics["gen_rounds"] == 2  # bounded by dapo.max_gen_rounds
    assert metrics["groups_dropped_all_wrong"] == 6  # 2 rounds x 3 prompts
    assert metrics["batch_short"] == 3 and metrics["groups_kept"] == 0
    assert sampler.state_dict()["position"] == 6  # both rounds consumed fresh prompts


def test_reward_filter_keeps_varied_groups_and_carries_surplus_over():
    """filter_metric=reward with the overlong reward: completions of different lengths get
    different penalties, so groups are informative; a pre-filled buffer's surplus carries over."""
    model, tokenizer = make_random_model(seed=2), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.filter_metric=reward", "rollout.max_new_tokens=6")
    rewards = build_rewards([RewardSpec(name="overlong", args={"cache_length": 5})], max_new_tokens=6)
    sampler = PromptSampler(_prompts(30), seed=0)
    buffer = GroupBuffer()
    torch.manual_seed(0)
    groups, metrics = collect_groups(model, tokenizer, rewards, sampler, buffer, cfg)
    kept_total = metrics["groups_kept"] + len(buffer)
    assert len(groups) == metrics["groups_kept"] <= 3
    for group in groups:
        assert len(set(group.rewards.tolist())) > 1  # Eq. 11 on the reward
        assert abs(float(group.advantages.sum())) < 1e-4  # Eq. 9 advantages are centred
    assert kept_total == 3 * metrics["gen_rounds"] - (
        metrics["groups_dropped_all_correct"] + metrics["groups_dropped_all_wrong"] + metrics["groups_dropped_no_variance"]
    )
    if len(buffer):  # the surplus is served first next step, without generating
        surplus = list(buffer.groups)
        again, _ = collect_groups(model, tokenizer, rewards, sampler, buffer, cfg)
        assert again[: len(surplus)] == surplus[:3]


def test_without_dynamic_sampling_every_group_is_kept_in_one_round():
    model, tokenizer = make_random_model(), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.dynamic_sampling=false")
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    groups, metrics = collect_groups(model, tokenizer, rewards, PromptSampler(_prompts(10), 0), GroupBuffer(), cfg)
    assert len(groups) == 3 and metrics["gen_rounds"] == 1
    assert all(float(g.advantages.abs().sum()) == 0.0 for g in groups)  # all wrong: A = 0 exactly
