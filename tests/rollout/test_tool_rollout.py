"""Multi-turn rollouts with tools, with forced tokens: the policy's draws are scripted (decoding.draw_tokens
patched to return a transcript's tokens), so a completion that calls the calculator twice is known in
advance, token for token, from the chat template (tests/fixtures/chatml_tools.jinja, Qwen2.5's tool format)
on the tiny tokenizer, and a random tiny model supplies the log-probs. Where the script reaches a tool
turn it holds a junk token instead: only the engine's own tool turn can put the right tokens there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dapo_train.algo import policy_loss
from dapo_train.model.layout import collate
from dapo_train.model.scoring import score_tokens
from dapo_train.rollout import EngineSetup, SamplingSettings, decoding
from dapo_train.rollout.hf_engines import DecodeLoopEngine
from dapo_train.tools import resolve_tools, tool_schemas
from dapo_train.tools.turns import ToolTurns
from dapo_train.train.update.batching import TrainSample, collate_micro_batch

from conftest import make_random_model

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "dapo_train" / "assets" / "tiny" / "model"
TEMPLATE = ROOT / "tests" / "fixtures" / "chatml_tools.jinja"
QUESTION = "What is 17 * 23 + 4?"


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


# The conversation the script plays: two calls, each answered by the calculator, then the final answer.
CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [call("17 * 23")]},
    {"role": "tool", "name": "calculator", "content": "391"},
    {"role": "assistant", "content": "", "tool_calls": [call("391 + 4")]},
    {"role": "tool", "name": "calculator", "content": "395"},
    {"role": "assistant", "content": "#### 395"},
]
# The same completion in the pieces the template renders, written out by hand: the policy's turns (each
# ended by its <|im_end|>, which the policy samples) and the tool turns between them (context).
POLICY, TOOL = True, False
PIECES = [
    (POLICY, 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
             "</tool_call><|im_end|>"),
    (TOOL, "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (POLICY, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "391 + 4"}}\n</tool_call><|im_end|>'),
    (TOOL, "\n<|im_start|>user\n<tool_response>\n395\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (POLICY, "#### 395<|im_end|>"),
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.chat_template = TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    model = make_random_model(seed=3, vocab_size=len(tokenizer))
    ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = ends, ends[1]
    return model


@pytest.fixture(scope="module")
def transcript(tokenizer):
    """(prompt ids, completion ids, policy mask) of CONVERSATION, from the template and the hand-written pieces."""
    tools = tool_schemas(resolve_tools(["calculator"]))
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(CONVERSATION, tools=tools, tokenize=False)
    assert whole == prompt + "".join(text for _, text in PIECES) + "\n"  # the pieces are the template's rendering
    prompt_ids, (ids, mask) = tokenizer(prompt, add_special_tokens=False)["input_ids"], tokenized(tokenizer, PIECES)
    # The pieces tokenize as the whole does: each boundary is a special token.
    assert prompt_ids + ids.tolist() == tokenizer(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    return torch.tensor(prompt_ids), ids, mask


def tokenized(tokenizer, pieces) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, policy mask) of a completion written as (policy?, text) pieces."""
    ids, mask = [], []
    for policy, text in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [policy] * len(piece)
    return torch.tensor(ids), torch.tensor(mask)


def script_draws(monkeypatch, script: list[int]) -> None:
    """Every row's draw at the loop's k-th step is script[k] (its last token beyond it)."""
    steps = iter(range(10**6))

    def draw(distribution, top_k=0, generators=None):
        return torch.full((distribution.shape[0],), script[min(next(steps), len(script) - 1)], dtype=torch.long)

    monkeypatch.setattr(decoding, "draw_tokens", draw)


def scripted_rollout(monkeypatch, tokenizer, model, transcript, *, max_calls=4, budget=None, group_size=2):
    """The engine's completions when each row's draws follow the transcript, with a junk token (an ordinary
    one, "x") wherever the transcript has a tool turn's token."""
    prompt_ids, ids, mask = transcript
    script_draws(monkeypatch, torch.where(mask, ids, torch.tensor(tokenizer.convert_tokens_to_ids("x"))).tolist())
    turns = ToolTurns(tokenizer, resolve_tools(["calculator"]), max_calls)
    engine = DecodeLoopEngine(EngineSetup(model, tokenizer, 16, dtype="float32", compile="off", tools=turns))
    settings = SamplingSettings(max_new_tokens=budget or len(ids) + 8)
    return engine.generate([prompt_ids.tolist()], settings, group_size)


@pytest.fixture(scope="module")
def rollout(tokenizer, model, transcript):
    """The scripted rollout's two completions (group_size 2, the default limits), made once."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return scripted_rollout(monkeypatch, tokenizer, model, transcript)


def test_two_calculator_calls_yield_the_templates_transcript_with_the_tool_turns_masked(rollout, transcript):
    _, ids, mask = transcript
    for completion in rollout:
        assert completion.completion_ids.tolist() == ids.tolist()
        assert completion.policy_mask.tolist() == mask.tolist()
        assert not completion.truncated
        assert [(c.name, c.result, c.error) for c in completion.tool_calls] == [
            ("calculator", "391", False), ("calculator", "395", False)]
        assert completion.text.endswith("#### 395")
        assert bool((completion.behaviour_logprobs[~mask] == 0).all())  # a tool turn's tokens have none


def loss_and_gradient(model, batch, mask, old_logprobs=None):
    """Eq. 10 / 12's loss (advantage 1.5) of a collated batch over `mask`, and its gradient."""
    model.zero_grad()
    logprobs, _ = score_tokens(model, batch, temperature=1.0, chunk_mib=1.0)
    old = logprobs.detach() - 0.1 if old_logprobs is None else old_logprobs  # ratio e^0.1: the clip acts
    advantages = torch.full((logprobs.shape[0],), 1.5)
    loss, _ = policy_loss(logprobs, old, advantages, mask, 0.2, 0.28)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("share_prefix", [False, True])
def test_the_loss_and_gradient_are_a_hand_built_transcripts_with_the_tool_turns_masked(
        rollout, tokenizer, model, transcript, share_prefix):
    prompt_ids, ids, mask = transcript
    completions = rollout
    samples = [TrainSample(c.prompt_ids, c.completion_ids, 1.5, True, policy_mask=c.policy_mask) for c in completions]
    micro = collate_micro_batch(samples, tokenizer.pad_token_id, share_prefix)
    assert micro.batch.shared_prefix == share_prefix
    assert micro.batch.completion_mask.sum() == 2 * mask.sum()  # Eq. 12 counts the policy's tokens only
    got = loss_and_gradient(model.train(), micro.batch, micro.batch.completion_mask)

    by_hand = collate([prompt_ids] * 2, [ids] * 2, tokenizer.pad_token_id)  # no masks given: every token valid
    hand_mask = by_hand.completion_mask * mask  # the tool turns' positions masked by hand
    with torch.no_grad():
        old, _ = score_tokens(model, by_hand, temperature=1.0, chunk_mib=1.0)
    expected = loss_and_gradient(model, by_hand, hand_mask, old - 0.1)
    assert torch.allclose(got[0], expected[0], atol=1e-6)
    assert torch.allclose(got[1], expected[1], atol=1e-6)
    unmasked = loss_and_gradient(model, by_hand, by_hand.completion_mask, old - 0.1)
    assert not torch.allclose(unmasked[1], expected[1], atol=1e-4)  # the mask moves the gradient
    model.eval()


def test_behaviour_logprobs_after_a_tool_turn_are_the_training_forwards(monkeypatch, tokenizer, model, transcript):
    _, _, mask = transcript
    completion = scripted_rollout(monkeypatch, tokenizer, model, transcript, group_size=1)[0]
    batch = collate([completion.prompt_ids], [completion.completion_ids], tokenizer.pad_token_id, False,
                    policy_masks=[completion.policy_mask])
    with torch.no_grad():
        training, _ = score_tokens(model, batch, temperature=1.0, chunk_mib=1.0)
    after_first_tool_turn = torch.zeros_like(mask)
    after_first_tool_turn[int((~mask).nonzero()[0]) :] = True
    checked = mask & after_first_tool_turn
    assert int(checked.sum()) > 20
    assert torch.allclose(completion.behaviour_logprobs[checked], training[0][checked], atol=1e-5)
    assert bool((training[0][~mask] == 0).all())  # the head does not score the tool turns


def test_a_turn_beyond_max_tool_calls_ends_the_completion_over_calls_not_truncated(
        monkeypatch, tokenizer, model, transcript):
    """Issue 47, item 14: such a completion was marked truncated, so overlong filtering took it out of the loss
    and over-calling was never pushed down. It ends at the EOS the policy sampled, with its own end, and
    overlong filtering leaves it in the loss (its reward, for a final answer it never wrote, does the rest)."""
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.records import Group
    from dapo_train.train.update.batching import flatten_groups

    _, ids, mask = transcript
    second_call_end = [i for i, token in enumerate(ids.tolist()) if token == tokenizer.eos_token_id][2]
    completions = scripted_rollout(monkeypatch, tokenizer, model, transcript, max_calls=1)
    for completion in completions:
        assert completion.over_calls and not completion.truncated and len(completion.tool_calls) == 1
        assert completion.completion_ids.tolist() == ids[: second_call_end + 1].tolist()  # the second call, unrun
        assert completion.policy_mask.tolist() == mask[: second_call_end + 1].tolist()
    prompt = Prompt("train:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    group = Group(prompt, completions, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.tensor([-1.0, 1.0]))
    assert [sample.in_loss for sample in flatten_groups([group], overlong_filtering=True)] == [True, True]
    assert not any(c.over_calls for c in scripted_rollout(monkeypatch, tokenizer, model, transcript, max_calls=2))


def test_the_budget_counts_the_tool_turns_tokens(monkeypatch, tokenizer, model, transcript):
    _, ids, mask = transcript
    inside_tool_turn = int((~mask).nonzero()[3])
    (completion,) = scripted_rollout(monkeypatch, tokenizer, model, transcript, budget=inside_tool_turn + 1,
                                     group_size=1)
    assert completion.truncated and not completion.over_calls
    assert completion.completion_ids.tolist() == ids[: inside_tool_turn + 1].tolist()
    assert completion.policy_mask.tolist() == mask[: inside_tool_turn + 1].tolist()


# An answer block opened before a call and closed after the tool turn: only the tool's reply holds the gold 391.
AROUND_A_CALL = [
    (POLICY, '<answer>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
             "</tool_call><|im_end|>"),
    (TOOL, "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (POLICY, "\n</answer><|im_end|>"),
]


def test_the_rewards_and_the_eval_grade_the_policys_own_text(monkeypatch, tokenizer, model, transcript):
    """Issue 47, item 13: the block was graded on the transcript, so on 391, the number in the tool's reply,
    which the policy never wrote. Graded on the policy's own text (the transcript less its tool turns), the
    block's last number is the 23 of the call's expression: wrong, in training and in evaluation."""
    from dapo_train.config.load import load_config
    from dapo_train.config.schema import RewardSpec
    from dapo_train.evaluation.generate import eval_records
    from dapo_train.rewards import build_rewards
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.collect.rounds import CollectStats, RoundPrompts, collect_round, settle_round

    prompt_ids, (ids, mask) = transcript[0], tokenized(tokenizer, AROUND_A_CALL)
    completions = scripted_rollout(monkeypatch, tokenizer, model, (prompt_ids, ids, mask))
    expression = '{"name": "calculator", "arguments": {"expression": "17 * 23"}}'
    for completion in completions:
        assert completion.text == (f"<answer>\n<tool_call>\n{expression}\n</tool_call>\nuser\n<tool_response>\n391\n"
                                   "</tool_response>\nassistant\n\n</answer>")
        assert completion.policy_text == f"<answer>\n<tool_call>\n{expression}\n</tool_call>\n</answer>"

    prompt = Prompt("train:0", QUESTION, "391", "", tuple(prompt_ids.tolist()))
    cfg = load_config(None, ["rollout.group_size=2", f"rollout.max_new_tokens={len(ids) + 8}",
                             "rewards=[{name: accuracy}]", "rollout.tools=[calculator]"])
    turns = ToolTurns(tokenizer, resolve_tools(["calculator"]), 4)
    engine = DecodeLoopEngine(EngineSetup(model, tokenizer, 16, dtype="float32", compile="off", tools=turns))
    stats = CollectStats()
    script_draws(monkeypatch, ids.tolist())  # the tool turn's own tokens where it is: forced anyway
    drawn = RoundPrompts(drawn=1, skipped=0, prompts=[prompt], positions=[0], draws=[0])
    rewards = build_rewards([RewardSpec(name="accuracy")], max_new_tokens=64)
    settle_round(collect_round(engine, rewards, drawn, cfg, stats, 0), stats)
    assert stats.correct == [False, False] and stats.dropped_all_wrong == 1

    script_draws(monkeypatch, ids.tolist())
    records = eval_records(model, tokenizer, [prompt], max_new_tokens=len(ids) + 8, batch_size=4, samples=2,
                           tools=turns)
    assert [(record["extracted"], record["correct"]) for record in records] == [("23", False)] * 2


def test_a_buffered_group_keeps_its_tool_turns_through_a_checkpoint(rollout, transcript, tmp_path):
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.records import Group

    completions = rollout
    prompt = Prompt("train:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    group = Group(prompt, completions, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2))
    torch.save(group.to_state(), tmp_path / "group.pt")
    loaded = Group.from_state(torch.load(tmp_path / "group.pt", weights_only=True), {prompt.uid: prompt})
    for before, after in zip(completions, loaded.completions):
        assert torch.equal(after.policy_mask, before.policy_mask) and after.tool_calls == before.tool_calls


def test_a_buffered_group_keeps_its_over_calls_end_through_a_checkpoint(monkeypatch, tokenizer, model, transcript,
                                                                        tmp_path):
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.records import Group

    completions = scripted_rollout(monkeypatch, tokenizer, model, transcript, max_calls=1)
    prompt = Prompt("train:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    group = Group(prompt, completions, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2))
    torch.save(group.to_state(), tmp_path / "group.pt")
    loaded = Group.from_state(torch.load(tmp_path / "group.pt", weights_only=True), {prompt.uid: prompt})
    assert [(c.over_calls, c.truncated) for c in loaded.completions] == [(True, False)] * 2


def test_the_steps_metrics_and_rollout_records_count_the_calls(monkeypatch, tokenizer, model, transcript, rollout):
    from types import SimpleNamespace

    from dapo_train.run.rollouts import brief
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.collect.rollout_sample import group_records
    from dapo_train.train.collect.rounds import CollectStats
    from dapo_train.train.records import Group

    _, ids, mask = transcript
    with_calls = rollout
    without = scripted_rollout(monkeypatch, tokenizer, model, transcript, max_calls=1, group_size=1)  # its 1 call
    failing = without[0].tool_calls[0]
    without[0].tool_calls = [type(failing)(failing.name, failing.text, "error: made up", True)]
    stats = CollectStats()
    completions = with_calls + without
    stats.add_generated(completions, SimpleNamespace(total=[0.0] * 3, correct=[False] * 3, per_reward={}))
    metrics = stats.metrics(wanted=1, got=1, trained_tokens=1)
    assert (metrics["tool_calls"], metrics["tool_errors"], metrics["tool_use_ratio"]) == (5, 1, 1.0)
    first_tool_turn = int((~mask[: without[0].length]).sum())
    assert metrics["tool_tokens"] == 2 * int((~mask).sum()) + first_tool_turn
    assert metrics["generated_tokens"] == 2 * len(ids) + without[0].length  # the budget's count: every token

    prompt = Prompt("train:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    group = Group(prompt, with_calls, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2))
    record = group_records(group, 1, 1, 0, None, lambda text: None)[0]
    assert [(call["name"], call["result"], call["error"]) for call in record["tool_calls"]] == [
        ("calculator", "391", False), ("calculator", "395", False)]
    lines = brief(record)
    assert lines[2:] == [
        "  call calculator: '{\"name\": \"calculator\", \"arguments\": {\"expression\": \"17 * 23\"}}' -> '391'",
        "  call calculator: '{\"name\": \"calculator\", \"arguments\": {\"expression\": \"391 + 4\"}}' -> '395'"]
    policy = with_calls[0].behaviour_logprobs[mask]
    assert record["behaviour_logprob_mean"] == pytest.approx(float(policy.mean()))  # the tool turns' 0s left out


def test_the_in_training_eval_runs_the_runs_tools(monkeypatch, tokenizer, model, transcript):
    from dapo_train.evaluation.generate import eval_records
    from dapo_train.task.prompts import Prompt

    _, ids, _ = transcript
    turns = ToolTurns(tokenizer, resolve_tools(["calculator"]), 4)
    prompt = Prompt("test:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    script_draws(monkeypatch, ids.tolist())  # the tool turns' own tokens: only a tool turn keeps an EOS from ending
    records = eval_records(model, tokenizer, [prompt], max_new_tokens=len(ids) + 8, batch_size=4, samples=2,
                           tools=turns)
    assert [record["completion"].endswith("#### 395") for record in records] == [True, True]
    assert [record["length"] for record in records] == [len(ids)] * 2  # the tool turns ran: no EOS ended it


def test_a_steps_trained_tokens_are_the_policys(rollout, transcript):
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.collect.rounds import CollectStats, GroupBuffer, take_batch
    from dapo_train.train.records import Group

    _, ids, mask = transcript
    completions = rollout
    prompt = Prompt("train:0", QUESTION, "395", "", tuple(transcript[0].tolist()))
    buffer = GroupBuffer()
    buffer.add([Group(prompt, completions, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2))])
    stats = CollectStats()
    stats.lengths = [c.length for c in completions]
    metrics = take_batch(buffer, stats, 1).metrics
    assert metrics["trained_tokens"] == 2 * int(mask.sum()) < metrics["generated_tokens"] == 2 * len(ids)
