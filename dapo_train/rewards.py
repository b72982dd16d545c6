"""Rule rewards: completion texts and gold answers in, one float per completion and reward out.

The total is R_i = sum_k w_k * reward_k(o_i, answer_i), with the soft overlong punishment of
Eq. 13 available as one more reward (`overlong`). Rewards are chosen by name from a registry or
by import path ("my_pkg.my_mod:my_reward"), and every choice is checked when the config is read.
What "correct" means comes from the task (data.correctness): a reward with an `is_correct`
parameter gets the task's check bound to it, and `score` reports the same check's bits.

The format rewards accept a completion without a newline after </answer> (decoded outputs rarely
carry one). A reward that raises or returns None / NaN / the wrong number of values stops the run
naming the reward and the completion instead of silently scoring zero.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapo_train.algo import overlong_penalty
from dapo_train.answers import answer_check, extract_answer, is_correct
from dapo_train.config import Config, RewardSpec, import_plugin
from dapo_train.errors import ConfigError, UserError

__all__ = [
    "FILLED_ARGS", "REWARDS", "BoundReward", "RewardError", "RewardSet", "Scores", "build_rewards", "extract_answer",
    "is_correct", "register", "rewards_from_config", "score",
]

# fn(completions, answers, *, lengths=None, prompts=None, **args) -> one float per completion.
RewardFn = Callable[..., Sequence[float]]
CorrectFn = Callable[[str, str], bool]  # (completion, gold) -> correct


class RewardError(UserError):
    """A reward function failed or returned something that is not one finite float per completion."""


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward and an optional check of its bound args (raises ValueError if bad)."""

    fn: RewardFn
    check: Callable[[dict], None] | None = None


REWARDS: dict[str, RewardEntry] = {}

# Keyword arguments build_rewards fills in from the config when a reward's signature has them and its
# args leave them unset: argument -> the config key its value comes from.
FILLED_ARGS = {"max_length": "rollout.max_new_tokens", "is_correct": "data.correctness"}


def register(name: str, check: Callable[[dict], None] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward to the registry under `name`."""

    def add(fn: RewardFn) -> RewardFn:
        REWARDS[name] = RewardEntry(fn, check)
        return fn

    return add


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


def _check_overlong(args: dict) -> None:
    max_length, cache_length = args["max_length"], args["cache_length"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (max_length, cache_length)):
        raise ValueError(
            f"overlong needs integer token counts, got max_length={max_length!r}, cache_length={cache_length!r}"
        )
    if not 0 < cache_length < max_length:  # cache_length = max_length would punish every completion
        raise ValueError(
            "overlong needs 0 < cache_length < max_length (L_max), "
            f"got cache_length={cache_length}, max_length={max_length}"
        )


@register("overlong", check=_check_overlong)
def overlong(
    completions: list[str], answers: list, *, lengths=None, prompts=None, max_length: int, cache_length: int
) -> list[float]:
    """Soft overlong punishment (Eq. 13) on token lengths: 0 up to max_length - cache_length,
    a linear ramp to -1 at max_length, -1 beyond. max_length defaults to rollout.max_new_tokens."""
    if lengths is None:
        raise UserError("reward 'overlong' needs token lengths; pass lengths= to score()")
    return [float(overlong_penalty(int(n), max_length, cache_length)) for n in lengths]


# --------------------------------------------------------------------------------------------
# Building: config specs -> bound, checked reward functions.


@dataclass(frozen=True)
class BoundReward:
    """One configured reward: `key` names it in Scores.per_reward and in metrics."""

    key: str
    name: str
    weight: float
    fn: Callable[..., Sequence[float]]


@dataclass(frozen=True)
class RewardSet:
    """The configured rewards in config order, built once by build_rewards and passed to score;
    is_correct is the task's check (data.correctness) behind Scores.correct."""

    rewards: tuple[BoundReward, ...]
    is_correct: CorrectFn = is_correct

    @property
    def keys(self) -> list[str]:
        return [reward.key for reward in self.rewards]


def _resolve(name: str, key: str) -> tuple[RewardFn, Callable[[dict], None] | None]:
    if ":" in name:
        return import_plugin(name, key), None
    if name in REWARDS:
        return REWARDS[name].fn, REWARDS[name].check
    close = difflib.get_close_matches(name, REWARDS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        key, f"unknown reward '{name}'; {hint}registered: {', '.join(sorted(REWARDS))}, or use 'pkg.module:function'"
    )


def _bind_args(fn: RewardFn, args: dict, defaults: dict, index: int) -> dict:
    """Check fn accepts (completions, answers, *, lengths, prompts) and args; return bound args."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"rewards.{index}.name", f"cannot read the signature of the reward: {err}") from err
    call = (["completion"], ["answer"])
    try:
        signature.bind_partial(*call, lengths=None, prompts=None)
    except TypeError as err:
        raise ConfigError(
            f"rewards.{index}.name",
            f"the function does not accept (completions, answers, *, lengths, prompts): {err}; "
            "define it as f(completions, answers, *, lengths=None, prompts=None, **kwargs)",
        ) from err
    bound = dict(args)
    for name, value in defaults.items():
        if name in signature.parameters and name not in bound:
            bound[name] = value
    try:
        signature.bind(*call, lengths=None, prompts=None, **bound)
    except TypeError as err:
        raise ConfigError(f"rewards.{index}.args", f"{err}; set the reward's keyword arguments under args") from err
    return bound


def _unique_key(base: str, taken: set[str]) -> str:
    key, count = base, 1
    while key in taken:
        count += 1
        key = f"{base}_{count}"
    return key


def build_rewards(specs: list[RewardSpec], *, max_new_tokens: int, is_correct: CorrectFn = is_correct) -> RewardSet:
    """Resolve and check every configured reward before anything heavy loads.

    A reward whose signature has `max_length` gets rollout.max_new_tokens, one with `is_correct`
    gets the task's check (`is_correct`, numeric by default), unless its args set them.
    Import-path rewards are keyed by their function name ("my_pkg.mod:my_reward" -> my_reward);
    repeated keys become key, key_2, ...
    """
    if not specs:
        raise ConfigError("rewards", "no reward configured; add e.g. {name: accuracy, weight: 1.0}")
    from_config = {"rollout.max_new_tokens": max_new_tokens, "data.correctness": is_correct}
    filled = {arg: from_config[key] for arg, key in FILLED_ARGS.items()}
    bound_rewards: list[BoundReward] = []
    for index, spec in enumerate(specs):
        fn, check = _resolve(spec.name, f"rewards.{index}.name")
        if not math.isfinite(spec.weight):
            raise ConfigError(f"rewards.{index}.weight", f"must be a finite number, got {spec.weight}")
        args = _bind_args(fn, spec.args, filled, index)
        if check is not None:
            try:
                check(args)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"rewards.{index}.args", str(err)) from err
        key = _unique_key(spec.name.rpartition(":")[2].rpartition(".")[2], {r.key for r in bound_rewards})
        bound_rewards.append(BoundReward(key, spec.name, float(spec.weight), functools.partial(fn, **args)))
    return RewardSet(tuple(bound_rewards), is_correct)


def rewards_from_config(cfg: Config) -> RewardSet:
    """The run's rewards, with the task's correctness check, and dapo.filter_metric checked against
    them: what `run` and `config` validate first, before anything heavy loads."""
    reward_set = build_rewards(
        cfg.rewards, max_new_tokens=cfg.rollout.max_new_tokens, is_correct=answer_check(cfg.data.correctness).is_correct
    )
    metric = cfg.dapo.filter_metric
    if metric.startswith("reward:") and metric.partition(":")[2] not in reward_set.keys:
        raise ConfigError(
            "dapo.filter_metric", f"no configured reward is called '{metric.partition(':')[2]}'; "
            f"configured: {', '.join(reward_set.keys)}"
        )
    return reward_set


# --------------------------------------------------------------------------------------------
# Scoring.


@dataclass
class Scores:
    """Rewards of N completions.

    total: (N,) weighted sum; per_reward: key -> (N,) unweighted values (for rewards/<key>/mean);
    correct: (N,) the task's correct bits (RewardSet.is_correct), computed whether or not a
    correctness reward is used (dynamic sampling, Eq. 11, reads them).
    """

    total: list[float]
    per_reward: dict[str, list[float]]
    correct: list[bool]


def _snippet(text: object, limit: int = 120) -> str:
    shown = repr(text[:limit]) if isinstance(text, str) else repr(text)[:limit]
    return shown + ("..." if isinstance(text, str) and len(text) > limit else "")


def _fail(key: str, problem: str, index: int | None, completions: list[str]) -> RewardError:
    if index is not None:
        where = f"completion {index}: {_snippet(completions[index])}"
    else:
        where = f"the batch (first: {_snippet(completions[0])})" if completions else "an empty batch"
    return RewardError(f"reward '{key}' {problem} on {where}; fix the reward function or remove it from rewards")


def _find_raiser(reward: BoundReward, completions, answers, lengths, prompts) -> int | None:
    """After a batch call raised: the first completion that raises on its own (None if none does)."""
    for i in range(len(completions)):
        try:
            reward.fn(
                completions[i : i + 1], answers[i : i + 1],
                lengths=None if lengths is None else lengths[i : i + 1],
                prompts=None if prompts is None else prompts[i : i + 1],
            )
        except Exception:
            return i
    return None


def _as_floats(key: str, values: object, completions: list[str]) -> list[float]:
    """One finite float per completion, or a RewardError naming the first bad value."""
    try:
        count = None if isinstance(values, (str, bytes, dict)) else len(values)
    except TypeError:  # None, a number, a 0-d array
        count = None
    if count is None:
        raise _fail(key, f"returned {type(values).__name__} instead of a list of floats", None, completions)
    if count != len(completions):
        raise _fail(key, f"returned {count} values for {len(completions)} completions", None, completions)
    floats = []
    for index, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _fail(key, f"returned {_snippet(value, 40)} (not a number)", index, completions) from None
        if not math.isfinite(number):
            raise _fail(key, f"returned {number}", index, completions)
        floats.append(number)
    return floats


def score(
    reward_set: RewardSet,
    completions: list[str],
    answers: list,
    *,
    lengths: Sequence[int] | None = None,
    prompts: list[str] | None = None,
) -> Scores:
    """Every configured reward on N completions: R_i = sum_k w_k * reward_k(o_i)."""
    n = len(completions)
    for label, column in (("answers", answers), ("lengths", lengths), ("prompts", prompts)):
        if column is not None and len(column) != n:
            raise ValueError(f"score(): {len(column)} {label} for {n} completions")
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    for reward in reward_set.rewards:
        try:
            values = reward.fn(completions, answers, lengths=lengths, prompts=prompts)
        except Exception as err:
            index = _find_raiser(reward, completions, answers, lengths, prompts)
            raise _fail(reward.key, f"raised {type(err).__name__}: {err}", index, completions) from err
        per_reward[reward.key] = _as_floats(reward.key, values, completions)
        total = [t + reward.weight * v for t, v in zip(total, per_reward[reward.key])]
    correct = [bool(reward_set.is_correct(text, gold)) for text, gold in zip(completions, answers)]
    return Scores(total=total, per_reward=per_reward, correct=correct)
