"""The tool registry: tools by name (`register`) or by import path ('pkg.module:function'), each with the
JSON schema the chat template shows the model, checked when a config names them (resolve_tools).

A tool is a Python function with type hints and a Google-style docstring (a summary, then `Args:` with a
line per argument): its JSON schema is read from them the way transformers reads a function passed to
`apply_chat_template(tools=...)` (transformers.utils.get_json_schema), so a function that could not be
described to the model is refused when the config is read, not at the first call. A tool returns text;
Tool.call turns every failure (bad arguments, an exception, a result that is not text) into an error text
for the model, so a tool never stops a run.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dapo_train.errors import ConfigError
from dapo_train.plugins import decorator_for, import_plugin

TOOLS: dict[str, Callable[..., str]] = {}
register = decorator_for(TOOLS)  # @register("name") on a function (module docstring) adds it under "name"

# JSON schema type -> the Python types a JSON value of it decodes to (bool is no integer here).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """One tool as the model sees it (name, description, parameters: a JSON schema of type object) and
    the function that answers its calls."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function entry that `apply_chat_template(tools=[...])` takes."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments: Any) -> str:
        """The tool's answer to a call with `arguments` (the call's decoded JSON), or an error text
        starting "error: " when the arguments do not fit the schema, the function raises, or it returns
        something that is not a string. Never raises (but lets KeyboardInterrupt through)."""
        problem = self.argument_problem(arguments)
        if problem:
            return f"error: {problem}"
        try:
            result = self.fn(**arguments)
        except Exception as err:
            return f"error: the tool {self.name} failed: {type(err).__name__}: {err}"
        if not isinstance(result, str):
            return f"error: the tool {self.name} returned {type(result).__name__}, not text"
        return result

    def argument_problem(self, arguments: Any) -> str | None:
        """What is wrong with `arguments` for this tool's schema (top-level names and JSON types), or None."""
        if not isinstance(arguments, dict):
            return f"the arguments of {self.name} must be a JSON object, not {type(arguments).__name__}"
        properties = self.parameters.get("properties", {})
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            return f"{self.name} has no argument {unknown[0]!r}; its arguments: {', '.join(properties) or 'none'}"
        missing = [name for name in self.parameters.get("required", []) if name not in arguments]
        if missing:
            return f"{self.name} needs the argument {missing[0]!r}"
        for name, value in arguments.items():
            allowed = _allowed_types(properties[name])
            if allowed and not (isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)):
                wanted = properties[name]["type"]
                return f"the argument {name!r} of {self.name} must be {wanted}, not {type(value).__name__}"
        return None


def _allowed_types(schema: dict[str, Any]) -> tuple[type, ...]:
    """The Python types a property's JSON type admits; () when the schema names none (anything goes)."""
    names = schema.get("type", [])
    names = [names] if isinstance(names, str) else list(names)
    if schema.get("nullable"):
        names.append("null")
    return tuple(t for name in names for t in _JSON_TYPES.get(name, ()))


def tool_from_function(name: str, fn: Callable[..., Any], key: str) -> Tool:
    """The Tool for `fn` under `name`, its schema read from fn's type hints and docstring; ConfigError
    naming `key` when they cannot describe it."""
    from transformers.utils import get_json_schema  # transformers is heavy; importing this module is not

    try:
        function = get_json_schema(fn)["function"]
    except Exception as err:  # transformers raises its own parsing exceptions and TypeError
        reason = " ".join(str(err).split())
        raise ConfigError(key, f"cannot describe the tool '{name}' to the model ({reason}); give every argument "
                               "a type hint and a line under 'Args:' in a Google-style docstring") from None
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    properties = parameters.get("properties", {})
    for argument, schema in properties.items():
        if not _allowed_types(schema):
            raise ConfigError(key, f"the tool '{name}': argument '{argument}' has no JSON type ({schema}); "
                                   "annotate it with str, int, float, bool, list or dict")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(parameters.get("required", [])))
    except (TypeError, ValueError) as err:
        raise ConfigError(key, f"the tool '{name}' cannot be called with its arguments by name: {err}") from None
    return Tool(name, " ".join(function.get("description", "").split()), parameters, fn)


def resolve_tools(names: Sequence[str], key: str = "rollout.tools") -> list[Tool]:
    """The tools a config names, in order: registered names or 'pkg.module:function' paths (the model
    calls a plugin by its function's name). One ConfigError naming `key` and the entry's index for an
    unknown name, a plugin that cannot be imported or described, or two tools of one name."""
    tools: list[Tool] = []
    for index, name in enumerate(names):
        entry_key = f"{key}.{index}"
        if not isinstance(name, str) or not name:
            raise ConfigError(entry_key, f"a tool is a name or 'pkg.module:function', not {name!r}")
        if ":" in name:
            fn = import_plugin(name, entry_key)
            tool = tool_from_function(getattr(fn, "__name__", name.rpartition(":")[2]), fn, entry_key)
        elif name in TOOLS:
            tool = tool_from_function(name, TOOLS[name], entry_key)
        else:
            close = difflib.get_close_matches(name, TOOLS, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ConfigError(entry_key, f"unknown tool '{name}'; {hint}registered: {', '.join(sorted(TOOLS))}, "
                                         "or use 'pkg.module:function'")
        if tool.name in {other.name for other in tools}:
            raise ConfigError(entry_key, f"two tools are named '{tool.name}'; the model could not tell them apart")
        tools.append(tool)
    return tools


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tool list as `tokenizer.apply_chat_template(messages, tools=...)` takes it."""
    return [tool.schema() for tool in tools]
