"""Tool turns in a rollout: the calls in an assistant turn the policy ended, the tools run, and the tokens of
the tool turn that answers them, as the chat template renders that conversation.

The call format is the one Qwen2.5-Instruct's template renders and its model writes (also Qwen3's and
other Hermes-style templates): a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`, any number per turn. The tool turn is not written here: the chat template renders a probe
conversation (a user question, an assistant turn with these calls, a tool message per result, then the
next assistant header), and the text after the assistant turn's end-of-turn token is what the model
must see next; its tokens are forced into the row (rollout/tool_rows.py). So the transcript is the
template's, for any template that renders tool messages, and a template whose tool turn cannot be
found so is refused at start (ToolTurns raises ConfigError).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dapo_train.errors import ConfigError
from dapo_train.tools.registry import Tool, tool_schemas
from dapo_train.tools.template import require_tool_template

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_PROBE_QUESTION = [{"role": "user", "content": "Probe question"}]
_PROBE_RESULT = "Probe result 7151"


@dataclass(frozen=True)
class ToolCall:
    """One call the policy made and what it got back. error: the result is an error text (a call that is not
    valid JSON, an unknown tool, arguments that do not fit, a tool that failed)."""

    name: str
    text: str  # the call's JSON as the model wrote it, between <tool_call> and </tool_call>
    result: str
    error: bool

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "text": self.text, "result": self.result, "error": self.error}


@dataclass(frozen=True)
class TurnAnswer:
    """What follows an assistant turn with calls: the calls run and the tool turn's tokens to force, or
    over_limit (the calls would exceed rollout.max_tool_calls: none is run and the completion ends there, with
    the end of its own, Completion.over_calls, that is not truncation)."""

    calls: list[ToolCall]
    forced_ids: list[int]
    over_limit: bool = False


def call_bodies(text: str) -> list[str]:
    """The calls in `text`: each <tool_call> to the next </tool_call>, whitespace stripped (an unclosed one is
    no call), found in one pass with str.find. Model output is hostile input: the regex this replaces,
    `<tool_call>\\s*(.*?)\\s*</tool_call>`, took cubic time on whitespace after an unclosed tag (42 s for 4,000
    spaces) inside the decode loop; this reads 100,000 characters in about a millisecond."""
    bodies, start = [], text.find(CALL_OPEN)
    while start >= 0:
        end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
        if end < 0:
            break
        bodies.append(text[start + len(CALL_OPEN) : end].strip())
        start = text.find(CALL_OPEN, end + len(CALL_CLOSE))
    return bodies


def read_json(text: str) -> tuple[Any, str | None]:
    """(json.loads(text), None), or (None, why not): not valid JSON, or nested past the parser's recursion
    limit (a policy can write thousands of "[" within its budget; json.loads then raises RecursionError)."""
    try:
        return json.loads(text), None
    except ValueError as err:  # JSONDecodeError, or an integer past Python's 4,300-digit conversion limit
        return None, f"not valid JSON ({err})"
    except RecursionError:
        return None, "nested too deeply to read"


def tool_turns(tokenizer: Any, tools: Sequence[Tool], max_calls: int) -> ToolTurns | None:
    """rollout.tools for a run's tokenizer, checked once it loads (before the model): the chat template must
    list the tools and render tool turns (require_tool_template), and their text must be found (ToolTurns).
    None when no tools are named."""
    if not tools:
        return None
    require_tool_template(tokenizer, tools)
    return ToolTurns(tokenizer, tools, max_calls)


class ToolTurns:
    """The tools of a run, the tokenizer whose chat template renders their turns, and the calls allowed per
    completion. Built once at start; ConfigError when the template's tool turn cannot be found."""

    def __init__(self, tokenizer: Any, tools: Sequence[Tool], max_calls: int, key: str = "rollout.tools") -> None:
        self.tokenizer, self.tools, self.max_calls = tokenizer, {tool.name: tool for tool in tools}, max_calls
        self.schemas = tool_schemas(tools)
        eos = tokenizer.eos_token
        probe_call = ToolCall(tools[0].name, "{}", _PROBE_RESULT, False)
        if not call_bodies(self.tokenizer.apply_chat_template(self._assistant([probe_call]), tools=self.schemas,
                                                              tokenize=False)):
            raise ConfigError(key, "the chat template writes tool calls in another format than <tool_call> JSON "
                                   "</tool_call>, the one the rollout reads (Qwen2.5-Instruct's); use a model whose "
                                   "template writes that format or name no tools")
        probe = self.tool_turn_text([probe_call], eos) if eos else None
        if probe is None or _PROBE_RESULT not in probe:
            raise ConfigError(key, "the chat template's tool turn could not be found: rendering a tool call and its "
                                   f"reply did not continue the assistant turn after its end token {eos!r} with the "
                                   "reply; use a ChatML-style template that renders tool messages (Qwen2.5-Instruct's)")

    def answer(self, turn_ids: Sequence[int], calls_made: int) -> TurnAnswer | None:
        """The answer to an assistant turn (its tokens, the stop token last) that makes calls, or None when it
        makes none (the completion ends there) or its stop token does not end a turn in the template."""
        text = self.tokenizer.decode(list(turn_ids), skip_special_tokens=False)
        bodies = call_bodies(text)
        if not bodies:
            return None
        if calls_made + len(bodies) > self.max_calls:
            return TurnAnswer([], [], over_limit=True)
        calls = [self.run(body) for body in bodies]
        stop = self.tokenizer.decode([int(turn_ids[-1])], skip_special_tokens=False)
        rendered = self.tool_turn_text(calls, stop)
        if rendered is None:
            return None
        return TurnAnswer(calls, self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def run(self, body: str) -> ToolCall:
        """One call's JSON text -> the call run (Tool.call never raises), or an error text for the model."""
        call, problem = read_json(body)
        if problem:
            return ToolCall("", body, f"error: the tool call is {problem}", True)
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str) or name not in self.tools:  # a dict or list name cannot even be looked up
            known = ", ".join(self.tools)
            return ToolCall(str(name or ""), body, f"error: no tool named {name!r}; the tools: {known}", True)
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments, problem = read_json(arguments)
            if problem:
                return ToolCall(name, body, f"error: the arguments are {problem}", True)
        result = self.tools[name].call(arguments)
        return ToolCall(name, body, result, result.startswith("error: "))

    def tool_turn_text(self, calls: Sequence[ToolCall], stop: str) -> str | None:
        """The text the chat template puts between an assistant turn with `calls` (ended by the token `stop`)
        and the next assistant turn's content: the tool messages with the calls' results and the assistant
        header. None when the template's assistant turn does not end with `stop`."""
        assistant = self._assistant(calls)
        replies = [{"role": "tool", "name": call.name, "content": call.result} for call in calls]
        before = self.tokenizer.apply_chat_template(assistant, tools=self.schemas, tokenize=False)
        after = self.tokenizer.apply_chat_template(assistant + replies, tools=self.schemas, tokenize=False,
                                                   add_generation_prompt=True)
        end = before.rfind(stop)
        if end < 0 or not after.startswith(before[: end + len(stop)]):
            return None
        return after[end + len(stop) :]

    @staticmethod
    def _assistant(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
        """A probe conversation: a question, then an assistant turn making `calls` (their arguments left out:
        only what follows the turn is read)."""
        tool_calls = [{"type": "function", "function": {"name": call.name or "tool", "arguments": {}}}
                      for call in calls]
        return [*_PROBE_QUESTION, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
