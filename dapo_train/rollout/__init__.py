"""Rollout: prompts x G -> sampled completions (ids, exact masks, truncation, behaviour log-probs),
behind one engine interface. Below the training loop: nothing here imports train/.

engines.py   the RolloutEngine interface, the engine registry and the built-in transformers engines
decoding.py  token-level decoding: the decode loop, sampling, the behaviour distribution
tool_rows.py the decode loop's rows with tools: the tool turns fed in as forced tokens, the policy mask

Another engine (vLLM, SGLang, a server) is one module that imports from here:
`from dapo_train.rollout import Completion, EngineSetup, SamplingSettings, register_engine`.
"""

from dapo_train.rollout.decoding import SamplingSettings
from dapo_train.rollout.engines import (
    ROLLOUT_ENGINES,
    Completion,
    DecodeLoopEngine,
    EngineSetup,
    GenerateEngine,
    RolloutEngine,
    StaticCacheEngine,
    TransformersEngine,
    build_engine,
    completion_mask,
    engine_factory,
    eos_token_ids,
    pad_token_id,
    register_engine,
    sample_completions,
)

__all__ = [
    "ROLLOUT_ENGINES", "Completion", "DecodeLoopEngine", "EngineSetup", "GenerateEngine", "RolloutEngine",
    "SamplingSettings", "StaticCacheEngine", "TransformersEngine", "build_engine", "completion_mask", "engine_factory",
    "eos_token_ids", "pad_token_id", "register_engine", "sample_completions",
]
