"""Whether a tokenizer's chat template can carry tools: it must list the tools in the prompt when given
`tools=`, and render an assistant's tool call and the tool's reply as turns of the conversation.

A template written without tools either raises on them or renders the prompt as if they were absent
(the model would then never learn that the tools exist); both are refused with one line, naming the key,
before anything heavy loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dapo_train.errors import ConfigError
from dapo_train.tools.registry import Tool, tool_schemas

# A probe conversation whose texts cannot be mistaken for one another in the rendering.
_QUESTION = "Probe question: what is seventeen times twenty-three?"
_ARGUMENT = "17 * 23"
_REPLY = "391"


def require_tool_template(tokenizer: Any, tools: Sequence[Tool], key: str = "rollout.tools") -> None:
    """ConfigError naming `key` unless `tokenizer.apply_chat_template` renders `tools` in the prompt and
    renders a call of the first tool and its reply (the multi-turn transcript a rollout appends)."""
    if not tools:
        return
    schemas = tool_schemas(tools)
    question = [{"role": "user", "content": _QUESTION}]
    first = tools[0]
    argument = next(iter(first.parameters.get("properties", {})), "input")
    call = {"type": "function", "function": {"name": first.name, "arguments": {argument: _ARGUMENT}}}
    transcript = question + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "name": first.name, "content": _REPLY}]
    try:
        plain = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.apply_chat_template(question, tools=schemas, tokenize=False, add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(transcript, tools=schemas, tokenize=False)
    except Exception as err:  # jinja2's TemplateError, a raise_exception in the template, a missing template
        reason = " ".join(str(err).split())
        raise ConfigError(key, f"the tokenizer's chat template cannot render tools ({type(err).__name__}: "
                               f"{reason}); use a model whose chat template takes tools= (Qwen2.5-Instruct's "
                               "does) or name no tools") from None
    missing = [tool.name for tool in tools if tool.name not in prompt]
    if prompt == plain or missing:
        raise ConfigError(key, "the tokenizer's chat template ignores tools= (the prompt does not list "
                               f"{', '.join(missing) or 'them'}), so the model would never see them; use a model "
                               "whose chat template takes tools= (Qwen2.5-Instruct's does) or name no tools")
    if _ARGUMENT not in rendered or _REPLY not in rendered.split(_ARGUMENT, 1)[-1]:
        raise ConfigError(key, "the tokenizer's chat template lists the tools but does not render an assistant's "
                               "tool_calls and the tool's reply; use a model whose chat template renders tool "
                               "turns (Qwen2.5-Instruct's does) or name no tools")
