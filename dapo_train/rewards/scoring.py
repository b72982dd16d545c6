"""The reward registry and scoring: a config's `rewards` bound to their functions and args, and
completions scored with them into one total per completion.

The total is R_i = sum_k w_k * reward_k(o_i, answer_i) (the advantage's R, Eq. 9). Rewards are chosen
by name from the registry (`register`) or by import path ("my_pkg.my_mod:my_reward"), and every choice
is checked when the config is read. What "correct" means comes from the task (data.correctness): a
reward with an `is_correct` parameter gets the task's check bound to it, and `score` reports the same
check's bits. A reward that raises or returns None / NaN / the wrong number of values stops the run
naming the reward and the completion instead of silently scoring zero; a data.correctness check that
fails inside a reward names the check, not the reward.

A reward that owns heavy state (a reward model's weights, rewards/model.py) registers a `load`: its
args are checked cheaply when the config is read, and `RewardSet.load(device)` builds it once per run,
after those checks.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dapo_train.config.schema import Config, RewardSpec
from dapo_train.errors import ConfigError, DoesNotFit, UserError
from dapo_train.plugins import import_plugin
from dapo_train.task.answers import answer_check, is_correct

# fn(completions, answers, *, lengths=None, prompts=None, **args) -> one float per completion; a reward
# with a `questions` parameter also gets the question texts (without the system prompt).
RewardFn = Callable[..., Sequence[float]]
CorrectFn = Callable[[str, str], bool]  # (completion, gold) -> correct
# What score() passes to a reward besides completions and answers (questions only where it is a parameter):
# not settable under args.
CALL_KEYWORDS = ("lengths", "prompts", "questions")


class RewardError(UserError):
    """A reward function failed or returned something that is not one finite float per completion."""


@dataclass(frozen=True)
class RewardEntry:
    """A registered reward. check(args): raises ValueError when its args are bad; it runs whenever a
    config is read, so it must be cheap. load(args, device): the reward function to score with, for a
    reward that owns heavy state (a model); RewardSet.load calls it once per run. Both get the args
    with the function's own defaults filled in."""

    fn: RewardFn
    check: Callable[[dict], None] | None = None
    load: Callable[[dict, Any], RewardFn] | None = None


REWARDS: dict[str, RewardEntry] = {}

# Keyword arguments build_rewards fills in from the config when a reward's signature has them and its
# args leave them unset: argument -> the config key its value comes from.
FILLED_ARGS = {"max_length": "rollout.max_new_tokens", "is_correct": "data.correctness"}


def register(
    name: str, check: Callable[[dict], None] | None = None, load: Callable[[dict, Any], RewardFn] | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a reward to the registry under `name` (check, load: RewardEntry's)."""

    def add(fn: RewardFn) -> RewardFn:
        REWARDS[name] = RewardEntry(fn, check, load)
        return fn

    return add


# --------------------------------------------------------------------------------------------
# Building: config specs -> bound, checked reward functions.


@dataclass(frozen=True)
class BoundReward:
    """One configured reward: `key` names it in Scores.per_reward and in metrics. load: device -> the
    function to score with, for a reward that owns a model (loaded: RewardSet.load has called it);
    reads_questions: fn takes questions=."""

    key: str
    name: str
    weight: float
    fn: Callable[..., Sequence[float]]
    load: Callable[[Any], Callable[..., Sequence[float]]] | None = None
    loaded: bool = False
    reads_questions: bool = False

    @property
    def owns_model(self) -> bool:
        return self.load is not None


@dataclass(frozen=True)
class RewardSet:
    """The configured rewards in config order, built once by build_rewards and passed to score;
    is_correct is the task's check (data.correctness) behind Scores.correct."""

    rewards: tuple[BoundReward, ...]
    is_correct: CorrectFn = is_correct

    @property
    def keys(self) -> list[str]:
        return [reward.key for reward in self.rewards]

    def load(self, device) -> RewardSet:
        """This set with every reward that owns a model built on `device` (the trainer calls it once per
        run, after the cheap checks and the policy); rule rewards stay as they are."""
        return replace(self, rewards=tuple(
            replace(reward, fn=reward.load(device), loaded=True) if reward.owns_model and not reward.loaded else reward
            for reward in self.rewards
        ))

    def models(self) -> RewardSet:
        """Only the rewards that own a model: what the eval scores its items with besides the task's check."""
        return replace(self, rewards=tuple(reward for reward in self.rewards if reward.owns_model))


def _resolve(name: str, key: str) -> RewardEntry:
    if ":" in name:
        return RewardEntry(import_plugin(name, key))
    if name in REWARDS:
        return REWARDS[name]
    close = difflib.get_close_matches(name, REWARDS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(
        key, f"unknown reward '{name}'; {hint}registered: {', '.join(sorted(REWARDS))}, or use 'pkg.module:function'"
    )


def _bind_args(fn: RewardFn, args: dict, defaults: dict, index: int) -> tuple[dict, bool]:
    """Check fn accepts (completions, answers, *, lengths, prompts) and args. -> (bound args, whether fn
    takes questions=)."""
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
    reads_questions = "questions" in signature.parameters
    keywords = dict.fromkeys(CALL_KEYWORDS if reads_questions else CALL_KEYWORDS[:2])
    bound = dict(args)
    for name, value in defaults.items():
        if name in signature.parameters and name not in bound:
            bound[name] = value
    try:
        signature.bind(*call, **keywords, **bound)
    except TypeError as err:
        raise ConfigError(f"rewards.{index}.args", f"{err}; set the reward's keyword arguments under args") from err
    return bound, reads_questions


def _with_defaults(fn: RewardFn, args: dict) -> dict:
    """Bound args plus the function's own defaults for the rest: what a check and a load read."""
    params = inspect.signature(fn).parameters.values()
    own = {p.name: p.default for p in params
           if p.kind is p.KEYWORD_ONLY and p.default is not p.empty and p.name not in CALL_KEYWORDS}
    return {**own, **args}


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
        entry = _resolve(spec.name, f"rewards.{index}.name")
        if not math.isfinite(spec.weight):
            raise ConfigError(f"rewards.{index}.weight", f"must be a finite number, got {spec.weight}")
        args, reads_questions = _bind_args(entry.fn, spec.args, filled, index)
        if entry.check is not None:
            try:
                entry.check(_with_defaults(entry.fn, args))
            except (TypeError, ValueError) as err:
                raise ConfigError(f"rewards.{index}.args", str(err)) from err
        load = None if entry.load is None else functools.partial(entry.load, _with_defaults(entry.fn, args))
        key = _unique_key(spec.name.rpartition(":")[2].rpartition(".")[2], {r.key for r in bound_rewards})
        bound_rewards.append(BoundReward(key, spec.name, float(spec.weight), functools.partial(entry.fn, **args),
                                         load=load, reads_questions=reads_questions))
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
    correctness reward is used (dynamic sampling, Eq. 11, reads them); seconds: key -> the time
    each reward took (seconds_reward_model sums those that own a model).
    """

    total: list[float]
    per_reward: dict[str, list[float]]
    correct: list[bool]
    seconds: dict[str, float] = field(default_factory=dict)


def _snippet(text: object, limit: int = 120) -> str:
    shown = repr(text[:limit]) if isinstance(text, str) else repr(text)[:limit]
    return shown + ("..." if isinstance(text, str) and len(text) > limit else "")


def _fail(key: str, problem: str, index: int | None, completions: list[str]) -> RewardError:
    if index is not None:
        where = f"completion {index}: {_snippet(completions[index])}"
    else:
        where = f"the batch (first: {_snippet(completions[0])})" if completions else "an empty batch"
    return RewardError(f"reward '{key}' {problem} on {where}; fix the reward function or remove it from rewards")


def _call(reward: BoundReward, completions: list[str], answers: list, columns: dict) -> object:
    """reward.fn on the batch; columns: the call keywords (CALL_KEYWORDS -> list or None), questions
    only for a reward that reads them."""
    keywords = columns if reward.reads_questions else {k: v for k, v in columns.items() if k != "questions"}
    return reward.fn(completions, answers, **keywords)


def _find_raiser(reward: BoundReward, completions, answers, columns: dict) -> int | None:
    """After a batch call raised: the first completion that raises on its own (None if none does)."""
    for i in range(len(completions)):
        try:
            _call(reward, completions[i : i + 1], answers[i : i + 1],
                  {k: None if v is None else v[i : i + 1] for k, v in columns.items()})
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
    questions: list[str] | None = None,
) -> Scores:
    """Every configured reward on N completions: R_i = sum_k w_k * reward_k(o_i). prompts: the prompt
    texts the policy saw; questions: the questions alone (no system prompt, no template)."""
    n = len(completions)
    columns = {"lengths": lengths, "prompts": prompts, "questions": questions}
    for label, column in (("answers", answers), *columns.items()):
        if column is not None and len(column) != n:
            raise ValueError(f"score(): {len(column)} {label} for {n} completions")
    total = [0.0] * n
    per_reward: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    for reward in reward_set.rewards:
        start = time.perf_counter()
        try:
            values = _call(reward, completions, answers, columns)
        except (ConfigError, DoesNotFit):  # the task's check failed inside the reward, or a reward model's forward
            raise  # ran out of memory with nothing left to halve (rewards/model.py): each names itself
        except Exception as err:
            index = _find_raiser(reward, completions, answers, columns)
            raise _fail(reward.key, f"raised {type(err).__name__}: {err}", index, completions) from err
        seconds[reward.key] = time.perf_counter() - start
        per_reward[reward.key] = _as_floats(reward.key, values, completions)
        total = [t + reward.weight * v for t, v in zip(total, per_reward[reward.key])]
    correct = [bool(reward_set.is_correct(text, gold)) for text, gold in zip(completions, answers)]
    return Scores(total=total, per_reward=per_reward, correct=correct, seconds=seconds)
