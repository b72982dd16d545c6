"""Build the embedded tiny world: the word-problem splits, a character tokenizer, a warm-started
tiny Qwen2 model. Everything lands in dapo_train/assets/tiny/ and ships inside the package;
`--recipe tiny-long` builds the long-solution task and its warm start in dapo_train/assets/tiny-long/
(see build_long and make_tiny_model.md); `--recipe tiny-strong` the strong start in
dapo_train/assets/tiny-strong/ (build_strong).

Rebuild (deterministic: the defaults give the shipped weights bit for bit, on 1 or 2 threads;
the 600 SFT steps took 235 s on 2 threads, 350 s on 1, the measurement another 30-50 s):

    python scripts/build/make_tiny_model.py                       # data + tokenizer + model, then eval
    python scripts/build/make_tiny_model.py --out /tmp/tiny       # same build written elsewhere
    python scripts/build/make_tiny_model.py --steps 800 --no-eval # another SFT length, no measurement
    python scripts/build/make_tiny_model.py --measure-only        # re-measure the shipped model (~35 s)
    python scripts/build/make_tiny_model.py --recipe tiny-long --threads 1   # the long task's world (~13 min)
    python scripts/build/make_tiny_model.py --recipe tiny-strong --threads 1 # the strong start (~7 min CPU)

Stages, saved as they finish so other work can start early:
1. data/{train,test}.jsonl from tiny_task.make_splits (scripts/build/tiny_task.py; fixed seed, no shared question);
2. model/ tokenizer: Qwen's byte-level BPE pipeline with merges that make every character of
   the corpus, the system prompt and common Chinese punctuation one token (ASCII is one byte
   token each; any other text falls back to its UTF-8 bytes, so everything round-trips), Qwen's
   special tokens and chat template, and <think>/</think>/<answer>/</answer> as single tokens;
3. model/ weights: Qwen2ForCausalLM (~1M parameters, float32), trained by SFT on the worked
   solutions of the train split, the loss on the completion only, prompts byte-identical to the
   trainer's (DEFAULT_SYSTEM_PROMPT + question through the chat template);
4. a measurement on the test split (greedy accuracy, format rate, pass@8 at T=1) by the code of
   `dapo-train eval` (data.load_prompts, evaluate.evaluate_prompts), printed and written to
   model/build_info.json.

Deliberate choice, so that RL has something to fix in a few CPU minutes: the warm start is only
PARTIALLY right, in two ways (what else was tried: make_tiny_model.md next to this script).
- Phase 1 SFT (correct solutions, 500 steps) is short: the model learns the format and most
  one-step arithmetic but still slips on carries and three-step problems (33% greedy).
- Phase 2 (100 steps) continues SFT on a deliberately imperfect mix: in a fraction --slip-rate
  of the targets the <answer> block holds the first operand of the last worked step (a plausible
  slip: answering with a quantity already given or computed) instead of its result. The model
  then often writes that slip greedily, while sampling at T=1 is right on many of those items:
  informative groups for DAPO. The shipped warm start is 23.8% greedy; the demo's RL removes
  the slip and gains 10+ points within about ten steps (its test checks +5).

The generation_config copies Qwen2.5-Instruct's sampling defaults (two EOS ids, pad = one of them,
do_sample, temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) on purpose, so the
embedded demo exercises the same traps as the real model: the trainer must pass its own settings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT
from dapo_train.task.locations import (
    TINY_DATA_DIR,
    TINY_LONG_DATA_DIR,
    TINY_LONG_MODEL_DIR,
    TINY_MODEL_DIR,
    TINY_STRONG_MODEL_DIR,
)
from dapo_train.task.prompts import chat_prompt

from tiny_measure import measure, remeasure, write_info
from tiny_sft import train_sft

# Build-time code next to this script, not part of the package.
from tiny_task import concise, make_splits
from tiny_task_long import make_long_splits
from tiny_tokenizer import build_tokenizer, save_tokenizer

SEED = 0
LONG_MAX_NEW_TOKENS = 128  # the long task's: rollout.max_new_tokens of configs/tiny-long-cpu.yaml
EVAL_ITEMS = 100  # the demo's eval.num_items (configs/tiny-cpu.yaml), the 40-step study's: step 0 measured on them
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODEL_SHAPE = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 512, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False,
    # Weights drawn with std 0.08 (about 1/sqrt(hidden_size)) instead of HF's 0.02: attention
    # scores start large enough for the model to learn to copy numbers from the question early.
    # Measured: greedy accuracy leaves the floor near step 200 instead of step 500-700.
    "initializer_range": 0.08,
}


# ----------------------------------------------------------------------------- data
def write_splits(splits: dict[str, list[dict]], data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        lines = (json.dumps(row, ensure_ascii=False) for row in rows)
        (data_dir / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- prompts + targets
def prompt_text(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    """The trainer's prompt, byte for byte: system prompt + question through the chat template."""
    return chat_prompt(tokenizer, question, DEFAULT_SYSTEM_PROMPT)


def target_text(answer: str) -> str:
    """Worked steps (without the #### line) in <think>, the number in <answer>."""
    steps, final = answer.rsplit("\n#### ", 1)
    return f"<think>\n{steps}\n</think>\n<answer>\n{final}\n</answer>"


def with_slips(rows: list[dict], rate: float) -> list[dict]:
    """Copies of `rows` where a seeded fraction `rate` answers with the first operand of the last
    worked step ("一共：54 + 35 = 89" -> 54) instead of its result: the phase 2 slip."""
    rng = random.Random(SEED)
    out = []
    for row in rows:
        steps, _ = row["answer"].rsplit("\n#### ", 1)
        if rng.random() < rate:
            operand = steps.split("\n")[-1].split("：", 1)[1].split(" ")[0]
            row = dict(row, answer=f"{steps}\n#### {operand}")
        out.append(row)
    return out


def with_concise(rows: list[dict], written_out_rate: float) -> list[dict]:
    """Copies of the long task's `rows` where a seeded fraction 1 - written_out_rate of the worked
    solutions is in concise form (tiny_task.concise): the long warm start's style mix."""
    rng = random.Random(SEED)
    return [row if rng.random() < written_out_rate else dict(row, answer=concise(row["answer"])) for row in rows]


def encode_examples(tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + <|im_end|>) per row."""
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    end = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return [(encode(prompt_text(tokenizer, r["question_zh-cn"])), encode(target_text(r["answer"])) + end) for r in rows]


# ----------------------------------------------------------------------------- model
def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    im_end, endoftext = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype="float32",
        **MODEL_SHAPE,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext,
        eos_token_id=[im_end, endoftext],
        pad_token_id=endoftext,
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
    )
    return model


# ----------------------------------------------------------------------------- recipes
Built = tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict, list[float]]  # model, tokenizer, info, losses


def build_tiny(args: argparse.Namespace, data_dir: Path, model_dir: Path) -> Built:
    """The short task's world from nothing: splits, tokenizer, phase 1 SFT, phase 2 on the slip mix."""
    start = time.time()
    splits = make_splits(SEED)
    write_splits(splits, data_dir)
    corpus = [r["question_zh-cn"] + r["answer"] for rows in splits.values() for r in rows]
    tokenizer = build_tokenizer(corpus, MODEL_SHAPE["max_position_embeddings"])
    save_tokenizer(tokenizer, model_dir)
    print(f"data + tokenizer written ({len(tokenizer)} tokens) in {time.time() - start:.1f}s", flush=True)

    model = build_model(tokenizer)
    examples = encode_examples(tokenizer, splits["train"])
    losses = train_sft(model, examples, tokenizer.pad_token_id, args.steps, args.batch_size, args.lr)
    if args.slip_steps > 0:
        slipped = encode_examples(tokenizer, with_slips(splits["train"], args.slip_rate))
        losses = train_sft(model, slipped, tokenizer.pad_token_id, args.slip_steps, args.batch_size, args.slip_lr)
    info = {"sft_steps": args.steps, "slip_steps": args.slip_steps, "slip_rate": args.slip_rate}
    return model, tokenizer, info, losses


def continue_tiny(model_dir: Path) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict]:
    """The shipped tiny model to continue: its tokenizer files copied to model_dir (unchanged), its
    weights loaded, and the build_info fields that name them."""
    model_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TINY_MODEL_DIR / name, model_dir / name)
    weights = hashlib.sha256((TINY_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    info = {"base_model": "builtin:tiny", "base_weights_sha256": weights}
    return Qwen2ForCausalLM.from_pretrained(TINY_MODEL_DIR), AutoTokenizer.from_pretrained(TINY_MODEL_DIR), info


def build_long(args: argparse.Namespace, data_dir: Path, model_dir: Path) -> Built:
    """The long task's warm start: the shipped tiny model (its tokenizer files copied, its weights
    continued) trained by SFT on the long train split, a seeded fraction --written-out-rate of the
    targets written out in full and the rest concise, so it samples both styles."""
    splits = make_long_splits(SEED)
    write_splits(splits, data_dir)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    text = "".join(r["question_zh-cn"] + r["answer"] for rows in splits.values() for r in rows)
    split_up = sorted({c for c in set(text) if len(tokenizer.encode(c)) != 1})
    if split_up:
        sys.exit(f"the tiny tokenizer has no single token for {''.join(split_up)}: word the long task "
                 "(scripts/build/tiny_task_long.py) with characters of the short one")
    model, tokenizer, base = continue_tiny(model_dir)
    examples = encode_examples(tokenizer, with_concise(splits["train"], args.written_out_rate))
    losses = train_sft(model, examples, tokenizer.pad_token_id, args.steps, args.batch_size, args.lr)
    info = {**base, "sft_steps": args.steps, "lr": args.lr, "written_out_rate": args.written_out_rate}
    return model, tokenizer, info, losses


def build_strong(args: argparse.Namespace, data_dir: Path, model_dir: Path) -> Built:
    """A strong start on the short task: the shipped tiny model continued by SFT on the correct
    solutions of its train split (no slip), so most greedy answers are right before RL (issue 53).
    The splits are the short task's, written to data_dir as --recipe tiny writes them."""
    splits = make_splits(SEED)
    write_splits(splits, data_dir)
    model, tokenizer, base = continue_tiny(model_dir)
    examples = encode_examples(tokenizer, splits["train"])
    losses = train_sft(model, examples, tokenizer.pad_token_id, args.steps, args.batch_size, args.lr)
    return model, tokenizer, {**base, "sft_steps": args.steps, "lr": args.lr}, losses


class Recipe(NamedTuple):
    """One shipped model: where its data/ and model/ go, how it is built, the defaults of the
    options it reads, and measure()'s settings for it. (A NamedTuple, not a dataclass: the tests
    load this script by file path, outside sys.modules, where @dataclass cannot run.)"""

    data_dir: Path
    model_dir: Path
    build: Callable[[argparse.Namespace, Path, Path], Built]
    options: dict[str, float]
    measure: dict


RECIPES = {
    "tiny": Recipe(
        TINY_DATA_DIR, TINY_MODEL_DIR, build_tiny,
        {"steps": 500, "lr": 3e-3, "slip_steps": 100, "slip_rate": 0.55, "slip_lr": 1e-3}, {},
    ),
    "tiny-long": Recipe(
        TINY_LONG_DATA_DIR, TINY_LONG_MODEL_DIR, build_long,
        {"steps": 600, "lr": 2e-3, "written_out_rate": 0.65},
        {"max_new_tokens": LONG_MAX_NEW_TOKENS, "truncation": True},
    ),
    "tiny-strong": Recipe(
        TINY_DATA_DIR, TINY_STRONG_MODEL_DIR, build_strong, {"steps": 800, "lr": 1e-3}, {"eval_items": EVAL_ITEMS},
    ),
}


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The build's options; each recipe's defaults give its shipped model (tests compare build_info.json).
    An option the chosen recipe does not read is an error, not silently ignored."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", choices=RECIPES, default="tiny",
        help="tiny: the short task and builtin:tiny; tiny-long: the long task and builtin:tiny-long (from tiny); "
        "tiny-strong: builtin:tiny-strong (from tiny).",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="Write data/ and model/ here (default: the recipe's package assets)."
    )
    parser.add_argument(
        "--steps", type=int, help="SFT steps (tiny: phase 1, on correct solutions; default 500 / 600 / 800)."
    )
    parser.add_argument("--lr", type=float, help="SFT learning rate (default 3e-3 / 2e-3 / 1e-3).")
    parser.add_argument("--slip-steps", type=int, help="tiny: phase 2 SFT steps on the slip mix (0 = none; 100).")
    parser.add_argument("--slip-rate", type=float, help="tiny: fraction of phase 2 targets with the slip (0.55).")
    parser.add_argument("--slip-lr", type=float, help="tiny: phase 2 learning rate (1e-3).")
    parser.add_argument(
        "--written-out-rate", type=float, help="tiny-long: fraction of targets written out in full, not concise (0.65)."
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch CPU threads (1 is fastest when other work shares the cores)."
    )
    parser.add_argument("--no-eval", action="store_true", help="Skip the test-split measurement.")
    parser.add_argument(
        "--measure-only",
        action="store_true",
        help="No build: re-measure the model already there and update build_info.json.",
    )
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    for name in ("steps", "lr", "slip_steps", "slip_rate", "slip_lr", "written_out_rate"):
        if getattr(args, name) is None:
            setattr(args, name, recipe.options.get(name))
        elif name not in recipe.options:
            parser.error(f"--{name.replace('_', '-')} does not apply to --recipe {args.recipe}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    recipe = RECIPES[args.recipe]
    data_dir, model_dir = (args.out / "data", args.out / "model") if args.out else (recipe.data_dir, recipe.model_dir)
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    start = time.time()
    if args.measure_only:
        return remeasure(data_dir, model_dir, recipe.measure)

    model, tokenizer, fields, losses = recipe.build(args, data_dir, model_dir)
    model.save_pretrained(model_dir)
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        **fields,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "build_seconds": round(time.time() - start, 1),
        "weights_bytes": (model_dir / "model.safetensors").stat().st_size,
        # Ties the weights to the data they were trained on (tests compare it with the shipped file).
        "train_data_sha256": hashlib.sha256((data_dir / "train.jsonl").read_bytes()).hexdigest(),
    }
    if not args.no_eval:
        info.update(measure(model, tokenizer, data_dir, **recipe.measure))
        info["build_and_eval_seconds"] = round(time.time() - start, 1)
    write_info(info, model_dir / "build_info.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
