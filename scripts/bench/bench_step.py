"""Benchmark trainer steps on a random-init model of Qwen2.5-1.5B-Instruct's dimensions.

    python scripts/bench/bench_step.py                    # CUDA: Qwen2.5-1.5B shape, 3 steps
    python scripts/bench/bench_step.py --shape small      # a scaled-down shape that runs on a CPU
    python scripts/bench/bench_step.py --config configs/tiny-cpu.yaml --steps 10   # a config as it is
    python scripts/bench/bench_step.py --set rollout.compile=off   # one speed lever off, for a before/after

A random model never emits EOS, so every completion runs to max_new_tokens: the worst case for
time and memory. Prints per-step seconds by phase (generate / score / old log-probs / update),
then a summary: completions and tokens per second, the update's forward positions (and the share
that is padding) and LM-head positions per trained token, and peak memory (CUDA max allocated, CPU
peak RSS). Needs no download: the shipped tiny tokenizer supplies ids (the model's vocabulary is
Qwen's 151,936 rows regardless).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {
    # Qwen2.5-1.5B-Instruct's config.json dimensions.
    "qwen1.5b": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    # preflight's vllm rehearsal model widened to a real head size (2 heads of 64; vLLM's CPU attention takes
    # 32 and up) at Qwen's vocabulary: bench_vllm.py's CPU stand-in
    "rehearsal": {
        "vocab_size": 151936,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
    "small": {
        "vocab_size": 151936,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
}


def build_model(shape: str, folder: Path) -> None:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from dapo_train.task.locations import TINY_MODEL_DIR

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    config = Qwen2Config(**SHAPES[shape], eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def model_folder(shape: str, scratch: Path) -> Path:
    """The random model of `shape` as a folder: built in `scratch`, or built once in $DAPO_BENCH_MODEL_CACHE
    and read there by every later process (bench_cuda.sh sets it: the Qwen shape is 6 GB to write and the
    same seed builds the same weights). A build is renamed into the cache whole, so a killed one leaves none."""
    cache = os.environ.get("DAPO_BENCH_MODEL_CACHE")
    if not cache:
        build_model(shape, scratch / "model")
        return scratch / "model"
    folder = Path(cache) / shape
    if not (folder / "config.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=f".{shape}-", dir=cache))
        build_model(shape, staging)
        staging.rename(folder)
    return folder


def random_model(shape: str, device: torch.device):
    """A random model of `shape` (float32, eval mode) on `device` and the shipped tiny tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(shape, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    parser.add_argument("--config", type=Path, help="a config file to run instead of a random shape")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra settings, e.g. rollout.compile=off train.shared_prefix=off (one lever off)")
    args = parser.parse_args()

    from dapo_train.config.load import load_config
    from dapo_train.run.logs import read_metrics
    from dapo_train.train.loop import train
    from dapo_train.train.summary import update_work

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"output_dir={Path(tmp) / 'run'}",
            f"train.max_steps={args.steps}",
            "dapo.dynamic_sampling=false",
            "eval.every_steps=0",
            "logging.progress_bar=false",
        ]
        if args.config is None:
            start = time.perf_counter()
            folder = model_folder(args.shape, Path(tmp))
            print(f"random {args.shape} model ready in {time.perf_counter() - start:.1f}s")
            overrides += [
                f"model.name_or_path={folder}",
                f"train.prompts_per_step={args.prompts_per_step}",
                f"rollout.group_size={args.group_size}",
                f"train.micro_batch_size={args.micro_batch_size}",
                f"rollout.max_new_tokens={args.max_new_tokens}",
                "rollout.temperature=0.9",
                "rollout.top_k=50",
                "rewards=[{name: accuracy}]",
                "train.learning_rate=1e-6",
                "train.updates_per_step=1",
            ]
        cfg = load_config(args.config, overrides + args.set)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        train(cfg)
        rows = [row for row in read_metrics(cfg.output_dir) if "seconds_step" in row]
    keys = (
        "seconds_step",
        "seconds_generate",
        "seconds_score",
        "seconds_old_logprobs",
        "seconds_update",
        "generated_tokens",
        "tokens_per_second",
        "completion_length_mean",
        "micro_batches",
        "update_forward_tokens",
        "update_padding_tokens",
        "update_head_tokens",
        "update_trained_tokens",
        "update_forward_per_token",
        "update_head_per_token",
    )
    for row in rows:
        print(json.dumps({"step": row["step"], **{k: round(row[k], 3) for k in keys if row.get(k) is not None}}))
    steady = rows[1:] or rows
    completions = cfg.train.prompts_per_step * cfg.rollout.group_size

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steady) / len(steady)

    work = update_work(steady) or dict.fromkeys(("forward_per_token", "padding_frac", "head_per_token"))

    summary = {
        "model": args.shape if args.config is None else str(args.config),
        "settings": args.set,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "completions_per_s": completions / mean("seconds_step"),
        "tokens_per_s": mean("tokens_per_second"),
        "mean_step_s": mean("seconds_step"),
        "generate_s": mean("seconds_generate"),
        "old_logprobs_s": mean("seconds_old_logprobs"),
        "update_s": mean("seconds_update"),
        # The update's work over the steps measured: positions computed and scored per trained token.
        **{key: work[key] for key in ("forward_per_token", "padding_frac", "head_per_token")},
        "peak_cuda_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
