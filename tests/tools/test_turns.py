"""Tool turns (tools/turns.py): the calls of an assistant turn parsed and run, every failure an error text
for the model (a tool that raises or answers no text, a call that is not JSON, an unknown tool), the tool
turn rendered by the chat template (tests/fixtures/chatml_tools.jinja: Qwen2.5's format), the limit on
calls; and which engines may run tools (rollout_tools), refused with one line at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.rollout.engines import rollout_tools
from dapo_train.tools import resolve_tools
from dapo_train.tools.turns import ToolTurns, tool_turns

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "dapo_train" / "assets" / "tiny" / "model"


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    tokenizer.chat_template = (ROOT / "tests" / "fixtures" / "chatml_tools.jinja").read_text(encoding="utf-8")
    return tokenizer


@pytest.fixture(scope="module")
def turns(tokenizer):
    return ToolTurns(tokenizer, resolve_tools(["calculator", "tool_plugin:broken", "tool_plugin:numeric"]), 3)


def answer(turns, tokenizer, text, calls_made=0):
    return turns.answer(tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"], calls_made)


def replies(tokenizer, turn_answer) -> str:
    return tokenizer.decode(turn_answer.forced_ids, skip_special_tokens=False)


def test_each_call_of_a_turn_is_answered_in_one_tool_turn_and_failures_are_error_texts(turns, tokenizer):
    got = answer(turns, tokenizer, 'Two at once.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                                   '"2 ** 10"}}\n</tool_call>\n<tool_call>\n{"name": "broken", "arguments": {"text": '
                                   '"x"}}\n</tool_call>')
    assert [(call.name, call.result, call.error) for call in got.calls] == [
        ("calculator", "1024", False),
        ("broken", "error: the tool broken failed: RuntimeError: cannot handle 'x'", True)]
    assert replies(tokenizer, got) == (
        "\n<|im_start|>user\n<tool_response>\n1024\n</tool_response>\n<tool_response>\nerror: the tool broken failed: "
        "RuntimeError: cannot handle 'x'\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("body, result", [
    ('{"name": "numeric", "arguments": {"text": "abc"}}', "error: the tool numeric returned int, not text"),
    ('{"name": "calculator", "arguments": {"expression": "1 / 0"}}', "error: division by zero"),
    ('{"name": "calculator", "arguments": "{\\"expression\\": \\"6 * 7\\"}"}', "42"),  # arguments as a JSON string
    ('{"name": "calculator", "arguments": "6 *"}', "error: the arguments are not valid JSON (Extra data: line 1 "
                                                   "column 3 (char 2))"),
    ('{"name": "abacus", "arguments": {}}', "error: no tool named 'abacus'; the tools: calculator, broken, numeric"),
    ("calculator(6 * 7)", "error: the tool call is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
    ('["calculator"]', "error: no tool named None; the tools: calculator, broken, numeric"),
    # a name that is no string (the tools study's seed 3 wrote one, and the rollout raised TypeError)
    ('{"name": {"name": "calculator"}, "arguments": {}}', "error: no tool named {'name': 'calculator'}; the tools: "
                                                          "calculator, broken, numeric"),
    ('{"name": ["calculator"]}', "error: no tool named ['calculator']; the tools: calculator, broken, numeric"),
    ("[" * 5000, "error: the tool call is nested too deeply to read"),  # json.loads raised RecursionError
    ("1" * 5000, "error: the tool call is not valid JSON (Exceeds the limit (4300 digits) for integer string "
                 "conversion: value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit)"),
    ('{"name": "calculator", "arguments": "' + "[" * 5000 + '"}', "error: the arguments are nested too deeply to "
                                                                 "read"),
    ('{"name": "calculator", "arguments": [1, 2]}', "error: the arguments of calculator must be a JSON object, not "
                                                    "list"),
])
def test_a_call_that_cannot_run_gets_an_error_text(turns, tokenizer, body, result):
    got = answer(turns, tokenizer, f"<tool_call>\n{body}\n</tool_call>")
    assert [call.result for call in got.calls] == [result]
    assert result in replies(tokenizer, got)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3), max_leaves=8)


@given(name=_JSON | st.sampled_from(["calculator", "broken", "numeric"]), arguments=_JSON, keys=st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_json_call_is_answered_with_text_and_never_raises(turns, tokenizer, name, arguments, keys):
    """Whatever JSON the policy writes as a call (any name, any arguments, either key missing), the turn is
    answered with one result text per call; a call the tools cannot take is an error text."""
    body = json.dumps({"name": name, "arguments": arguments} if keys else [name, arguments])
    got = answer(turns, tokenizer, f"<tool_call>\n{body}\n</tool_call>")
    (call,) = got.calls
    assert isinstance(call.result, str) and call.error == call.result.startswith("error: ")
    assert call.error or (keys and name in ("calculator", "broken", "numeric"))


def test_a_turn_without_a_call_ends_the_completion_and_one_over_the_limit_is_not_run(turns, tokenizer):
    assert answer(turns, tokenizer, "#### 42") is None
    assert answer(turns, tokenizer, "<tool_call>\nunfinished") is None  # no complete call
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    assert answer(turns, tokenizer, call, calls_made=2).calls  # the third of 3
    over = answer(turns, tokenizer, call + "\n" + call, calls_made=2)
    assert over.over_limit and over.calls == [] and over.forced_ids == []


def test_a_turn_ended_by_another_eos_than_the_templates_is_final(turns, tokenizer):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call><|endoftext|>'
    assert turns.answer(tokenizer(call, add_special_tokens=False)["input_ids"], 0) is None


def test_a_template_without_tool_turns_is_refused_at_start():
    plain = AutoTokenizer.from_pretrained(TINY_MODEL)  # its template ignores tools=
    with pytest.raises(ConfigError, match="ignores tools="):
        tool_turns(plain, resolve_tools(["calculator"]), 4)
    assert tool_turns(plain, [], 4) is None


@pytest.mark.parametrize("overrides, key", [
    (["rollout.engine=hf-generate"], "rollout.engine"),
    (["rollout.compile=on"], "rollout.compile"),
    (["rollout.engine=engine_plugin:not_declared"], "rollout.engine"),
])
def test_an_engine_that_cannot_run_tools_is_refused_at_start(overrides, key, monkeypatch):
    import engine_plugin as plugin

    monkeypatch.setattr(plugin, "not_declared", lambda setup: plugin.CountingEngine(setup), raising=False)
    cfg = load_config(None, ["rollout.tools=[calculator]", *overrides])
    with pytest.raises(ConfigError, match=f"config key '{key}'.*tools") as caught:
        rollout_tools(cfg.rollout)
    assert "\n" not in str(caught.value)


def test_engines_that_run_tools_resolve_them():
    for overrides in ([], ["rollout.compile=auto"], ["rollout.engine=engine_plugin:CountingEngine"]):
        cfg = load_config(None, ["rollout.tools=[calculator]", *overrides])
        assert [tool.name for tool in rollout_tools(cfg.rollout)] == ["calculator"]
    assert rollout_tools(load_config(None, ["rollout.engine=hf-generate"]).rollout) == []  # no tools: any engine


# Lists the tools and renders tool turns, but writes a call as [TOOL_CALLS] JSON (Mistral's way).
OTHER_FORMAT = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- for call in message.get('tool_calls', []) %}[TOOL_CALLS]{{ call['function'] | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_writes_calls_in_another_format_is_refused_at_start():
    other = AutoTokenizer.from_pretrained(TINY_MODEL)
    other.chat_template = OTHER_FORMAT
    with pytest.raises(ConfigError, match="another format than <tool_call> JSON") as caught:
        tool_turns(other, resolve_tools(["calculator"]), 4)
    assert "\n" not in str(caught.value)
