"""The registered rewards as a user reads them (`dapo-train config --keys rewards`, docs/configuration.md):
each one's name, what it scores (the first paragraph of its docstring) and the keyword arguments it
takes under `args`, with their defaults. Everything is read from the registry and the functions'
signatures, so a reward added with `@register` is listed with no second list to keep in step."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from dapo_train.config.keys import markdown_cell, show_value
from dapo_train.rewards.scoring import CALL_KEYWORDS, FILLED_ARGS, REWARDS


@dataclass(frozen=True)
class RewardArg:
    """One keyword argument of a reward. default: as YAML writes it, `required` when it has none, or
    the config key the trainer fills it from (FILLED_ARGS)."""

    name: str
    default: str


@dataclass(frozen=True)
class RewardDoc:
    name: str
    summary: str
    args: tuple[RewardArg, ...]


def _arg(param: inspect.Parameter) -> RewardArg:
    if param.name in FILLED_ARGS:
        return RewardArg(param.name, FILLED_ARGS[param.name])
    if param.default is inspect.Parameter.empty:
        return RewardArg(param.name, "required")
    return RewardArg(param.name, show_value(param.default))


def reward_docs() -> list[RewardDoc]:
    """Every registered reward, by name."""
    docs = []
    for name in sorted(REWARDS):
        fn = REWARDS[name].fn
        params = inspect.signature(fn).parameters.values()
        args = tuple(_arg(p) for p in params if p.kind is p.KEYWORD_ONLY and p.name not in CALL_KEYWORDS)
        summary = " ".join((inspect.getdoc(fn) or "").split("\n\n", 1)[0].split())
        docs.append(RewardDoc(name, summary, args))
    return docs


def show_args(doc: RewardDoc) -> str:
    """`max_length = rollout.max_new_tokens, cache_length = required`, or `none`."""
    return ", ".join(f"{arg.name} = {arg.default}" for arg in doc.args) or "none"


def reward_lines() -> list[str]:
    """What `config --keys rewards` prints under the rewards key."""
    lines = [
        "Registered rewards (name: what it scores; its args = default: 'required' must be set, "
        "a config key gives the value unless args set it):"
    ]
    lines += [f"  {doc.name}: {doc.summary} args: {show_args(doc)}" for doc in reward_docs()]
    return lines


def reward_table() -> str:
    """Markdown table of the registered rewards (docs/configuration.md embeds it; a test keeps it in step)."""
    lines = ["| reward | what it scores | args (default) |", "| --- | --- | --- |"]
    for doc in reward_docs():
        args = ", ".join(f"`{arg.name}` ({arg.default})" for arg in doc.args) or "none"
        lines.append(f"| `{doc.name}` | {markdown_cell(doc.summary)} | {args} |")
    return "\n".join(lines)
