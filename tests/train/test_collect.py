"""Dynamic sampling (Eq. 11): rounds until the batch is full, carry-over, and a dry spell that
ends the step instead of crashing or looping forever."""


import torch

from dapo_train.config.load import load_config
from dapo_train.config.schema import RewardSpec
from dapo_train.rewards import build_rewards
from dapo_train.rollout import build_engine
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train.collect import CollectStats, GroupBuffer, collect_round

from conftest import EOS2_ID, EOS_ID, IdTokenizer, collect_step, make_random_model


def _prompts(n: int) -> list[Prompt]:
    return [
        Prompt(uid=f"train:{i}", question=f"q{i}", gold="7", text=f"p{i}", input_ids=(3 + i, 4, 5)) for i in range(n)
    ]


def _cfg(*extra):
    return load_config(
        None,
        [
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "train.prompts_per_step=3",
            "train.micro_batch_size=4",
            "dapo.max_gen_rounds=2",
            "rewards=[{name: accuracy}]",
            *extra,
        ],
    )


def test_rounds_run_out_and_the_step_reports_why():
    """A random model never writes '<answer>7</answer>': every group is all-wrong, so both rounds
    drop everything; collect returns no group and metrics say so (the trainer then skips)."""
    model, tokenizer = make_random_model(), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg()
    engine = build_engine(cfg.rollout, model, tokenizer)
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    sampler = PromptSampler(_prompts(10), seed=0)
    groups, metrics = collect_step(engine, rewards, sampler, GroupBuffer(), cfg)
    assert groups == []
    assert metrics["gen_rounds"] == 2  # bounded by dapo.max_gen_rounds
    assert metrics["groups_dropped_all_wrong"] == 6  # 2 rounds x 3 prompts
    assert metrics["completions"] == 24 and metrics["train_accuracy"] == 0.0  # 6 groups x G=4, what health.py counts
    assert metrics["batch_short"] == 3 and metrics["groups_kept"] == 0
    assert sampler.state_dict()["position"] == 6  # both rounds consumed fresh prompts


def test_total_filter_keeps_groups_whose_reward_varies():
    """filter_metric=total with the overlong reward: completions of different lengths get
    different penalties, so groups are informative although no completion is correct."""
    model, tokenizer = make_random_model(seed=2), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.filter_metric=total", "rollout.max_new_tokens=6")
    engine = build_engine(cfg.rollout, model, tokenizer)
    rewards = build_rewards([RewardSpec(name="overlong", args={"cache_length": 5})], max_new_tokens=6)
    buffer = GroupBuffer()
    torch.manual_seed(0)
    groups, metrics = collect_step(engine, rewards, PromptSampler(_prompts(30), seed=0), buffer, cfg)
    assert len(groups) == metrics["groups_kept"] > 0
    for group in groups:
        assert len(set(group.rewards.tolist())) > 1  # Eq. 11 on the total reward
        assert not group.correct.any()  # the correct bits alone would have dropped it
        assert abs(float(group.advantages.sum())) < 1e-4  # Eq. 9 advantages are centred
    assert metrics["groups_kept"] + len(buffer) == 3 * metrics["gen_rounds"] - (
        metrics["groups_dropped_all_correct"]
        + metrics["groups_dropped_all_wrong"]
        + metrics["groups_dropped_no_variance"]
    )


def test_surplus_groups_carry_over_and_are_served_first():
    """Five buffered groups, three per step: the first step trains three without generating, the
    next one starts with the two left over."""
    model, tokenizer = make_random_model(seed=2), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.dynamic_sampling=false")
    engine = build_engine(cfg.rollout, model, tokenizer)
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    sampler = PromptSampler(_prompts(30), seed=0)
    stash = collect_round(engine, rewards, sampler.next_batch(5), cfg, CollectStats(), version=0)
    buffer = GroupBuffer()
    buffer.add(stash)
    first, metrics = collect_step(engine, rewards, sampler, buffer, cfg, version=7)
    assert first == stash[:3] and metrics["gen_rounds"] == 0 and buffer.groups == stash[3:]
    assert (metrics["groups_carried"], metrics["buffer_size"]) == (3, 2)
    second, metrics = collect_step(engine, rewards, sampler, buffer, cfg, version=9)
    assert second[:2] == stash[3:] and len(second) == 3 and metrics["gen_rounds"] == 1 and len(buffer) == 2
    assert (metrics["groups_carried"], metrics["buffer_size"]) == (2, 2)
    assert [g.version for g in second] == [0, 0, 9] and all(g.version == 9 for g in buffer.groups)


def test_a_buffered_group_keeps_its_old_logprobs_and_version_through_a_checkpoint(tmp_path):
    model, tokenizer = make_random_model(seed=2), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.dynamic_sampling=false")
    engine = build_engine(cfg.rollout, model, tokenizer)
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    prompts = _prompts(2)
    groups = collect_round(engine, rewards, prompts, cfg, CollectStats(), version=0)
    groups[0].version, groups[0].old_logprobs = 5, [torch.randn(c.length) for c in groups[0].completions]
    buffer = GroupBuffer()
    buffer.add(groups)
    torch.save(buffer.state_dict(), tmp_path / "state.pt")
    again = GroupBuffer()
    again.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True), {p.uid: p for p in prompts})
    assert again.groups[0].version == 5 and again.groups[1].old_logprobs is None
    assert all(torch.equal(a, b) for a, b in zip(again.groups[0].old_logprobs, groups[0].old_logprobs))


def test_without_dynamic_sampling_every_group_is_kept_in_one_round():
    model, tokenizer = make_random_model(), IdTokenizer(EOS_ID, EOS2_ID)
    cfg = _cfg("dapo.dynamic_sampling=false")
    engine = build_engine(cfg.rollout, model, tokenizer)
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4)
    groups, metrics = collect_step(engine, rewards, PromptSampler(_prompts(10), 0), GroupBuffer(), cfg)
    assert len(groups) == 3 and metrics["gen_rounds"] == 1
    assert all(float(g.advantages.abs().sum()) == 0.0 for g in groups)  # all wrong: A = 0 exactly
