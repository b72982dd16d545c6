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

Semantics every engine keeps: the sampling settings are passed explicitly (a checkpoint's
generation_config, e.g. Qwen2.5's repetition penalty and top_p/top_k, must not silently change the
distribution the loss assumes); a completion's valid tokens run up to AND including the first EOS,
where EOS is any id of generation_config.eos_token_id or the tokenizer's (Qwen's pad id is also an
EOS id, so masks come from the first EOS position, never from comparing with the pad id); a row
with no EOS within max_new_tokens is truncated. The EOS is in the loss, so the model learns to stop.
With rollout.tools (docs/tools.md), an EOS that ends a turn with calls continues the row with the
tool turn, context the policy did not sample (Completion.policy_mask), up to the same budget
(RolloutEngine.generate).
Each completion carries the behaviour log-probs of its tokens, those of the distribution it was
sampled from (sampling.behaviour_distribution), and under top-k / top-p truncation the log of the
probability mass the truncation kept at each token (kept_log_mass): the trainer corrects the rollout
against the training forward before truncation, and reports the truncation apart (docs/training.md,
Sampling from what is scored).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dapo_train.plugins import decorator_for
from dapo_train.rollout.decoding import Decoded, decode_loop, decode_region
from dapo_train.rollout.fitting import GenerationRows, decode_fitting
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.tools.registry import Tool, resolve_tools
from dapo_train.tools.turns import ToolTurns


@dataclass
class Completion:
    """One sampled completion. L = number of valid tokens (EOS included when present)."""

    prompt_ids: torch.Tensor  # (P,) the prompt's tokens, no padding
    completion_ids: torch.Tensor  # (L,) valid generated tokens, no padding
    truncated: bool  # no EOS within max_new_tokens
    text: str  # decoded completion, special tokens skipped; with tools the whole transcript (transcript_text)
    behaviour_logprobs: torch.Tensor | None = None  # (L,) float32 under the sampling distribution; every engine sets it
    # (L,) float32 <= 0: log of the probability top-k / top-p kept where each token was sampled, so
    # behaviour_logprobs + kept_log_mass are the rollout's log-probs before truncation; None: nothing truncated.
    kept_log_mass: torch.Tensor | None = None
    # (L,) bool, with tools: True on the policy's own tokens, False on the tool turns the engine fed in (context,
    # not actions: out of the loss, the log-probs' use, Eq. 12's count and the entropy); None: all the policy's.
    policy_mask: torch.Tensor | None = None
    tool_calls: list = field(default_factory=list)  # tools.turns.ToolCall of each call made, in order
    # ended by a turn whose calls would pass rollout.max_tool_calls (none of them run): its own end, not truncated
    over_calls: bool = False
    # [start, end) spans of `text` that are tool turns, in order (transcript_text); the rest is the policy's
    tool_turn_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.completion_ids.numel())

    @property
    def policy_tokens(self) -> int:
        """The tokens the policy sampled: its length less its tool turns'."""
        return self.length if self.policy_mask is None else int(self.policy_mask.sum())

    @property
    def policy_text(self) -> str:
        """What the policy wrote: `text` less its tool turns. The rewards and the answer check read this, so a
        tool's reply is never graded as the policy's answer (an <answer> block open across a call included)."""
        return policy_part(self.text, self.tool_turn_spans)

    @property
    def untruncated_logprobs(self) -> torch.Tensor | None:
        """(L,) the rollout's own log-probs before top-k / top-p truncation (its weights, logits / T): what
        the trainer compares with the training forward; the behaviour log-probs when nothing was truncated."""
        if self.behaviour_logprobs is None or self.kept_log_mass is None:
            return self.behaviour_logprobs
        return self.behaviour_logprobs + self.kept_log_mass


def eos_token_ids(model, tokenizer) -> list[int]:
    """All ids that end a completion: generation_config.eos_token_id (int or list) + tokenizer's."""
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if value is None:
            continue
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    if not ids:
        raise ValueError(
            "the model defines no EOS token id (generation_config.eos_token_id and tokenizer.eos_token_id are unset)"
        )
    return ids


def pad_token_id(model, tokenizer) -> int:
    """Padding id for batched generation: the tokenizer's pad, else the generation config's, else EOS."""
    for value in (tokenizer.pad_token_id, getattr(model.generation_config, "pad_token_id", None)):
        if value is not None:
            return int(value)
    return eos_token_ids(model, tokenizer)[0]


def completion_mask(generated: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid-token mask of generated ids: up to and including the first EOS.

    generated (N, T) -> (mask (N, T) long, truncated (N,) bool). Tokens after the first EOS
    (padding, which may itself be an EOS id) are 0; a row without EOS is all 1 and truncated.
    """
    is_eos = torch.isin(generated, torch.tensor(list(eos_ids), device=generated.device))  # (N, T)
    seen_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS count strictly before t
    mask = (seen_before == 0).long()  # (N, T)
    truncated = ~is_eos.any(dim=1)  # (N,)
    return mask, truncated


def transcript_text(tokenizer, ids: torch.Tensor, policy_mask: torch.Tensor | None,
                    ) -> tuple[str, list[tuple[int, int]]]:
    """A completion's text (special tokens skipped) and the [start, end) character spans of its tool turns:
    ids (L,), policy_mask (L,) bool, False on the tool turns' tokens (None: none). Each run of the policy's or
    a tool turn's tokens is decoded alone and the texts joined, so the spans are exact. An engine with tools
    fills Completion.text and tool_turn_spans with it."""
    if policy_mask is None or bool(policy_mask.all()):
        return tokenizer.decode(ids, skip_special_tokens=True), []
    starts = [0, *((policy_mask[1:] != policy_mask[:-1]).nonzero().flatten() + 1).tolist(), len(ids)]
    text, spans = "", []
    for start, end in zip(starts, starts[1:]):
        piece = tokenizer.decode(ids[start:end], skip_special_tokens=True)
        if not bool(policy_mask[start]):
            spans.append((len(text), len(text) + len(piece)))
        text += piece
    return text, spans


def policy_part(text: str, spans: Sequence[Sequence[int]]) -> str:
    """`text` less its tool turns' [start, end) spans (Completion.tool_turn_spans, in order)."""
    pieces, cursor = [], 0
    for start, end in spans:
        pieces.append(text[cursor:start])
        cursor = end
    return "".join(pieces) + text[cursor:]


def decoded_completions(prompts: Sequence[torch.Tensor], decoded: Decoded, eos_ids, tokenizer) -> list[Completion]:
    """A decoder's N rows (row i continues prompts[i]) -> Completions."""
    if decoded.lengths is None:
        mask, truncated = completion_mask(decoded.ids, eos_ids)
        lengths = mask.sum(dim=1).tolist()
    else:  # a transcript with tool turns holds EOS ids before its end
        lengths, truncated = decoded.lengths.tolist(), decoded.truncated
    valid = [decoded.ids[row, :length] for row, length in enumerate(lengths)]
    kept, policy = decoded.kept_log_mass, decoded.policy_mask
    if policy is None:
        texts = [(text, []) for text in tokenizer.batch_decode(valid, skip_special_tokens=True)]
    else:
        texts = [transcript_text(tokenizer, ids, policy[row, : lengths[row]]) for row, ids in enumerate(valid)]
    return [
        Completion(
            prompt_ids=prompts[row], completion_ids=ids, truncated=bool(truncated[row]), text=texts[row][0],
            behaviour_logprobs=decoded.behaviour_logprobs[row, : lengths[row]].clone(),
            kept_log_mass=None if kept is None else kept[row, : lengths[row]].clone(),
            policy_mask=None if policy is None else policy[row, : lengths[row]].clone(),
            tool_calls=[] if decoded.tool_calls is None else decoded.tool_calls[row],
            over_calls=decoded.over_calls is not None and bool(decoded.over_calls[row]), tool_turn_spans=texts[row][1],
        )
        for row, ids in enumerate(valid)
    ]


Decode = Callable[[torch.nn.Module, list[torch.Tensor], int, SamplingSettings, list[int], int], Decoded]


def sample_completions(
    model, tokenizer, prompts: Sequence[Sequence[int]], settings: SamplingSettings, *,
    batch_size: int | GenerationRows, group_size: int = 1, decode: Decode = decode_loop,
    seeds: Sequence[int] | None = None,
) -> list[Completion]:
    """group_size completions of each prompt, prompt-major (prompt 0's first), sampled from `model` as
    it is: evaluation samples the training model so; an engine passes its rollout model and decoder.

    decode(model, prompts (B,), group_size, settings, eos_ids, pad_id) -> Decoded (B*G rows) runs on whole
    groups of at most batch_size rows. seeds: one per row (prompt-major), passed on to decode for its
    chunk's rows (keyed draws). The model is in eval mode
    meanwhile: training mode would turn the KV cache off under gradient checkpointing. batch_size: the most
    rows of one call, or an engine's GenerationRows, which a call out of memory halves (fitting.py: the same
    rows redone in smaller calls, the same completions)."""
    eos_ids, pad_id = eos_token_ids(model, tokenizer), pad_token_id(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        rows = batch_size if isinstance(batch_size, GenerationRows) else GenerationRows(batch_size)
        tensors = [torch.as_tensor(list(p), dtype=torch.long) for p in prompts]
        completions: list[Completion] = []
        while len(completions) < len(tensors) * group_size:  # calls of whole groups within rows.limit
            start = len(completions) // group_size
            chunk = tensors[start : start + max(1, rows.limit // group_size)]
            chunk_seeds = None if seeds is None else seeds[start * group_size : (start + len(chunk)) * group_size]
            for part, decoded in decode_fitting(decode, model, chunk, group_size, settings, eos_ids, pad_id,
                                                chunk_seeds, rows):
                completions += decoded_completions(group_rows(part, group_size), decoded, eos_ids, tokenizer)
        return completions
    finally:
        model.train(was_training)


def group_rows(prompts: list[torch.Tensor], group_size: int) -> list[torch.Tensor]:
    """Each prompt group_size times, in order: the rows of a chunk."""
    return [prompt for prompt in prompts for _ in range(group_size)]


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
