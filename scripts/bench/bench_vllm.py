"""The hf rollout engine against rollout.engine=vllm at equal work: the same prompts (the same token ids), G,
budget, stop ids, sampling (temperature 1, no truncation) and torch threads; repeats interleaved (hf, vllm,
vllm, hf, ...), so a machine's load drifts over both alike. Prints one JSON line per engine and repeat, then
a summary: each engine's median seconds and tokens/s, and the paired ratio vllm / hf of seconds per generated
token, median with its min-max over the repeats, in wall time and in the process's CPU time (which other jobs on
a shared machine do not inflate; both engines run one thread, so the two agree on a quiet machine).

    python scripts/bench/bench_vllm.py --shape tiny                   # the shipped model, the demo's batch
    python scripts/bench/bench_vllm.py --shape rehearsal --new-tokens 64   # Qwen's vocabulary, head_dim 64
    python scripts/bench/bench_vllm.py --shape qwen1.5b                # CUDA: Qwen2.5-1.5B's shape (bench_cuda.sh)

Shapes: tiny (builtin:tiny and the shipped task's train prompts), or a random model of bench_step.py's
SHAPES (rehearsal: 2 layers of width 128 at Qwen's 151,936-token vocabulary, 2 heads of 64, the smallest
stand-in vLLM's CPU attention runs at a real head size) with the tiny tokenizer and the same prompts. A
random model seldom writes an EOS, so its rows run to the budget. Needs vllm (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load(shape: str, device: torch.device, scratch: Path):
    """(model, tokenizer) of `shape`, the model loaded from a folder (the vllm engine starts from one)."""
    from bench_step import model_folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if shape == "tiny":
        from dapo_train.task.locations import TINY_MODEL_DIR

        folder = TINY_MODEL_DIR
    else:
        folder = model_folder(shape, scratch)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def timed(engine, prompts, settings, group_size: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the process: more than the wall time when it ran on several threads,
    tokens generated) of one generate call."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    completions = engine.generate(prompts, settings, group_size)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, sum(c.length for c in completions)


def main() -> None:
    from bench_step import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["tiny", *sorted(SHAPES)], default="tiny")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from dapo_train.config.load import load_config
    from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
    from dapo_train.task.prompts import load_prompts

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scratch = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model, tokenizer = load(args.shape, device, scratch)
    cfg = load_config(None, [])
    prompts = [p.input_ids for p in load_prompts(cfg.data, tokenizer, cfg.data.train_split)[0][: args.prompts]]
    longest = max(len(p) for p in prompts) + args.new_tokens
    rows = len(prompts) * args.group_size
    engines = {"hf": engine_factory("hf")(EngineSetup(model, tokenizer, rows, "auto", "auto"))}
    start = time.perf_counter()
    engines["vllm"] = engine_factory("vllm")(EngineSetup(model, tokenizer, rows, "auto", "auto", max_length=longest))
    started = time.perf_counter() - start
    settings = SamplingSettings(args.new_tokens, temperature=1.0)
    for engine in engines.values():  # a first call of each, untimed: one-off set-up is not decode speed
        engine.generate(prompts, settings, args.group_size)
    runs = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name in (["hf", "vllm"] if repeat % 2 == 0 else ["vllm", "hf"]):
            seconds, cpu, tokens = timed(engines[name], prompts, settings, args.group_size)
            runs[name].append((seconds, cpu, tokens))
            print(json.dumps({"engine": name, "shape": args.shape, "repeat": repeat, "rows": rows,
                              "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3), "tokens": tokens,
                              "tokens_per_s": round(tokens / seconds, 1)}), flush=True)
    per_token = {name: [s / t for s, _, t in values] for name, values in runs.items()}
    ratios = sorted(v / h for v, h in zip(per_token["vllm"], per_token["hf"]))
    cpu_ratios = sorted((v[1] / v[2]) / (h[1] / h[2]) for v, h in zip(runs["vllm"], runs["hf"]))
    print(json.dumps({
        "summary": args.shape, "device": device.type, "threads": args.threads, "rows": rows,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "vllm_start_s": round(started, 1),
        **{f"{name}_median_s": round(statistics.median(s for s, _, _ in values), 3) for name, values in runs.items()},
        **{f"{name}_tokens_per_s": round(1 / statistics.median(per_token[name]), 1) for name in runs},
        "vllm_over_hf_seconds_per_token": round(statistics.median(ratios), 3),
        "ratio_min_max": [round(ratios[0], 3), round(ratios[-1], 3)],
        "vllm_over_hf_cpu_seconds_per_token": round(statistics.median(cpu_ratios), 3),  # the load's share left out
        "cpu_ratio_min_max": [round(cpu_ratios[0], 3), round(cpu_ratios[-1], 3)],
    }), flush=True)


if __name__ == "__main__":
    main()
