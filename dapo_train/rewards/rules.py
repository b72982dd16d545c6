"""The built-in rule rewards: completion texts and gold answers in, one float per completion out.

`accuracy` / `correctness` grade with the task's check, `digit`, `hard_format` and `mark` score the
<think>/<answer> format, `tool_format` the tool calls (rollout.tools), and `overlong` is the soft overlong
punishment of Eq. 13 as one more reward.
The format rewards accept a completion without a newline after </answer> (decoded outputs rarely
carry one).
"""

from __future__ import annotations

import math

from dapo_train.algo.advantages import overlong_penalty
from dapo_train.errors import UserError
from dapo_train.rewards.scoring import CorrectFn, register
from dapo_train.task.answers import extract_answer, is_correct
from dapo_train.tools.turns import call_bodies, read_json

# --------------------------------------------------------------------------------------------
# The rewards.

# hard_format's shape, "<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>", as three pieces.
_FORMAT_HEAD, _FORMAT_MIDDLE, _FORMAT_TAIL = "<think>\n", "\n</think>\n<answer>\n", "\n</answer>"
_MARKS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
_MARK_VALUE = 0.125
_TRAILING_COST = 0.001  # per character of text after </answer>


@register("correctness")
def correctness(
    completions: list[str], answers: list, *, lengths=None, prompts=None, is_correct: CorrectFn = is_correct
) -> list[float]:
    """2.0 if the completion is correct (data.correctness; numeric by default), else 0.0."""
    return [2.0 if is_correct(text, gold) else 0.0 for text, gold in zip(completions, answers)]


@register("accuracy")
def accuracy(
    completions: list[str], answers: list, *, lengths=None, prompts=None, is_correct: CorrectFn = is_correct
) -> list[float]:
    """The paper's rule reward (Sec. 2.4, Eq. 7): +1 if the answer is equivalent (data.correctness),
    -1 otherwise."""
    return [1.0 if is_correct(text, gold) else -1.0 for text, gold in zip(completions, answers)]


@register("digit")
def digit(completions: list[str], answers: list, *, lengths=None, prompts=None) -> list[float]:
    """0.5 if the answer block holds a number at all (right or wrong)."""
    return [0.5 if extract_answer(text) is not None else 0.0 for text in completions]


@register("hard_format")
def hard_format(completions: list[str], answers: list, *, lengths=None, prompts=None) -> list[float]:
    """0.5 for exactly "<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>".

    Whitespace before the first tag and after the last (including no final newline at all) is
    accepted.
    """
    return [0.5 if _is_hard_format(text) else 0.0 for text in completions]


def _is_hard_format(text: str) -> bool:
    """The shape's match, decided in linear time: a regex with a lazy ".*?" pair backtracks
    quadratically on degenerate completions that repeat the tags (0.25 s for 20k characters)."""
    body = text.strip()
    if not (body.startswith(_FORMAT_HEAD) and body.endswith(_FORMAT_TAIL)):
        return False
    # The leftmost middle leaves the most room for the answer; both ".*?" may be empty.
    middle = body.find(_FORMAT_MIDDLE, len(_FORMAT_HEAD))
    return middle >= 0 and middle + len(_FORMAT_MIDDLE) <= len(body) - len(_FORMAT_TAIL)


@register("mark")
def mark(completions: list[str], answers: list, *, lengths=None, prompts=None) -> list[float]:
    """0.125 per tag that appears exactly once with its newlines, up to 0.5; text after </answer>
    costs 0.001 per character (whitespace is free).

    The closing tag needs no final newline, and the trailing-text cost only takes back what that
    tag earned, so the reward stays in [0, 0.5] instead of going arbitrarily negative on a long tail.
    """
    return [_mark_one(text) for text in completions]


def _mark_one(text: str) -> float:
    value = sum(_MARK_VALUE for tag in _MARKS if text.count(tag) == 1)
    if text.count(_MARKS[-1]) == 1:
        trailing = text.rpartition(_MARKS[-1])[2].strip()
        value -= min(_MARK_VALUE, _TRAILING_COST * len(trailing))
    return value


def _check_tool_format(args: dict) -> None:
    for key in ("well_formed", "malformed"):
        value = args[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"tool_format's {key} must be a finite number, got {value!r}")


@register("tool_format", check=_check_tool_format)
def tool_format(
    completions: list[str], answers: list, *, lengths=None, prompts=None, well_formed: float = 0.0,
    malformed: float = -0.5,
) -> list[float]:
    """For rollout.tools: `malformed` if a <tool_call> of the completion is not a JSON object with a "name"
    and object "arguments", else `well_formed` if it made a call, else 0.

    The defaults only punish calls the rollout could not parse (a named tool's own error, such as a
    calculator's division by zero, is not a format fault). A positive well_formed pays for calling at all,
    which a policy can earn with calls it does not need: keep it small next to accuracy's weight.
    """
    values = []
    for text in completions:
        bodies = call_bodies(text)
        values.append(malformed if any(map(_malformed_call, bodies)) else well_formed if bodies else 0.0)
    return values


def _malformed_call(body: str) -> bool:
    """A call's text is not {"name": str, "arguments": {...}} (the arguments may be a JSON string of one,
    as the rollout accepts), read as the rollout reads it (tools/turns.py read_json)."""
    call, problem = read_json(body)
    if problem or not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return True
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments, problem = read_json(arguments)
    return problem is not None or not isinstance(arguments, dict)


def _cache_tokens(cache_length: int | float, max_length: int) -> int:
    """L_cache in tokens: an int is a token count; a float in (0, 1) a fraction of L_max (at least one
    token), so the buffer follows rollout.max_new_tokens when the budget changes."""
    if isinstance(cache_length, float):
        return max(1, round(cache_length * max_length))
    return cache_length


def _check_overlong(args: dict) -> None:
    max_length, cache_length = args["max_length"], args["cache_length"]
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise ValueError(f"overlong needs an integer max_length (L_max, tokens), got {max_length!r}")
    if isinstance(cache_length, float):
        if not 0.0 < cache_length < 1.0:
            raise ValueError(f"overlong's cache_length as a fraction of max_length needs 0 < cache_length < 1, "
                             f"got {cache_length}")
        cache_length = _cache_tokens(cache_length, max_length)
    elif not isinstance(cache_length, int) or isinstance(cache_length, bool):
        raise ValueError(
            f"overlong needs integer token counts (or cache_length as a fraction of max_length), got "
            f"max_length={max_length!r}, cache_length={cache_length!r}"
        )
    if not 0 < cache_length < max_length:  # cache_length = max_length would punish every completion
        raise ValueError(
            "overlong needs 0 < cache_length < max_length (L_max, default rollout.max_new_tokens), "
            f"got cache_length={cache_length}, max_length={max_length}; lower cache_length, or give it as a "
            "fraction of L_max (cache_length: 0.25) so that it follows rollout.max_new_tokens"
        )


@register("overlong", check=_check_overlong)
def overlong(
    completions: list[str], answers: list, *, lengths=None, prompts=None, max_length: int, cache_length: int | float
) -> list[float]:
    """Soft overlong punishment (Eq. 13) on token lengths: 0 up to max_length - cache_length,
    a linear ramp to -1 at max_length, -1 beyond. max_length defaults to rollout.max_new_tokens;
    cache_length is a token count, or a fraction of max_length (0.25: the last quarter)."""
    if lengths is None:
        raise UserError("reward 'overlong' needs token lengths; pass lengths= to score()")
    cache = _cache_tokens(cache_length, max_length)
    return [float(overlong_penalty(int(n), max_length, cache)) for n in lengths]
