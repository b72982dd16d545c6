"""Tool turns (tools/turns.py): the calls of an assistant turn parsed and run, every failure an error text
for the model (a tool that raises or answers no text, a call that is not JSON, an unknown tool), the tool
turn rendered by the chat template (tests/fixtures/chatml_tools.jinja: Qwen2.5's format), the limit on
calls; and which engines may run tools (rollout_tools), refused with one line at start."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.rollout.engines import rollout_tools
from dapo_train.tools import calculate, resolve_tools
from dapo_train.tools.turns import ToolTurns, call_bodies, tool_turns

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


def _decoded(arguments):
    """The arguments as the rollout reads them: a JSON string is decoded (None when it is not JSON)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return None


@given(name=_JSON | st.sampled_from(["calculator", "broken", "numeric"]),
       arguments=_JSON | st.fixed_dictionaries({"expression": st.text(max_size=12)}), keys=st.booleans())
@settings(max_examples=200, deadline=None)
def test_any_json_call_is_answered_with_text_and_never_raises(turns, tokenizer, name, arguments, keys):
    """Whatever JSON the policy writes as a call (any name, any arguments, either key missing), the turn is
    answered with one result per call. Only the calculator given exactly a text `expression` can answer (broken
    raises, numeric answers a number): its answer is then the calculator's own, else the result is an error
    text and marked so. Either way the result is what the tool turn tells the model."""
    body = json.dumps({"name": name, "arguments": arguments} if keys else [name, arguments])
    got = answer(turns, tokenizer, f"<tool_call>\n{body}\n</tool_call>")
    (call,) = got.calls
    given_arguments = _decoded(arguments)
    fits = (keys and name == "calculator" and isinstance(given_arguments, dict)
            and list(given_arguments) == ["expression"] and isinstance(given_arguments["expression"], str))
    if fits:
        expected = calculate(given_arguments["expression"])
        assert (call.name, call.result, call.error) == ("calculator", expected, expected.startswith("error: "))
    else:
        assert call.error and call.result.startswith("error: ")
    assert f"<tool_response>\n{call.result}\n</tool_response>" in replies(tokenizer, got)


def test_a_turn_without_a_call_ends_the_completion_and_one_over_the_limit_is_not_run(turns, tokenizer):
    assert answer(turns, tokenizer, "#### 42") is None
    assert answer(turns, tokenizer, "<tool_call>\nunfinished") is None  # no complete call
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    assert answer(turns, tokenizer, call, calls_made=2).calls  # the third of 3
    over = answer(turns, tokenizer, call + "\n" + call, calls_made=2)
    assert over.over_limit and over.calls == [] and over.forced_ids == []


# The rollout's reading of calls before it was linear (issue 47, item 10), kept as the oracle on short texts.
REGEX = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", " ", "\n", "\t", "{}", "a", "<tool", "call>"]),
                max_size=30))
@settings(max_examples=300, deadline=None)
def test_calls_are_read_as_the_regex_read_them(pieces):
    """Each <tool_call> to the next </tool_call>, whitespace stripped; an unclosed one is no call."""
    text = "".join(pieces)
    assert call_bodies(text) == REGEX.findall(text)


@pytest.mark.parametrize("text, bodies", [
    ('<tool_call>\n{"a": 1}\n</tool_call>', ['{"a": 1}']),
    ("<tool_call>a<tool_call>b</tool_call> <tool_call> c </tool_call>", ["a<tool_call>b", "c"]),
    ("<tool_call> \n\t</tool_call></tool_call>", [""]),
    ("</tool_call><tool_call>unclosed", []),
])
def test_calls_by_hand(text, bodies):
    assert call_bodies(text) == bodies


def _best_seconds(work, repeats=5) -> float:
    """The fastest of `repeats` runs: the machine is shared, and the bound is on the work, not the load."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("filler", [" ", "\n", " \n\t"])
def test_an_unclosed_call_before_100k_characters_of_whitespace_is_read_in_linear_time(turns, tokenizer, filler):
    """Issue 47, item 10: the regex took 0.7 s on 1,000 spaces after <tool_call> and 42 s on 4,000 (cubic); a
    Qwen token can be 128 spaces. Reading 100,000 characters takes under 50 ms, and so a whole turn of
    100,000 whitespace tokens ends the completion (no call) within a bound that covers decoding it."""
    text = "<tool_call>" + filler * (100_000 // len(filler))
    assert call_bodies(text) == [] and call_bodies(text + "</tool_call>") == [""]
    assert _best_seconds(lambda: call_bodies(text)) < 0.050
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    assert turns.answer(ids, 0) is None
    assert _best_seconds(lambda: turns.answer(ids, 0), repeats=3) < 0.5


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
