"""dapo-train against TRL's GRPOTrainer(loss_type="dapo") at equal work, side by side.

    pip install -e '.[bench]'                     # TRL
    python scripts/bench_vs_trl.py                # CPU: the shipped tiny model, 5 interleaved repeats
    python scripts/bench_vs_trl.py --shape qwen1.5b --max-new-tokens 128 --prompts 16 --micro-batch 32  # CUDA

Equal work: both sides get the same prompts in the same order as the same token ids (checked
before timing), G completions each, the same stop ids (generation_config's EOS ids plus the
tokenizer's), the same sampling (temperature 1, no top-p/top-k, no repetition penalty), one
optimizer step per rollout batch over micro-batches of the same size, no KL term, no reference
model, no old-log-prob pass, the same reward function, the same threads; dapo-train's dynamic
sampling is off (TRL has none), so both train every generated completion. On CUDA both use
float32 master weights, bf16 autocast and gradient checkpointing (dapo-train's defaults there).

Each side runs in its own process, the sides alternating (and swapping which goes first) for
--repeats rounds; a run's throughput is completions per second over steps 2..--steps (step 1 pays
for warm-up). Prints each run, then the medians and, last, the paired ratio line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent


def fixed_prompts(args) -> list:
    """The first steps x prompts training prompts of the tiny task, in file order."""
    from dapo_train.config.load import load_config
    from dapo_train.model.loading import load_tokenizer
    from dapo_train.task.prompts import load_prompts

    cfg = load_config(None, [])
    prompts, _ = load_prompts(cfg.data, load_tokenizer(cfg.model), cfg.data.train_split)
    need = args.steps * args.prompts
    if len(prompts) < need:
        raise SystemExit(f"the task has {len(prompts)} training prompts; {need} needed")
    return prompts[:need]


class FixedOrder:
    """A PromptSampler stand-in: the prompts in the given order, n at a time."""

    def __init__(self, prompts: list) -> None:
        self.prompts, self.position = prompts, 0

    def next_batch(self, n: int) -> list:
        batch = self.prompts[self.position : self.position + n]
        self.position += n
        return batch


def run_ours(args, model_path: str) -> dict:
    from dapo_train.config.load import load_config
    from dapo_train.train.loop import train_step
    from dapo_train.train.session import setup

    cfg = load_config(None, [
        f"model.name_or_path={model_path}", f"output_dir={tempfile.mkdtemp()}", f"seed={args.seed}",
        f"train.max_steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"train.micro_batch_size={args.micro_batch}",
        "train.updates_per_step=1", "dapo.dynamic_sampling=false", "rewards=[{name: accuracy}]", "eval.every_steps=0",
        f"train.learning_rate={args.lr}", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        f"train.num_threads={args.threads}", "logging.progress_bar=false", *args.ours,
    ])
    run = setup(cfg, Path(cfg.output_dir), None)
    run.prompt_sampler = FixedOrder(fixed_prompts(args))
    marks, tokens = [], []
    for _ in range(args.steps):
        metrics = train_step(run)
        _sync()
        marks.append(time.perf_counter())
        tokens.append(metrics["generated_tokens"])
    return _result("dapo-train", args, marks, tokens)


def run_trl(args, model_path: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo_train.config.load import load_config
    from dapo_train.rewards import rewards_from_config, score

    torch.set_num_threads(args.threads)
    prompts = fixed_prompts(args)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    for prompt in prompts:  # the same token ids on both sides, or no comparison
        if tokenizer(prompt.text)["input_ids"] != list(prompt.input_ids):
            raise SystemExit(f"TRL would tokenize prompt {prompt.uid} differently; no equal-work comparison")
    reward_set = rewards_from_config(load_config(None, ["rewards=[{name: accuracy}]"]))

    def accuracy(prompts, completions, gold, completion_ids, **_):
        return score(reward_set, completions, gold, lengths=[len(c) for c in completion_ids]).total

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            _sync()
            marks.append(time.perf_counter())

    cuda = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.group_size // args.micro_batch, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        loss_type="dapo", beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, learning_rate=args.lr,
        shuffle_dataset=False, seed=args.seed, logging_steps=10**6, save_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=cuda, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    dataset = Dataset.from_list([{"prompt": p.text, "gold": p.gold} for p in prompts])
    trainer = GRPOTrainer(model=model_path, reward_funcs=accuracy, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    return _result("TRL", args, marks, None)  # TRL logs no per-step token count; completions/s compares


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _result(side: str, args, marks: list[float], tokens: list[float] | None) -> dict:
    if len(marks) < 3:
        raise SystemExit(f"{side}: only {len(marks)} steps timed")
    seconds = marks[-1] - marks[0]  # steps 2..N
    completions = (len(marks) - 1) * args.prompts * args.group_size
    out = {"side": side, "completions_per_s": completions / seconds, "seconds_per_step": seconds / (len(marks) - 1)}
    if tokens is not None:
        out["tokens_per_s"] = sum(tokens[1:]) / seconds
    if torch.cuda.is_available():
        out["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def child(args) -> None:
    model_path = args.model_path
    result = run_ours(args, model_path) if args.side == "ours" else run_trl(args, model_path)
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="tiny (the shipped model) or a bench_step.py shape")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward, both sides")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours", nargs="*", default=[], help="extra KEY=VALUE settings for dapo-train's side")
    parser.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    if (args.prompts * args.group_size) % args.micro_batch:
        raise SystemExit("--micro-batch must divide prompts x group size (TRL accumulates whole micro-batches)")
    with tempfile.TemporaryDirectory() as tmp:
        if args.shape == "tiny":
            from dapo_train.task.locations import TINY_MODEL_DIR

            model_path = str(TINY_MODEL_DIR)
        else:
            sys.path.insert(0, str(SCRIPTS))
            from bench_step import build_model

            model_path = str(Path(tmp) / "model")
            build_model(args.shape, Path(model_path))
        runs: dict[str, list[dict]] = {"ours": [], "trl": []}
        for repeat in range(args.repeats):
            order = ("ours", "trl") if repeat % 2 == 0 else ("trl", "ours")
            for side in order:
                command = [sys.executable, __file__, "--side", side, "--model-path", model_path,
                           *sys.argv[1:]]
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                    raise SystemExit(f"{side} run failed (exit {done.returncode})")
                result = json.loads(lines[-1][len("RESULT "):])
                runs[side].append(result)
                print(f"repeat {repeat + 1} {result['side']:>10}: {json.dumps(result)}", flush=True)
    ours = [r["completions_per_s"] for r in runs["ours"]]
    trl = [r["completions_per_s"] for r in runs["trl"]]
    ratios = [a / b for a, b in zip(ours, trl)]
    for side, values in (("dapo-train", runs["ours"]), ("TRL", runs["trl"])):
        print(f"{side}: median {statistics.median(r['seconds_per_step'] for r in values):.3f} s/step, "
              f"{statistics.median(r['completions_per_s'] for r in values):.1f} completions/s")
    print(f"ratio dapo-train/TRL completions/s: {statistics.median(ratios):.2f} "
          f"({statistics.median(ours):.1f}/s vs {statistics.median(trl):.1f}/s, median of {len(ratios)}, "
          f"paired ratios {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
