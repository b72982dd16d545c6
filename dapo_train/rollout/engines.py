"""Rollout: prompts -> sampled completions with exact token masks and behaviour log-probs, behind an
engine interface.

`collect` talks to a RolloutEngine (generate G completions for each prompt; take new weights after
each step's updates), chosen by `rollout.engine` from ROLLOUT_ENGINES. Built in (hf_engines.py), over
a transformers model (the token-level work is decoding.py's):

- `hf` (default): DecodeLoopEngine, a decode loop over the model's forward, each prompt prefilled
  ONCE for its G completions and finished rows dropped; or, when `rollout.compile` is on (auto: with
  CUDA), StaticCacheEngine, transformers' static-cache generate (compiled into CUDA graphs on CUDA)
  on batch rows bucketed to powers of two, so dynamic sampling's rounds reuse a few compiled shapes.
  On CUDA both sample from a bfloat16 copy of the weights, refreshed after every step's updates.
- `hf-generate`: GenerateEngine, plain `model.generate` on G copies of each prompt: the reference
  the loop is tested against.

Another engine (vLLM, SGLang, ...) is one module: a class with the two methods of RolloutEngine,
registered with `@register_engine("name")` (or named in the config as 'pkg.module:Class'). It gets
the unwrapped model and the tokenizer, and must keep the semantics below.
The semantics every engine keeps, and the completion records they return: completions.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from dapo_train.plugins import decorator_for
from dapo_train.rollout.completions import Completion
from dapo_train.rollout.decoding import decode_region
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.tools.registry import Tool, resolve_tools
from dapo_train.tools.turns import ToolTurns

# ---------------------------------------------------------------- engines


class RolloutEngine(Protocol):
    """What collect needs from a rollout backend."""

    def generate(
        self, prompts: Sequence[Sequence[int]], settings: SamplingSettings, group_size: int
    ) -> list[Completion]:
        """group_size completions per prompt, prompt-major, with the semantics of this module's docstring.
        An engine whose `keyed_draws` attribute is true also takes seeds=[one int per row]: each row is
        then drawn from its own random stream (dapo.screen_size's screens and their continuations).

        Tools (rollout.tools): an engine that can run them says so with `supports_tools = True` on its class
        or factory (the trainer refuses any other at start when tools are named) and gets them as
        EngineSetup.tools, a tools.ToolTurns. When a row ends an assistant turn (an EOS id) that makes calls,
        `ToolTurns.answer(turn ids, calls made so far)` runs them and returns the tool turn's tokens (or None:
        the completion ends there; over_limit: it ends there with over_calls set, not truncated); the engine
        appends those tokens to the row as context and samples on. Each Completion then carries its whole
        transcript in completion_ids, its extent given by the engine (EOS ids occur inside it), policy_mask
        False on the appended tokens (their behaviour log-probs are not read), text and tool_turn_spans from
        transcript_text (the rewards read the policy's text alone), over_calls, and tool_calls.
        rollout.max_new_tokens bounds the whole transcript."""

    def sync_weights(self) -> None:
        """Take the training model's current weights; the trainer calls it after every step's updates.
        (Optional, beside these: sleep() while the update runs, `pause`; close() when the run ends, `release`.)"""


def pause(engine: RolloutEngine) -> None:
    """The update runs now: an engine with a `sleep()` method (vllm on CUDA) frees what generation holds until
    its next generate or sync_weights; the others hold nothing of their own to free."""
    sleep = getattr(engine, "sleep", None)
    if callable(sleep):
        sleep()


def release(engine: RolloutEngine | None) -> None:
    """The engine's run is over: an engine with a `close()` method (vllm) gives back what it holds (its KV cache
    and its copy of the weights) now, not when the process ends; the others hold nothing of their own."""
    close = getattr(engine, "close", None)
    if callable(close):
        close()


def eval_engine(engine: RolloutEngine) -> RolloutEngine | None:
    """The engine evals generate through, when it serves them (`serves_eval`: vllm, whose weights are the
    training model's since the last sync); None: they decode with eval_decoding's weights."""
    return engine if getattr(engine, "serves_eval", False) else None


@contextmanager
def eval_decoding(engine: RolloutEngine, model: torch.nn.Module, compute_dtype: torch.dtype | None):
    """The weights an eval's decode loop runs over, for the eval's length: the engine's own (`decoding()`: a
    transformers engine's rollout copy, synced after every update, so an eval reads no float32 weight and its
    cache is in the copy's dtype), else the training `model` in one autocast region (decoding.decode_region)."""
    decoding = getattr(engine, "decoding", None)
    with decoding() if callable(decoding) else decode_region(model, compute_dtype) as decoder:
        yield decoder


@dataclass
class EngineSetup:
    """What an engine factory receives. model: the UNWRAPPED training model (float32 master weights)."""

    model: torch.nn.Module
    tokenizer: object
    batch_size: int  # rollout.generation_batch_size: most sequences per batch
    dtype: str  # rollout.dtype: auto | float32 | bfloat16
    compile: str  # rollout.compile: auto | on | off
    tools: ToolTurns | None = None  # rollout.tools with the chat template's tool turns; None: no tools
    max_length: int = 0  # the longest prompt plus the largest completion budget asked for; 0: the model's positions
    vllm_memory: float = 0.3  # rollout.vllm_memory: vllm's share of a CUDA card
    vllm_kv_cache_mib: int = 0  # rollout.vllm_kv_cache_mib: vllm's KV cache (0: auto)
    compute_dtype: torch.dtype | None = None  # train.mixed_precision's autocast dtype (None: no autocast)


ROLLOUT_ENGINES: dict[str, Callable[[EngineSetup], RolloutEngine]] = {}


# Decorator of an engine class (or factory function): @register_engine("name") makes
# `rollout.engine: name` build it from an EngineSetup.
register_engine = decorator_for(ROLLOUT_ENGINES)


# What an engine must have, and what a plugin engine is told when it lacks it.
ENGINE_METHODS = ("generate", "sync_weights")
ENGINE_HINT = (
    "an engine is a class (or factory) taking an EngineSetup, with generate() and sync_weights() (docs/benchmarks.md)"
)


def _lacks(thing: object) -> str:
    """'generate() and sync_weights()': the engine methods `thing` does not have ('' if none)."""
    return " and ".join(f"{method}()" for method in ENGINE_METHODS if not callable(getattr(thing, method, None)))


def engine_factory(name: str) -> Callable[[EngineSetup], RolloutEngine]:
    """The factory `rollout.engine` names (a registered name or 'pkg.module:Factory'); ConfigError if none,
    or if a plugin is a class without the engine's methods or cannot take one EngineSetup. Cheap: the
    trainer calls it before loading the model."""
    from dapo_train.errors import ConfigError
    from dapo_train.plugins import import_plugin, require_signature

    if name in ROLLOUT_ENGINES:
        factory = ROLLOUT_ENGINES[name]
        if hasattr(factory, "require"):  # a built-in engine that needs an optional package (vllm) checks it here
            factory.require()
        return factory
    if ":" not in name:
        raise ConfigError("rollout.engine", f"unknown engine {name!r}; built in: {', '.join(ROLLOUT_ENGINES)}, "
                          "or 'pkg.module:Factory'")
    factory = import_plugin(name, "rollout.engine")
    if isinstance(factory, type) and _lacks(factory):
        raise ConfigError("rollout.engine", f"{name} is a class without {_lacks(factory)}; {ENGINE_HINT}")
    require_signature(factory, (None,), "rollout.engine",
                      f"{name} cannot be called with one EngineSetup; {ENGINE_HINT}")
    if _takes_any_number(factory):
        raise ConfigError("rollout.engine", f"{name} takes any number of arguments, not one EngineSetup (a "
                          f"general function, not an engine factory); {ENGINE_HINT}")
    return factory


def _takes_any_number(factory: Callable) -> bool:
    """A function with *args (os.path.join, print): it binds one EngineSetup but was not written for one.
    Found from its signature, before the data is read; a factory that fails otherwise, only when called."""
    import inspect

    try:
        parameters = inspect.signature(factory).parameters.values()
    except ValueError:  # no readable signature (C code): calling it will tell
        return False
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def rollout_tools(rollout_cfg) -> list[Tool]:
    """rollout.tools resolved (tools.resolve_tools), or a ConfigError when a name or schema is bad or the
    configured engine cannot run tools: hf-generate (model.generate cannot feed a row the tool turn), hf with
    rollout.compile=on (the static-cache engine), or a plugin whose class or factory does not set
    `supports_tools = True`. Cheap: before the model loads."""
    from dapo_train.errors import ConfigError

    tools = resolve_tools(rollout_cfg.tools)
    if not tools:
        return tools
    if rollout_cfg.engine == "hf" and rollout_cfg.compile == "on":
        raise ConfigError("rollout.compile", "the static-cache engine (rollout.compile=on) cannot run tools; set "
                          "rollout.compile=off or auto (with tools, hf decodes with its decode loop) or name no tools")
    if not getattr(engine_factory(rollout_cfg.engine), "supports_tools", False):
        raise ConfigError("rollout.engine", f"the engine {rollout_cfg.engine} cannot run tools (rollout.tools); use "
                          "rollout.engine=hf, an engine with supports_tools = True, or name no tools")
    return tools


def build_engine(rollout_cfg, model, tokenizer, tools: ToolTurns | None = None, max_length: int = 0,
                 compute_dtype: torch.dtype | None = None) -> RolloutEngine:
    """The engine of a RolloutConfig for an UNWRAPPED model. A plugin factory that fails on the
    EngineSetup, or returns something without the engine's methods, is a ConfigError naming it.
    tools: rollout.tools for the tokenizer (tools.tool_turns), for an engine that supports them (rollout_tools).
    max_length, compute_dtype: EngineSetup's."""
    from dapo_train.errors import ConfigError

    setup = EngineSetup(model=model, tokenizer=tokenizer, batch_size=rollout_cfg.generation_batch_size,
                        dtype=rollout_cfg.dtype, compile=rollout_cfg.compile, tools=tools, max_length=max_length,
                        vllm_memory=rollout_cfg.vllm_memory, vllm_kv_cache_mib=rollout_cfg.vllm_kv_cache_mib,
                        compute_dtype=compute_dtype)
    name, factory = rollout_cfg.engine, engine_factory(rollout_cfg.engine)
    if name in ROLLOUT_ENGINES:
        return factory(setup)
    try:
        engine = factory(setup)
    except Exception as exc:  # the plugin's own code, given what every engine gets
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError("rollout.engine", f"{name}(EngineSetup) failed: {type(exc).__name__}: {said}; "
                          f"{ENGINE_HINT}") from exc
    if _lacks(engine):
        raise ConfigError("rollout.engine", f"{name} returned {engine!r:.60} ({type(engine).__name__}), which has no "
                          f"{_lacks(engine)}; {ENGINE_HINT}")
    return engine
