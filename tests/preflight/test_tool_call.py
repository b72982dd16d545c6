"""preflight rehearses a tool call at the run's tokenizer and chat template: a calculator call goes through
the rollout's ToolTurns, and the prompt, the turn and the tool turn tokenized alone must be the whole
conversation tokenized at once. Here on builtin:tiny-tools (on Qwen2.5-Instruct's tokenizer and template
rebuilt offline: tests/test_qwen_offline.py, which builds them once); a tool turn one token off is refused."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.preflight import real_run
from dapo_train.task.locations import resolve_model_path
from dapo_train.tools.turns import ToolTurns, TurnAnswer


def test_preflight_rehearses_the_configs_tools_and_refuses_a_tool_turn_that_differs(monkeypatch):
    cfg = load_config(None, ["model.name_or_path=builtin:tiny-tools", "rollout.tools=[calculator]"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-tools"))
    assert "-> '391'" in real_run.rehearse_tool_call(cfg, tokenizer)
    answer = ToolTurns.answer

    def one_token_off(self, turn_ids, calls_made):
        right = answer(self, turn_ids, calls_made)
        return TurnAnswer(right.calls, right.forced_ids[:2] + [right.forced_ids[2] + 1] + right.forced_ids[3:])

    monkeypatch.setattr(ToolTurns, "answer", one_token_off)
    with pytest.raises(ConfigError, match=r"rollout.tools.*tool-call rehearsal: .* differ from the whole "
                                          r"conversation tokenized at once at token \d+"):
        real_run.rehearse_tool_call(cfg, tokenizer)


def test_with_tools_the_rollout_check_keeps_the_decode_loop_the_run_uses():
    """A card's run with tools keeps the decode loop (the static-cache engine cannot run them), so preflight's
    rollout check on a CPU must not stand the static-cache engine in for it."""
    from dapo_train.preflight import rehearsal

    assert rehearsal.static_cache_check(load_config(None, []), cuda=False)
    assert not rehearsal.static_cache_check(load_config(None, ["rollout.tools=[calculator]"]), cuda=False)


def test_the_verdict_names_the_rehearsed_call_and_the_calls_not_written():
    from dapo_train.preflight import coverage

    tools, plain = (load_config(None, extra) for extra in (["rollout.tools=[calculator]"], []))
    assert "a tool call through the rollout's tool turns" in coverage.rehearsed(tools, False, [], False)
    assert "tool calls the model writes" in coverage.not_rehearsed(tools, False, False)
    assert "tool call" not in coverage.rehearsed(plain, False, [], False) + coverage.not_rehearsed(plain, False, False)
