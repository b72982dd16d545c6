"""The tool registry: names and 'pkg.module:function' plugins resolved to Tools with the JSON schema the
chat template shows, every bad entry one ConfigError line; Tool.call answers text whatever the tool does;
and the chat-template check passes the offline Qwen2.5 template (which renders tools as Qwen2.5's does) and
refuses the tiny model's (which ignores them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dapo_train.errors import ConfigError
from dapo_train.tools import TOOLS, register, require_tool_template, resolve_tools, tool_schemas

import qwen_offline

TINY_MODEL = Path(__file__).resolve().parents[2] / "dapo_train" / "assets" / "tiny" / "model"

CALCULATOR_SCHEMA = {  # as transformers' apply_chat_template(tools=...) takes a function (OpenAI's form)
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly, e.g. (12 + 30) * 3 / 4. Numbers may be integers, "
                       "decimals or fractions; operators + - * / // % ** and parentheses; functions sqrt, abs, "
                       "round, floor, ceil, min, max.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {
                "type": "string", "description": "The arithmetic expression to evaluate, such as 48 / 2 + 3 * 1.5"}},
            "required": ["expression"],
        },
    },
}


def config_error(names) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_tools(names)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_calculator_is_registered_with_its_schema():
    (calculator,) = resolve_tools(["calculator"])
    assert tool_schemas([calculator]) == [CALCULATOR_SCHEMA]
    assert calculator.call({"expression": "(12 + 30) * 3 / 4"}) == "31.5"
    assert resolve_tools([]) == []


def test_a_plugin_is_described_by_its_hints_and_docstring():
    (tool,) = resolve_tools(["tool_plugin:word_count"])
    assert tool.name == "word_count"  # the model calls it by its function's name
    assert tool.schema()["function"]["parameters"] == {
        "type": "object",
        "properties": {"text": {"type": "string", "description": "The text whose words to count"},
                       "unique": {"type": "boolean", "description": "Count each distinct word once"}},
        "required": ["text"],
    }
    assert tool.call({"text": "a b a"}) == "3"
    assert tool.call({"text": "a b a", "unique": True}) == "2"


def test_a_registered_function_is_found_by_name(monkeypatch):
    monkeypatch.setitem(TOOLS, "shout", None)  # restored after the test
    register("shout")(shout)
    assert [tool.name for tool in resolve_tools(["calculator", "shout"])] == ["calculator", "shout"]


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text
    """
    return text.upper()


@pytest.mark.parametrize("names, message", [
    (["calculater"], "config key 'rollout.tools.0': unknown tool 'calculater'; did you mean 'calculator'? "
                     "registered: calculator"),
    (["calculator", "abacus"], "config key 'rollout.tools.1': unknown tool 'abacus'; registered: calculator, or "
                               "use 'pkg.module:function'"),
    (["calculator", "calculator"], "config key 'rollout.tools.1': two tools are named 'calculator'"),
    ([""], "config key 'rollout.tools.0': a tool is a name or 'pkg.module:function', not ''"),
    ([7], "not 7"),
    (["no_such_module:f"], "cannot import module 'no_such_module'"),
    (["tool_plugin:missing"], "module 'tool_plugin' has no attribute 'missing'"),
    (["tool_plugin:NOT_A_FUNCTION"], "is not a function"),
    (["tool_plugin:undocumented"], "cannot describe the tool 'undocumented' to the model (Cannot generate JSON "
                                   "schema for undocumented because it has no docstring!)"),
    (["tool_plugin:untyped"], "cannot describe the tool 'untyped' to the model (Argument text is missing a type "
                              "hint in function untyped)"),
])
def test_a_bad_entry_is_one_config_error_line(names, message):
    assert message in config_error(names)


def test_a_tool_call_always_answers_text():
    word_count, broken, numeric = resolve_tools(["tool_plugin:word_count", "tool_plugin:broken",
                                                 "tool_plugin:numeric"])
    assert broken.call({"text": "x"}) == "error: the tool broken failed: RuntimeError: cannot handle 'x'"
    assert numeric.call({"text": "abc"}) == "error: the tool numeric returned int, not text"
    assert word_count.call(["a"]) == "error: the arguments of word_count must be a JSON object, not list"
    assert word_count.call({}) == "error: word_count needs the argument 'text'"
    assert word_count.call({"text": "a", "words": 2}) == \
        "error: word_count has no argument 'words'; its arguments: text, unique"
    assert word_count.call({"text": 5}) == "error: the argument 'text' of word_count must be string, not int"
    assert word_count.call({"text": "a", "unique": 1}) == \
        "error: the argument 'unique' of word_count must be boolean, not int"


# --------------------------------------------------------------------------------------------
# Chat templates.

# A template written here that renders tools the way a tool-calling chat model's does: the tool list in
# the system turn, an assistant's calls as <tool_call> JSON, a tool's reply in a <tool_response> turn.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ message['content'] }}</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- for call in message.get('tool_calls', []) %}<tool_call>{{ call['function'] | tojson }}</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# Lists the tools but drops an assistant's tool calls.
LISTING_ONLY_TEMPLATE = (
    "{%- if tools %}Tools: {{ tools | tojson }}\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def template_error(tokenizer, names=("calculator",)) -> str:
    with pytest.raises(ConfigError) as caught:
        require_tool_template(tokenizer, resolve_tools(list(names)))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("config key 'rollout.tools': ")
    return message


def test_a_template_that_renders_tools_passes(tiny_tokenizer):
    tiny_tokenizer.chat_template = TOOL_TEMPLATE  # the module's tokenizer: the tests below set their own
    require_tool_template(tiny_tokenizer, resolve_tools(["calculator", "tool_plugin:word_count"]))
    require_tool_template(tiny_tokenizer, [])  # no tools: nothing to check


def test_the_tiny_models_template_ignores_tools(tiny_tokenizer):
    tiny_tokenizer.chat_template = (TINY_MODEL / "chat_template.jinja").read_text(encoding="utf-8")
    assert "ignores tools= (the prompt does not list calculator)" in template_error(tiny_tokenizer)


def test_a_template_that_drops_tool_calls_is_refused(tiny_tokenizer):
    tiny_tokenizer.chat_template = LISTING_ONLY_TEMPLATE
    assert "does not render an assistant's tool_calls and the tool's reply" in template_error(tiny_tokenizer)


def test_the_offline_qwen_template_renders_tools(tiny_tokenizer):
    tiny_tokenizer.chat_template = qwen_offline.CHAT_TEMPLATE  # what the check reads of the offline Qwen2.5
    require_tool_template(tiny_tokenizer, resolve_tools(["calculator", "tool_plugin:word_count"]))  # tokenizer
    # (building its 151k-token vocabulary takes 10 s; tests/test_qwen_offline.py renders tool turns with it)
