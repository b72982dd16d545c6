"""How far each rollout path samples from the training forward, on a random model of Qwen2.5-1.5B's shape.

    python scripts/bench/bench_mismatch.py                          # CUDA: Qwen2.5-1.5B shape
    python scripts/bench/bench_mismatch.py --shape small --new-tokens 16   # a CPU-sized check of the script

For each rollout variant it samples G completions of a few prompts of the shipped task (temperature
0.9, as configs/qwen1.5b-seed.yaml), scores them with the training forward (float32 master weights, full
softmax; under bf16 autocast on CUDA, as the trainer's train.mixed_precision auto does) and prints one
JSON line with the mismatch figures a run logs every step (rollout_kl, rollout_logprob_diff_mean / _max,
rollout_is_weight_mean, rollout_is_clipped_frac at dapo.rollout_correction_cap 2: the numeric gap,
both untruncated; rollout_kl_truncation: what top-k cut, apart). Variants: the float32
decode loop (the training forward itself: rounding only), the bf16 copy, the bf16 copy with the
compiled static cache (rollout.compile; uncompiled without CUDA), the same with top-k 50 (the CUDA
default of configs/qwen1.5b-seed.yaml), and top-k 50 alone.

Random weights give near-uniform logits over 151,936 tokens, so top-k 50 removes almost all of the
mass: its truncation figure is an extreme, not Qwen's. The dtype and cache figures are the numerics of
the shape.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (rollout.engine, rollout.dtype, rollout.compile, rollout.top_k)
VARIANTS = {
    "float32 decode loop": ("hf", "float32", "off", 0),
    "bf16 copy": ("hf", "bfloat16", "off", 0),
    "bf16 copy, static cache": ("hf", "bfloat16", "on", 0),
    "bf16 copy, static cache, top-k 50": ("hf", "bfloat16", "on", 50),
    "float32 decode loop, top-k 50": ("hf", "float32", "off", 50),
}


def mismatch(model, completions, temperature: float, autocast: bool) -> dict:
    """The trainer's rollout_* figures of `completions` against the training forward of `model`."""
    from dapo_train.algo.correction import RolloutCorrection, rollout_mismatch
    from dapo_train.model.scoring import score_tokens
    from dapo_train.train.update.batching import TrainSample, collate_micro_batch
    from dapo_train.train.update.passes import ROLLOUT_MEANS

    device = next(model.parameters()).device
    samples = [TrainSample(c.prompt_ids, c.completion_ids, 0.0, True, behaviour_logprobs=c.untruncated_logprobs)
               for c in completions]
    micro = collate_micro_batch(samples, pad_id=0, device=device)
    scope = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), scope:
        training, _ = score_tokens(model, micro.batch, temperature=temperature, chunk_mib=64.0)
    sums, largest = rollout_mismatch(training, micro.behaviour_logprobs, micro.behaviour_mask,
                                     RolloutCorrection("tis", 2.0))
    tokens = float(sums["tokens"])
    out = {name: float(sums[key]) / tokens for key, name in ROLLOUT_MEANS.items()}
    cut = sum(0.0 if c.kept_log_mass is None else -float(c.kept_log_mass.sum()) for c in completions)
    return {**out, "rollout_logprob_diff_max": float(largest), "rollout_tokens": tokens,
            "rollout_kl_truncation": cut / tokens}


def main() -> None:
    from bench_step import SHAPES, random_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()

    from dapo_train.config.load import load_config
    from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
    from dapo_train.task.prompts import load_prompts

    cuda = torch.cuda.is_available()
    model, tokenizer = random_model(args.shape, torch.device("cuda" if cuda else "cpu"))
    prompts, _ = load_prompts(load_config(None, []).data, tokenizer, "train")
    prompt_ids = [p.input_ids for p in prompts[: args.prompts]]
    for name, (engine_name, dtype, compile, top_k) in VARIANTS.items():
        engine = engine_factory(engine_name)(EngineSetup(model, tokenizer, 256, dtype=dtype, compile=compile))
        settings = SamplingSettings(args.new_tokens, temperature=0.9, top_k=top_k)
        torch.manual_seed(1)
        completions = engine.generate(prompt_ids, settings, args.group_size)
        figures = mismatch(model, completions, settings.temperature, autocast=cuda)
        print(json.dumps({"variant": name, "shape": args.shape, "device": "cuda" if cuda else "cpu",
                          **{k: float(f"{v:.4g}") for k, v in figures.items()}}), flush=True)


if __name__ == "__main__":
    main()
