"""Screening (dapo.screen_size, train/collect/screen.py): a screen of k completions per prompt, the prompts it
does not rule out completed to G, exactly as if the G had been drawn at once; ruled-out prompts never
reach the update."""

import pytest
import torch
from accelerate import Accelerator

from dapo_train.config.load import load_config
from dapo_train.config.schema import RewardSpec
from dapo_train.errors import ConfigError
from dapo_train.rewards import build_rewards
from dapo_train.task.prompts import Prompt, PromptSampler
from dapo_train.train.collect.rollout_sample import EVERY_GROUP, RolloutSample
from dapo_train.train.collect.rounds import CollectStats, GroupBuffer, fill_batch, make_group
from dapo_train.train.collect.screen import generate_round, generate_scored, row_seeds, screen_verdict
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.passes import Learner

from conftest import EOS2_ID, EOS_ID, IdTokenizer, make_engine, make_random_model

GROUP, SCREEN = 6, 2


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"train:{i}", question=f"q{i}", gold="7", text=f"p{i}", input_ids=(3 + i, 4 + i % 3, 5))
            for i in range(n)]


def _cfg(*extra):
    return load_config(None, [f"rollout.group_size={GROUP}", "rollout.max_new_tokens=6", "train.prompts_per_step=4",
                              "train.micro_batch_size=8", "dapo.max_gen_rounds=2", f"dapo.screen_size={SCREEN}",
                              "rewards=[{name: overlong, args: {cache_length: 4}}]", *extra])


def _odd_first_token(completion: str, gold: str) -> bool:
    """'Correct' when the first generated id is odd: a random model is right about half the time."""
    return bool(completion) and int(completion.split()[0]) % 2 == 1


def _setup(seed: int = 3):
    model = make_random_model(seed=seed)
    engine = make_engine("loop", model, IdTokenizer(EOS_ID, EOS2_ID))
    rewards = build_rewards([RewardSpec(name="overlong", args={"cache_length": 4})], max_new_tokens=6,
                            is_correct=_odd_first_token)
    return model, engine, rewards


def test_row_seeds_depend_on_the_draw_and_sample_only():
    seeds = row_seeds(0, [5, 9], range(2, 4))
    assert seeds == [row_seeds(0, [5], range(2, 3))[0], row_seeds(0, [5], range(3, 4))[0],
                     *row_seeds(0, [9], range(2, 4))]
    assert len(set(seeds)) == 4 and row_seeds(1, [5], range(2, 3)) != seeds[:1]  # another run seed: other draws


def test_a_screened_group_is_the_group_drawn_at_once():
    """Twelve prompts: the screen of 2 rules some out (all alike) and continues the rest with 4 more. Each
    continued group has the completions, behaviour log-probs, rewards, correct bits, advantages (Eq. 9)
    and old log-probs of the 6 draws made in one call; each ruled-out prompt's first 2 of those 6 are
    all alike. The draws of the two calls come in other batches than the one call's (other prompts, other
    rows), so a shared random stream would have given other tokens."""
    model, engine, rewards = _setup()
    cfg, prompts = _cfg(), _prompts(12)
    draws = list(range(100, 112))
    at_once = generate_scored(engine, rewards, prompts, draws, cfg, CollectStats(), range(GROUP))
    drawn = generate_round(engine, rewards, prompts, draws, cfg, CollectStats())
    complete = [(b, scored) for b, scored in enumerate(drawn) if scored.fate is None]
    ruled_out = [(b, scored, scored.fate) for b, scored in enumerate(drawn) if scored.fate is not None]
    assert complete and ruled_out and len(drawn) == 12  # both kinds happen with this seed
    learner = Learner.build(cfg, model, torch.optim.AdamW(model.parameters()), Accelerator(cpu=True), EOS2_ID)
    for b, scored in complete:
        screened, whole = make_group(prompts[b], scored, cfg, 0), make_group(prompts[b], at_once[b], cfg, 0)
        assert len(screened.completions) == GROUP
        for mine, theirs in zip(screened.completions, whole.completions):
            assert torch.equal(mine.completion_ids, theirs.completion_ids) and mine.truncated == theirs.truncated
            torch.testing.assert_close(mine.behaviour_logprobs, theirs.behaviour_logprobs, atol=1e-5, rtol=0)
        assert torch.equal(screened.rewards, whole.rewards) and torch.equal(screened.correct, whole.correct)
        assert torch.equal(screened.advantages, whole.advantages)
        assert screened.per_reward == whole.per_reward
        record_old_logprobs(model, [screened, whole], learner.batching, learner.scorer)
        for mine, theirs in zip(screened.old_logprobs, whole.old_logprobs):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    for b, screen, fate in ruled_out:
        assert len(screen.completions) == SCREEN
        first = at_once[b].correct[:SCREEN]
        assert screen.correct == first and fate == ("screened_all_right" if all(first) else "screened_all_wrong")
        assert len(set(first)) == 1


def test_without_keyed_draws_the_shared_stream_gives_other_completions():
    """The control: the same two calls drawing from the global stream continue with other tokens than
    one call of 6 would have, so the test above is not exact by accident."""
    _, engine, rewards = _setup()
    cfg, prompts = _cfg(), _prompts(12)
    engine.keyed_draws = False
    torch.manual_seed(0)
    at_once = generate_scored(engine, rewards, prompts, range(12), cfg, CollectStats(), range(GROUP))
    torch.manual_seed(0)
    drawn = generate_round(engine, rewards, prompts, range(12), cfg, CollectStats())
    assert any(not torch.equal(scored.completions[-1].completion_ids, at_once[b].completions[-1].completion_ids)
               for b, scored in enumerate(drawn) if scored.fate is None)


def test_screen_drop_names_the_sides_that_rule_a_prompt_out():
    from dapo_train.train.collect.screen import Scored

    right, wrong, mixed = (Scored([], [0.0] * 2, bits, {}) for bits in ([True, True], [False, False], [True, False]))
    both = ["all_wrong", "all_right"]
    assert [screen_verdict(s, both) for s in (right, wrong, mixed)] == ["screened_all_right", "screened_all_wrong",
                                                                        None]
    assert [screen_verdict(s, ["all_wrong"]) for s in (right, wrong, mixed)] == [None, "screened_all_wrong", None]


def test_ruled_out_prompts_never_reach_the_update_and_are_recorded():
    """A step with screening: every group it trains or carries over has G completions and a prompt no
    screen ruled out; the ruled-out prompts are in the rollout records with their k completions and
    fate, and counted in the metrics with their tokens."""
    _, engine, rewards = _setup()
    cfg, buffer = _cfg(), GroupBuffer()
    sample = RolloutSample(EVERY_GROUP, 0, 1, lambda text: None)
    batch = fill_batch(engine, rewards, PromptSampler(_prompts(40), seed=0), buffer, cfg, 0, sample)
    records = [record for entry in sample.settle(batch.groups) for record in entry.records]
    screened = {r["uid"] for r in records if r["fate"].startswith("screened")}
    assert screened and batch.groups
    for group in batch.groups + buffer.groups:
        assert len(group.completions) == GROUP and group.prompt.uid not in screened
    by_uid = {uid: [r for r in records if r["uid"] == uid] for uid in screened}
    assert all(len(rows) == SCREEN and len({r["correct"] for r in rows}) == 1 for rows in by_uid.values())
    metrics = batch.metrics
    assert metrics["groups_screened_all_right"] + metrics["groups_screened_all_wrong"] == len(screened)
    screened_tokens = sum(r["length"] for r in records if r["fate"].startswith("screened"))
    dropped_tokens = sum(r["length"] for r in records if r["fate"].startswith("dropped"))
    assert metrics["dropped_tokens"] == screened_tokens + dropped_tokens
    assert metrics["generated_tokens"] == sum(r["length"] for r in records)


def test_screen_drop_all_wrong_only_lets_all_right_screens_continue():
    _, engine, rewards = _setup()
    cfg = _cfg("dapo.screen_drop=[all_wrong]")
    drawn = generate_round(engine, rewards, _prompts(12), range(12), cfg, CollectStats())
    assert {scored.fate for scored in drawn} == {None, "screened_all_wrong"}
    assert any(all(scored.correct[:SCREEN]) for scored in drawn if scored.fate is None)  # an all-right screen went on


@pytest.mark.parametrize("overrides, key", [
    (["dapo.screen_size=6"], "dapo.screen_size"),
    (["dapo.screen_size=-1"], "dapo.screen_size"),
    (["dapo.screen_size=1"], "dapo.screen_size"),
    (["dapo.dynamic_sampling=false"], "dapo.screen_size"),
    (["dapo.screen_drop=[]"], "dapo.screen_drop"),
    (["dapo.screen_drop=[all_bad]"], "dapo.screen_drop"),
    (["dapo.max_round_prompts=3"], "dapo.max_round_prompts"),  # below train.prompts_per_step (4)
    (["dapo.skip_floor=0"], "dapo.skip_floor"),
    (["dapo.skip_floor=1.5"], "dapo.skip_floor"),
    (["dapo.screen_size=0", "dapo.dynamic_sampling=false", "dapo.skip_history=true"], "dapo.skip_history"),
])
def test_bad_screen_round_and_history_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(*overrides)


class _CoinEngine:
    """Each completion right with probability `p`, from its own seeded stream: a prompt of pass rate p."""

    def __init__(self, p: float, seed: int = 0) -> None:
        self.p, self.rng = p, torch.Generator().manual_seed(seed)

    def generate(self, prompts, settings, group_size, seeds=None):
        from dapo_train.rollout.completions import Completion

        right = (torch.rand(len(prompts) * group_size, generator=self.rng) < self.p).tolist()
        return [Completion(torch.tensor([3, 4]), torch.tensor([5, EOS_ID]), False, "right" if ok else "wrong")
                for ok in right]


@pytest.mark.parametrize("screen, expected", [
    ([], (0.8 - 8 * 0.1**8) / (1 - 0.9**8 - 0.1**8)),  # E[c | 0 < c < 8], c ~ Bin(8, 0.1): 1.405
    (["dapo.screen_size=2"], 1 + 6 * 0.1),  # a kept screen of 2 holds exactly 1 right; the 6 more, Bin(6, 0.1)
], ids=["no screen", "a screen of 2"])
def test_a_screen_keeps_groups_with_more_right_answers(screen, expected):
    """The bias of issue 47, item 15, through the real round (generate, score, advantages, fates): at a pass
    rate of 0.1, G = 8, a kept group holds 1.40 right answers on average without a screen and 1.60 with a
    screen of 2 ruling out both sides, so each right answer's advantage (Eq. 9, sqrt((G - c)/c)) is smaller."""
    from dapo_train.train.collect.rounds import RoundPrompts, collect_round

    cfg = load_config(None, ["rollout.group_size=8", "train.prompts_per_step=4", "rewards=[{name: accuracy}]",
                             *screen])
    rewards = build_rewards(cfg.rewards, max_new_tokens=4, is_correct=lambda text, gold: text == "right")
    prompts = [Prompt(uid=f"train:{i}", question="q", gold="7", text="p", input_ids=(3, 4)) for i in range(8000)]
    drawn = RoundPrompts(len(prompts), 0, prompts, list(range(8000)), list(range(8000)))
    kept = [one.group for one in collect_round(_CoinEngine(0.1), rewards, drawn, cfg, CollectStats(), 0)
            if one.fate is None]
    right = torch.stack([group.correct.sum() for group in kept]).float()  # (kept,)
    assert float(right.mean()) == pytest.approx(expected, abs=0.06)  # about 3 standard errors either way
