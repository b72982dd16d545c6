"""Rollout: prompts x G -> sampled completions (ids, exact masks, truncation, behaviour log-probs),
behind one engine interface. Below the training loop: nothing here imports train/.

engines.py     the RolloutEngine interface, the engine registry, what evals decode through
completions.py the Completion record every engine returns, built from decoded rows, and sample_completions
hf_engines.py  the built-in transformers engines (hf, hf-generate), registered on import
vllm_engine.py the vllm engine, registered on import (vllm itself is imported when it is built)
vllm_processor.py  its logits processor (the kept mass), imported with vllm
decoding.py    token-level decoding: the decode loop, and model.generate with the behaviour recorded
fitting.py     a generate call out of memory, redone in halves with the same draws
compiled.py    compiled decoding's run-time needs (a C compiler), its failures, the eager fallback
sampling.py    the sampling distribution every engine records (the behaviour distribution), the token draw
tool_rows.py   the decode loop's rows with tools: the tool turns fed in as forced tokens, the policy mask

Another engine (vLLM, SGLang, a server) is one module that imports from here:
`from dapo_train.rollout import Completion, EngineSetup, SamplingSettings, register_engine`.
"""

from dapo_train.rollout.completions import Completion, completion_mask, eos_token_ids, pad_token_id, sample_completions
from dapo_train.rollout.engines import (
    ROLLOUT_ENGINES,
    EngineSetup,
    RolloutEngine,
    build_engine,
    engine_factory,
    register_engine,
)
from dapo_train.rollout.hf_engines import DecodeLoopEngine, GenerateEngine, StaticCacheEngine, TransformersEngine
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.rollout.vllm_engine import VllmEngine

__all__ = [
    "ROLLOUT_ENGINES", "Completion", "DecodeLoopEngine", "EngineSetup", "GenerateEngine", "RolloutEngine",
    "SamplingSettings", "StaticCacheEngine", "TransformersEngine", "VllmEngine", "build_engine", "completion_mask",
    "engine_factory", "eos_token_ids", "pad_token_id", "register_engine", "sample_completions",
]
