"""Time per decode step: the rollout engine against `model.generate` alone, same model and batch.

    python scripts/bench/bench_decode.py                          # CUDA: Qwen2.5-1.5B shape, batch 8 and 128
    python scripts/bench/bench_decode.py --shape small --batch 8  # a CPU-sized check of the script itself

A random model of a bench_step.py shape (float32 master weights; the engine samples from its
bf16 copy on CUDA, and so do the generate variants) decodes --new-tokens tokens after random
prompts of --prompt-tokens tokens; a random model over Qwen's vocabulary practically never emits
EOS, so every row runs the whole budget. The time per decode step is (time for N tokens - time for 1
token) / (N - 1), the prefill cancelled out; the median of --repeats runs after a warm-up (which
also pays for any compilation). Rows of the engine are `batch` different prompts (group size 1)
so that both sides decode the same rows. Variants:

- generate: plain `model.generate` (dynamic cache);
- generate-static: `model.generate(cache_implementation="static")` (transformers compiles its decode
  step on CUDA): the bar the issue sets, "within 10%";
- engine: dapo-train's `hf` engine with rollout.compile=auto (compiled static cache on CUDA, the
  decode loop on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    from bench_step import SHAPES, random_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    parser.add_argument("--batch", type=int, nargs="*", default=[8, 128])
    parser.add_argument("--prompt-tokens", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from dapo_train.rollout import SamplingSettings, build_engine, sample_completions
    from dapo_train.rollout.decoding import generate_rows

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model, tokenizer = random_model(args.shape, device)
    engine = build_engine(_rollout_cfg(), model, tokenizer)
    sampler = engine.rollout_model  # the weights the engine decodes with (bf16 copy on CUDA)
    g = torch.Generator().manual_seed(0)
    low = max(model.generation_config.eos_token_id) + 1

    def through_generate(prompts, settings, **generate_kwargs):
        """One model.generate call on all rows (no bucketing), through the engine's records."""
        def decode(model, chunk, group_size, settings, eos_ids, pad_id):
            return generate_rows(model, chunk, settings, eos_ids, pad_id, **generate_kwargs)
        return sample_completions(sampler, tokenizer, prompts, settings, batch_size=len(prompts), decode=decode)

    def variants(prompts, budget):
        settings = SamplingSettings(max_new_tokens=budget)
        return {
            "generate": lambda: through_generate(prompts, settings),
            "generate-static": lambda: through_generate(prompts, settings, cache_implementation="static"),
            "engine": lambda: engine.generate(prompts, settings, group_size=1),
        }

    results = []
    for batch in args.batch:
        prompts = [torch.randint(low, model.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
                   for _ in range(batch)]
        for name in variants(prompts, 1):
            times = {}
            for budget in (1, args.new_tokens):
                call = variants(prompts, budget)[name]
                call()  # warm-up (and compilation)
                runs = []
                for _ in range(args.repeats):
                    _sync()
                    start = time.perf_counter()
                    call()
                    _sync()
                    runs.append(time.perf_counter() - start)
                times[budget] = statistics.median(runs)
            per_step = (times[args.new_tokens] - times[1]) / (args.new_tokens - 1)
            row = {"shape": args.shape, "batch": batch, "variant": name, "ms_per_decode_step": 1000 * per_step,
                   "seconds_total": times[args.new_tokens], "device": str(device)}
            results.append(row)
            print(json.dumps(row), flush=True)
    for batch in args.batch:
        by_name = {r["variant"]: r["ms_per_decode_step"] for r in results if r["batch"] == batch}
        print(f"batch {batch}: engine {by_name['engine']:.2f} ms/step vs generate-static "
              f"{by_name['generate-static']:.2f} ({by_name['engine'] / by_name['generate-static']:.2f}x), "
              f"plain generate {by_name['generate']:.2f}")


def _rollout_cfg():
    from dapo_train.config.schema import RolloutConfig

    return RolloutConfig()


if __name__ == "__main__":
    main()
