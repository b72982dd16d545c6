"""dapo-train against TRL's GRPOTrainer(loss_type="dapo") at equal work, side by side.

    pip install -e '.[bench]'                     # TRL
    python scripts/bench/bench_vs_trl.py                # CPU: the shipped tiny model, 5 interleaved repeats
    python scripts/bench/bench_vs_trl.py --shape rehearsal --prompts 2 --group-size 4 --max-new-tokens 32 \\
        --micro-batch 4 --steps 4 --repeats 5 [--trl-compact]   # CPU, Qwen2.5's vocabulary: 4-7 minutes
    python scripts/bench/bench_vs_trl.py --shape qwen1.5b --max-new-tokens 128 --prompts 16 --micro-batch 32  # CUDA

Shapes: `tiny` is the shipped model on the shipped task. `rehearsal` is preflight's stand-in for
Qwen2.5-1.5B-Instruct (dapo_train.preflight.rehearsal.build_model: 2 layers of width 32 with the real
151,936-row tied embedding, Qwen's generation config with its two EOS ids, random weights biased so
each EOS id has probability 0.02 per token under the bench's sampling) with scripts/build/qwen_offline.py's
offline Qwen2.5 tokenizer, on the chat-templated questions of its GSM8K-zh stand-in (real prompt
lengths): there the LM head and the scoring of 151,936 rows are most of the work. Any other name is a
random scripts/bench/bench_step.py shape with the tiny tokenizer. The model is built once, in a temporary
folder both sides load.

Equal work: both sides get the same prompts in the same order as the same token ids (checked
before timing), G completions each, the same stop ids (generation_config's EOS ids plus the
tokenizer's; checked on TRL's side), the same sampling (temperature 1, no top-p/top-k, no repetition
penalty, none of the model's generation_config fields leaking in: checked), one optimizer step per
rollout batch over micro-batches of the same size, no KL term, no reference model, no old-log-prob
pass, the same reward function, the same threads; dapo-train's dynamic sampling is off (TRL has
none), so both train every generated completion. On CUDA both use float32 master weights, bf16
autocast and gradient checkpointing (dapo-train's defaults there).

One thing is not equal on a CPU: TRL's fused LM head, always on, computes logits at every position of
every row (the prompt's too, masked afterwards) where Triton is missing, and at the completion
positions only where it runs (CUDA). --trl-compact patches that one choice so TRL scores as it does on
CUDA; without it the bench measures TRL as a CPU user gets it.

Each side runs in its own process, the sides alternating (and swapping which goes first) for
--repeats rounds, repeat r sampling with seed --seed + r on both sides (so neither side keeps one
lucky draw of completion lengths); a run's throughput is completions (and generated tokens, EOS
included) per second over steps 2..--steps (step 1 pays for warm-up), its memory the process's peak
resident set (ru_maxrss); dapo-train's runs also report its update's work (forward positions, the
share that is padding, and LM-head positions, per trained token: update_* in metrics.jsonl). Prints
each run, then the medians and, last, the paired ratio line.

--ours-b KEY=VALUE... adds a second dapo-train side, "dapo-train[b]": --ours plus these settings, run in
every repeat beside the other two (the order rotating), so that two settings of this project, e.g. its
micro-batch layouts, are paired in the same run and under the same load:

    python scripts/bench/bench_vs_trl.py --ours train.micro_batch_tokens=2048 --ours-b train.micro_batch_tokens=0
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # scripts/bench/
ROOT = HERE.parents[1]
GSM8K = ROOT / "data" / "gsm8k" / "test.jsonl"  # shipped in the repository
# The prompt columns of the GSM8K-zh stand-in, as configs/qwen1.5b.yaml reads them.
GSM8K_ZH_FIELDS = ("data.prompt_field=question_zh-cn", "data.answer_field=answer_only")
SAMPLING_CHECKED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "min_p": None}


def fixed_prompts(args) -> list:
    """The first steps x prompts training prompts of the task, in file order, through the model's tokenizer
    and chat template."""
    from dapo_train.config.load import load_config
    from dapo_train.model.loading import load_tokenizer
    from dapo_train.task.prompts import load_prompts

    cfg = load_config(None, [f"model.name_or_path={args.model_path}", *args.data])
    prompts, _ = load_prompts(cfg.data, load_tokenizer(cfg.model), cfg.data.train_split)
    need = args.steps * args.prompts
    if len(prompts) < need:
        raise SystemExit(f"the task has {len(prompts)} training prompts; {need} needed")
    return prompts[:need]


def fixed_order(prompts: list):
    """A PromptSampler that hands out the prompts in the given order (the identity permutation), with the
    sampler's state the trainer reads (prompts drawn so far)."""
    from dapo_train.task.prompts import PromptSampler

    class FixedOrder(PromptSampler):
        def _permutation(self, epoch: int) -> list[int]:
            return list(range(len(self.prompts)))

    return FixedOrder(prompts, seed=0)


def run_ours(args, label: str = "dapo-train", extra: tuple[str, ...] = ()) -> dict:
    from dapo_train.config.load import load_config
    from dapo_train.train.loop import train_step
    from dapo_train.train.session import setup
    from dapo_train.train.summary import update_work

    cfg = load_config(None, [
        f"model.name_or_path={args.model_path}", *args.data, f"output_dir={tempfile.mkdtemp()}", f"seed={args.seed}",
        f"train.max_steps={args.steps}", f"train.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"train.micro_batch_size={args.micro_batch}",
        "train.updates_per_step=1", "dapo.dynamic_sampling=false", "rewards=[{name: accuracy}]", "eval.every_steps=0",
        "eval.final_full=false", f"train.learning_rate={args.lr}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "rollout.top_k=0", f"train.num_threads={args.threads}", "logging.progress_bar=false", *args.ours, *extra,
    ])
    run = setup(cfg, Path(cfg.output_dir), None)
    run.prompt_sampler = fixed_order(fixed_prompts(args))
    marks, tokens, steps = [], [], []
    for _ in range(args.steps):
        metrics = train_step(run)
        _sync()
        marks.append(time.perf_counter())
        tokens.append(metrics["generated_tokens"])
        steps.append(metrics)
    work = update_work(steps[1:]) or {}
    return {**_result(label, args, marks, tokens),
            **{key: work[key] for key in ("forward_per_token", "padding_frac", "head_per_token") if key in work}}


def run_trl(args) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from dapo_train.config.load import load_config
    from dapo_train.rewards import rewards_from_config, score

    torch.set_num_threads(args.threads)
    if args.trl_compact:
        score_completions_only()
    prompts = fixed_prompts(args)
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    for prompt in prompts:  # the same token ids on both sides, or no comparison
        if tokenizer(prompt.text)["input_ids"] != list(prompt.input_ids):
            raise SystemExit(f"TRL would tokenize prompt {prompt.uid} differently; no equal-work comparison")
    reward_set = rewards_from_config(load_config(None, ["rewards=[{name: accuracy}]"]))
    tokens: list[int] = []  # generated tokens per rollout batch, EOS included (TRL logs none per step)
    last_ids: list[int] = []  # each completion's last token: which stop id ended it, if any

    def accuracy(prompts, completions, gold, completion_ids, **_):
        tokens.append(sum(len(c) for c in completion_ids))
        last_ids.extend(c[-1] for c in completion_ids if c)
        return score(reward_set, completions, gold, lengths=[len(c) for c in completion_ids]).total

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            _sync()
            marks.append(time.perf_counter())

    dataset = Dataset.from_list([{"prompt": p.text, "gold": p.gold} for p in prompts])
    trainer = GRPOTrainer(model=args.model_path, reward_funcs=accuracy, args=trl_config(args), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    stop_ids = check_trl_sampling(trainer, tokenizer)
    trainer.train()
    out = _result("TRL", args, marks, tokens)
    out["stops"] = {str(i): last_ids.count(i) for i in stop_ids}  # completions that ended at each stop id
    return out


def score_completions_only() -> None:
    """TRL's fused LM head scores only the completion positions, as it does where Triton runs (CUDA), instead of
    every position of every row (prompt too, masked afterwards) as its fallback does elsewhere. The choice is
    trl.trainer.utils._use_triton, which that module reads for nothing else; the tiles still fold in torch."""
    import trl.trainer.utils

    trl.trainer.utils._use_triton = lambda device: True


def trl_config(args):
    """GRPOConfig for the same work as dapo-train's side (module docstring)."""
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.prompts * args.group_size // args.micro_batch, num_generations=args.group_size,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
        loss_type="dapo", beta=0.0, num_iterations=1, epsilon=0.2, epsilon_high=0.28, learning_rate=args.lr,
        shuffle_dataset=False, seed=args.seed, logging_steps=10**6, save_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=cuda, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )


def check_trl_sampling(trainer, tokenizer) -> list[int]:
    """TRL stops at dapo-train's stop ids and samples as the bench says, after generate fills what TRL left
    unset from the model's generation_config (Qwen's ships temperature 0.7, top-k 20, a repetition
    penalty). -> the stop ids."""
    from dapo_train.rollout.completions import eos_token_ids

    ours = eos_token_ids(trainer.model, tokenizer)
    if sorted(trainer.eos_token_ids) != sorted(ours):
        raise SystemExit(f"TRL stops at {trainer.eos_token_ids}, dapo-train at {ours}; no equal-work comparison")
    merged, _ = trainer.model._prepare_generation_config(trainer.generation_config)
    effective = {name: getattr(merged, name) for name in SAMPLING_CHECKED}
    if effective != SAMPLING_CHECKED or sorted(merged.eos_token_id) != sorted(ours):
        raise SystemExit(f"TRL's generate would sample with {effective}, stop ids {merged.eos_token_id}; "
                         f"the bench needs {SAMPLING_CHECKED}, {ours}")
    return ours


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _result(side: str, args, marks: list[float], tokens: list[int]) -> dict:
    if len(marks) < 3:
        raise SystemExit(f"{side}: only {len(marks)} steps timed")
    seconds = marks[-1] - marks[0]  # steps 2..N
    completions = (len(marks) - 1) * args.prompts * args.group_size
    out = {"side": side, "seed": args.seed, "completions_per_s": completions / seconds,
           "seconds_per_step": seconds / (len(marks) - 1), "tokens_per_s": sum(tokens[1:]) / seconds,
           "mean_completion_tokens": sum(tokens[1:]) / completions,
           "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # Linux: KiB
    if torch.cuda.is_available():
        out["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def child(args) -> None:
    if args.side == "trl":
        result = run_trl(args)
    else:
        result = run_ours(args) if args.side == "ours" else run_ours(args, "dapo-train[b]", tuple(args.ours_b))
    print("RESULT " + json.dumps(result), flush=True)


def tiny_shape(args, folder: Path) -> tuple[str, list[str]]:
    """The shipped model on the shipped task (the config's defaults)."""
    from dapo_train.task.locations import TINY_MODEL_DIR

    return str(TINY_MODEL_DIR), []


def rehearsal_shape(args, folder: Path) -> tuple[str, list[str]]:
    """preflight's rehearsal model of Qwen2.5-1.5B-Instruct, biased to stop at its EOS ids under the bench's
    sampling, on the chat-templated questions of the GSM8K-zh stand-in."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from dapo_train.preflight.rehearsal import build_model
    from dapo_train.rollout.sampling import SamplingSettings

    sys.path.insert(0, str(ROOT / "scripts" / "build"))
    import qwen_offline

    qwen = qwen_offline.build_qwen_folder(folder / "qwen2.5-1.5b-instruct", "1.5b")
    data = qwen_offline.build_gsm8k_zh_folder(folder / "gsm8k_zh", args.gsm8k)
    sampling = SamplingSettings(args.max_new_tokens, True, temperature=1.0, top_p=1.0, top_k=0)
    build_model(AutoConfig.from_pretrained(qwen), GenerationConfig.from_pretrained(qwen),
                AutoTokenizer.from_pretrained(qwen), folder / "model", sampling, seed=args.seed)
    return str(folder / "model"), [f"data.path={data}", *GSM8K_ZH_FIELDS]


def random_shape(args, folder: Path) -> tuple[str, list[str]]:
    """A random scripts/bench/bench_step.py shape with the tiny tokenizer, on the shipped task."""
    sys.path.insert(0, str(HERE))
    from bench_step import build_model

    build_model(args.shape, folder / "model")
    return str(folder / "model"), []


SHAPES = {"tiny": tiny_shape, "rehearsal": rehearsal_shape}  # any other name: random_shape


def run_side(side: str, args, model_path: str, data: list[str], seed: int) -> dict:
    """One side's run in its own process -> its RESULT record."""
    command = [sys.executable, __file__, *sys.argv[1:], "--side", side, "--model-path", model_path,
               "--seed", str(seed), "--data", *data]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{side} run failed (exit {done.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


def summary(runs: dict[str, list[dict]]) -> list[str]:
    """Per side: medians of step time, completions/s, tokens/s, completion length, peak RSS (with its range);
    last, the paired ratio of completions/s and of tokens/s."""
    lines = []
    labels = {"ours": "dapo-train", "trl": "TRL", "ours-b": "dapo-train[b]"}
    for side, values in ((labels[key], runs[key]) for key in labels if key in runs):
        rss = [r["peak_rss_gib"] for r in values]
        lines.append(
            f"{side}: median {statistics.median(r['seconds_per_step'] for r in values):.3f} s/step, "
            f"{statistics.median(r['completions_per_s'] for r in values):.2f} completions/s, "
            f"{statistics.median(r['tokens_per_s'] for r in values):.1f} tokens/s, "
            f"{statistics.median(r['mean_completion_tokens'] for r in values):.1f} tokens per completion, "
            f"peak RSS {statistics.median(rss):.2f} GiB ({min(rss):.2f}-{max(rss):.2f})" + work_line(values))
    pairs = [("ours-b", "trl"), ("ours-b", "ours"), ("ours", "trl")] if "ours-b" in runs else [("ours", "trl")]
    for a, b in pairs:
        for unit, key in (("tokens/s", "tokens_per_s"), ("completions/s", "completions_per_s")):
            lines.append(paired_ratio(f"{labels[a]}/{labels[b]} {unit}", [r[key] for r in runs[a]],
                                      [r[key] for r in runs[b]]))
    return lines


def paired_ratio(name: str, first: list[float], second: list[float]) -> str:
    """The median of the per-repeat ratios (not the ratio of the medians) and their range."""
    ratios = [a / b for a, b in zip(first, second)]
    return (f"ratio {name}: {statistics.median(ratios):.2f} ({statistics.median(first):.1f}/s vs "
            f"{statistics.median(second):.1f}/s, median of {len(ratios)}, paired ratios {min(ratios):.2f}-"
            f"{max(ratios):.2f})")


def work_line(values: list[dict]) -> str:
    """', update per trained token: 2.10 forward positions (5.0% padding), 1.00 scored by the head' (medians),
    for the side whose runs report it (dapo-train's)."""
    values = [r for r in values if "forward_per_token" in r]
    if not values:
        return ""
    return (f", update per trained token: {statistics.median(r['forward_per_token'] for r in values):.2f} forward "
            f"positions ({100 * statistics.median(r['padding_frac'] for r in values):.1f}% padding), "
            f"{statistics.median(r['head_per_token'] for r in values):.2f} scored by the head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny", help="tiny (the shipped model), rehearsal (Qwen2.5's vocabulary, "
                        "tokenizer and stop ids on GSM8K questions) or a bench_step.py shape")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward, both sides")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="repeat r samples with seed + r, on both sides")
    parser.add_argument("--gsm8k", type=Path, default=GSM8K, help="GSM8K JSON Lines for the rehearsal's prompts")
    parser.add_argument("--trl-compact", action="store_true", help="TRL's LM head scores only completion positions, "
                        "as on CUDA, not every position as its CPU fallback does (a patch of TRL's choice)")
    parser.add_argument("--ours", nargs="*", default=[], help="extra KEY=VALUE settings for dapo-train's side")
    parser.add_argument("--ours-b", nargs="+", metavar="KEY=VALUE", help="a second dapo-train side, dapo-train[b]: "
                        "--ours plus these settings, in every repeat beside the others (e.g. the other layout)")
    parser.add_argument("--side", choices=("ours", "trl", "ours-b"), help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--data", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return
    check_args(parser, args)
    with tempfile.TemporaryDirectory() as tmp:
        model_path, data = SHAPES.get(args.shape, random_shape)(args, Path(tmp))
        sides = ["ours", "trl", *(["ours-b"] if args.ours_b else [])]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            shift = repeat % len(sides)  # which side goes first rotates: two sides alternate
            for side in sides[shift:] + sides[:shift]:
                result = run_side(side, args, model_path, data, args.seed + repeat)
                runs[side].append(result)
                print(f"repeat {repeat + 1} {result['side']:>10}: {json.dumps(result)}", flush=True)
    print("\n".join(summary(runs)))


def check_args(parser, args) -> None:
    """Bad options stop with one line before any model is built."""
    if (args.prompts * args.group_size) % args.micro_batch:
        parser.error("--micro-batch must divide prompts x group size (TRL accumulates whole micro-batches)")
    if args.steps < 3:
        parser.error("--steps must be at least 3: step 1 is warm-up, and a rate needs two timed step ends")
    from dapo_train.config.load import load_config
    from dapo_train.errors import UserError

    for option, settings in (("--ours", args.ours), ("--ours-b", args.ours_b or [])):
        try:
            load_config(None, settings)
        except UserError as err:
            parser.error(f"{option}: {err}")
    if args.shape == "rehearsal" and not args.gsm8k.is_file():
        parser.error(f"--gsm8k {args.gsm8k}: no such file (GSM8K's test.jsonl, for the rehearsal's prompts)")
    if args.shape not in SHAPES:
        sys.path.insert(0, str(HERE))
        from bench_step import SHAPES as RANDOM_SHAPES

        if args.shape not in RANDOM_SHAPES:
            parser.error(f"--shape {args.shape}: choose tiny, rehearsal or one of {', '.join(sorted(RANDOM_SHAPES))}")


if __name__ == "__main__":
    main()
