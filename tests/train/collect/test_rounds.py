"""Dynamic sampling (Eq. 11): rounds until the batch is full, carry-over, and a dry spell that
ends the step instead of crashing or looping forever."""


import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.config.schema import RewardSpec
from dapo_train.rewards import build_rewards
from dapo_train.rollout import build_engine
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train.collect.generation_stats import CollectStats
from dapo_train.train.collect.rounds import GroupBuffer, RoundPrompts, collect_round, settle_round

from conftest import EOS2_ID, EOS_ID, IdTokenizer, collect_step, make_random_model


def _prompts(n: int) -> list[Prompt]:
    return [
        Prompt(uid=f"train:{i}", question=f"q{i}", gold="7", text=f"p{i}", input_ids=(3 + i, 4, 5)) for i in range(n)
    ]


def _round(engine, rewards, prompts: list[Prompt], cfg, version: int = 0) -> list:
    """One round's kept groups on `prompts` (stages 2 to 6), as one process generates them."""
    drawn = RoundPrompts(len(prompts), 0, prompts, list(range(len(prompts))), list(range(len(prompts))))
    stats = CollectStats()
    return settle_round(collect_round(engine, rewards, drawn, cfg, stats, version), stats)


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
    stash = _round(engine, rewards, sampler.next_batch(5), cfg)
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
    groups = _round(engine, rewards, prompts, cfg)
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


# --------------------------------------------------------------------------------------------
# What generation costs per trained token (issue 41, point 1), on hand-built groups.


def _group(uid: str, correct: list[int], lengths: list[int]):
    from dapo_train.rollout.completions import Completion
    from dapo_train.train.records import Group

    completions = [Completion(prompt_ids=torch.tensor([3, 4]), completion_ids=torch.full((n,), 9), truncated=False,
                              text="") for n in lengths]
    rewards = torch.tensor(correct, dtype=torch.float32)
    return Group(prompt=_prompts(1)[0], completions=completions, rewards=rewards, correct=rewards.bool(),
                 advantages=torch.zeros(4), version=0)


def test_dropped_and_trained_tokens_are_counted_per_step_and_over_the_run():
    """Four groups of 4: A mixed (3+5+2+4 = 14 tokens), B all wrong (16), C all right (1+2+3+4 = 10),
    D mixed (8); 48 tokens generated in 6 s. One group per step: step 1 trains A, D carries over and
    trains in step 2, which generates nothing."""
    from dapo_train.run.logs import generation_cost
    from dapo_train.train.collect.rounds import Fated, drop_reason, take_batch
    from dapo_train.train.summary import generation_line

    cfg = _cfg("train.prompts_per_step=1")
    groups = [_group("a", [1, 0, 0, 0], [3, 5, 2, 4]), _group("b", [0] * 4, [4] * 4),
              _group("c", [1] * 4, [1, 2, 3, 4]), _group("d", [1, 1, 0, 0], [2] * 4)]
    stats = CollectStats(rounds=1, seconds_generate=6.0, lengths=[c.length for g in groups for c in g.completions])
    buffer = GroupBuffer()
    buffer.add(settle_round([Fated(group, b, drop_reason(group, cfg)) for b, group in enumerate(groups)], stats))
    assert buffer.groups == [groups[0], groups[3]]
    first = take_batch(buffer, stats, wanted=1)
    assert first.groups == [groups[0]]
    m = first.metrics
    assert (m["generated_tokens"], m["dropped_tokens"], m["trained_tokens"]) == (48, 16 + 10, 14)
    assert m["groups_dropped_all_wrong"] == 1 and m["groups_dropped_all_correct"] == 1
    assert m["generated_per_trained_token"] == pytest.approx(48 / 14)
    assert m["seconds_generate_per_group"] == pytest.approx(6.0)  # 6 s for the one group trained
    second = take_batch(buffer, CollectStats(carried_in=1), wanted=1).metrics
    assert (second["generated_tokens"], second["trained_tokens"], second["dropped_tokens"]) == (0, 8, 0)
    assert second["generated_per_trained_token"] == 0.0 and second["seconds_generate_per_group"] == 0.0
    empty = take_batch(GroupBuffer(), CollectStats(rounds=1, seconds_generate=2.0, lengths=[5]), wanted=1).metrics
    assert empty["generated_per_trained_token"] is None and empty["seconds_generate_per_group"] is None
    # Over the run: 48 tokens for 14 + 8 trained, 6 s for two groups; a row before these metrics adds nothing.
    rows = [{"step": 0, "accuracy": 0.5}, {"step": 1, **m}, {"step": 2, **second}]
    cost = generation_cost(rows)
    assert cost["generated_per_trained_token"] == pytest.approx(48 / 22)
    assert cost["seconds_generate_per_group"] == pytest.approx(3.0) and cost["dropped_tokens"] == 26
    assert generation_line(rows) == ("  generation: 48 tokens for 22 trained (2.18 per trained token; 26 on dropped "
                                     "groups), 3.00 s per trained group")
    assert generation_line([{"step": 1, "groups_kept": 3}]) is None  # a run from before the counts


# --------------------------------------------------------------------------------------------
# Round size from the keep rate (dapo.max_round_prompts).


class _HalfKeptEngine:
    """Completions '<first prompt id> <j>': with _odd_mixed, groups of odd-id prompts mix, even ones are all wrong."""

    def generate(self, prompts, settings, group_size):
        from dapo_train.rollout.completions import Completion

        return [Completion(torch.tensor(list(ids)), torch.tensor([5, EOS_ID]), False, f"{ids[0]} {j}")
                for ids in prompts for j in range(group_size)]

    def sync_weights(self):
        pass


def _odd_mixed(text: str, gold: str) -> bool:
    prompt_id, j = (int(part) for part in text.split())
    return prompt_id % 2 == 1 and j % 2 == 0


class _InOrder:
    """The prompts in their order, over and over: the shuffle of PromptSampler left out, so that every two
    consecutive prompts hold one whose group is kept."""

    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts, self.position = prompts, 0

    def next_batch(self, n: int) -> list[Prompt]:
        batch = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(n)]
        self.position += n
        return batch

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": self.position, "num_prompts": len(self.prompts)}


def _half_kept_steps(most: int, steps: int = 3) -> list[tuple[int, int]]:
    """(gen_rounds, prompts drawn) of each step, every other prompt's group kept, four groups a step."""
    from dapo_train.train.collect.rounds import KeepRate, fill_batch

    cfg = _cfg("train.prompts_per_step=4", "dapo.max_gen_rounds=4", f"dapo.max_round_prompts={most}")
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4, is_correct=_odd_mixed)
    sampler, buffer, keep_rate, out = _InOrder(_prompts(100)), GroupBuffer(), KeepRate(), []
    for _ in range(steps):
        before = sampler.position
        batch = fill_batch(_HalfKeptEngine(), rewards, sampler, buffer, cfg, 0, keep_rate=keep_rate)
        assert len(batch.groups) == 4
        out.append((batch.metrics["gen_rounds"], sampler.position - before))
    return out


def test_the_keep_rate_sizes_the_rounds_so_a_step_fills_in_one():
    """Every other prompt keeps its group. Fixed rounds draw 4 prompts and keep 2: two rounds a step.
    Sized by the keep rate, step 1's first round has no rate and draws the 4 missing, its second the 2
    missing / 0.5 = 4; from then on a step draws 4 / 0.5 = 8 prompts in one round. A bound of 5 caps
    each round at 5 prompts: two rounds a step again. Step 2 keeps 3 of 5, then 1 of 2; step 3 keeps 2 of
    5, and the decayed sums (kept 2, 3.8, 6.42, 6.778, 8.10 over drawn 4, 7.6, 11.84, 12.656, 16.39) put
    the rate at 0.494, so the 2 missing draw ceil(2 / 0.494) = 5."""
    assert _half_kept_steps(0) == [(2, 8), (2, 8), (2, 8)]
    assert _half_kept_steps(16) == [(2, 8), (1, 8), (1, 8)]
    assert _half_kept_steps(5) == [(2, 8), (2, 7), (2, 10)]


def test_round_size_by_hand():
    from dapo_train.train.collect.rounds import KeepRate

    rate = KeepRate()
    assert rate.round_size(3, 8, 0) == 8  # off: every round draws prompts_per_step
    assert rate.round_size(3, 8, 32) == 3  # no rate yet: the missing groups
    rate.add(2, 8)  # a quarter kept
    assert rate.round_size(3, 8, 32) == 12 and rate.round_size(3, 8, 10) == 10
    rate.add(0, 8)  # decayed: 0.9 * 2 / (0.9 * 8 + 8) = 1.8 / 15.2 -> ceil(3 / 0.1184) = 26
    assert rate.kept == pytest.approx(1.8) and rate.round_size(3, 8, 32) == 26
    again = KeepRate()
    again.load_state_dict(rate.state_dict())
    assert again == rate
    empty = KeepRate(kept=0.0, drawn=16.0)  # nothing kept so far: draw the most allowed
    assert empty.round_size(3, 8, 20) == 20
    again.load_state_dict(None)  # a checkpoint from before the keep rate
    assert again.rate is None


# --------------------------------------------------------------------------------------------
# Skipping prompts on their history (dapo.skip_history, GRESO).


def test_the_history_halves_an_alike_prompts_chance_down_to_the_floor():
    from dapo_train.train.collect.history import MIXED, RIGHT, WRONG, PromptHistory

    history = PromptHistory()
    history.record([("a", WRONG), ("b", None), ("a", RIGHT), ("c", MIXED)])
    assert [history.keep_probability(uid, 0.1) for uid in "abcd"] == [0.25, 1.0, 0.5, 1.0]
    assert history.side == {"a": RIGHT, "c": MIXED}  # the side of each prompt's last all-alike outcome
    history.record([("a", WRONG)] * 3)  # five alike in a row: 1/32, held at the floor
    assert history.keep_probability("a", 0.1) == 0.1 and history.keep_probability("a", 0.01) == 1 / 32
    history.record([("a", None)])  # an informative group resets it
    assert history.keep_probability("a", 0.1) == 1.0 and "a" not in history.side
    again = PromptHistory()
    again.load_state_dict(history.state_dict())
    assert again.alike == history.alike == {"c": 1} and again.side == {"c": MIXED}
    # The decision is a draw from (seed, draw) alone: the same in any process, another for another draw.
    decisions = [history.generates("c", draw, 0, 0.1) for draw in range(200)]
    assert decisions == [PromptHistory.generates(again, "c", draw, 0, 0.1) for draw in range(200)]
    assert 70 < sum(decisions) < 130  # about half, at probability 0.5


def test_a_history_from_before_the_sides_keeps_its_counts_and_generates_each_prompt_once_to_learn_its_side():
    """A checkpoint written before the sides ({"alike": {...}} alone): its prompts are generated when drawn
    (keep probability 1, so none is skipped on an unknown side), and their counts go on from where they were."""
    from dapo_train.train.collect.history import WRONG, PromptHistory

    history = PromptHistory()
    history.load_state_dict({"alike": {"a": 4}})
    assert history.keep_probability("a", 0.1) == 1.0
    history.record([("a", WRONG)])
    assert history.keep_probability("a", 0.01) == 1 / 32 and history.side == {"a": WRONG}  # 0.5^5: the 5th


class _Recording(_HalfKeptEngine):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def generate(self, prompts, settings, group_size):
        self.seen += [ids[0] for ids in prompts]
        return super().generate(prompts, settings, group_size)


def _history_steps(floor: float, steps: int, state: dict | None = None):
    """`steps` steps of 2 groups over 8 prompts in order (odd first ids mix, even ones are all wrong), with
    the prompt history; state: the collection state to resume from. -> (first ids generated, prompts
    skipped per step, the state after)."""
    from dapo_train.train.collect.history import PromptHistory
    from dapo_train.train.collect.rounds import KeepRate, fill_batch

    cfg = _cfg("train.prompts_per_step=2", "dapo.max_gen_rounds=4", "dapo.skip_history=true",
               f"dapo.skip_floor={floor}")
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=4, is_correct=_odd_mixed)
    prompts = _prompts(8)
    engine, sampler, buffer, keep_rate, history = _Recording(), _InOrder(prompts), GroupBuffer(), KeepRate(), \
        PromptHistory()
    if state is not None:
        sampler.position = state["position"]
        buffer.load_state_dict(state["buffer"], {p.uid: p for p in prompts})
        history.load_state_dict(state["history"])
    metrics = [fill_batch(engine, rewards, sampler, buffer, cfg, 0, keep_rate=keep_rate, history=history).metrics
               for _ in range(steps)]
    # Only even-id prompts are ever alike, and all wrong: every skip is one last seen all wrong.
    assert [m["prompts_skipped_all_wrong"] for m in metrics] == [m["prompts_skipped"] for m in metrics]
    assert [m["prompts_skipped_all_right"] for m in metrics] == [0] * steps
    skipped = [m["prompts_skipped"] for m in metrics]
    state = {"position": sampler.position, "buffer": buffer.state_dict(), "history": history.state_dict()}
    return engine.seen, skipped, state


def test_prompts_whose_groups_were_alike_are_skipped_but_never_for_sure():
    """Even-id prompts are always all wrong: after their first group they are drawn but mostly skipped,
    never below the floor; odd-id prompts always mix and are never skipped. With floor 1 nothing is."""
    seen, skipped, state = _history_steps(0.1, 24)
    drawn = state["position"]
    assert sum(skipped) > 0 and len(seen) + sum(skipped) == drawn  # a skipped prompt is drawn, not generated
    odd, even = [i for i in seen if i % 2], [i for i in seen if i % 2 == 0]
    assert len(odd) == drawn // 2  # every odd draw generated
    assert 4 < len(even) < drawn // 2 - 4 and all(state["history"]["alike"][f"train:{i - 3}"] >= 1 for i in even)
    everything, none, after = _history_steps(1.0, 24)
    assert none == [0] * 24 and len(everything) == after["position"]  # the floor 1: every draw generated


def test_a_resumed_history_skips_what_the_uninterrupted_run_skips():
    whole, skipped, _ = _history_steps(0.1, 12)
    first, skipped_first, state = _history_steps(0.1, 5)
    rest, skipped_rest, _ = _history_steps(0.1, 7, state)
    assert first + rest == whole and skipped_first + skipped_rest == skipped
