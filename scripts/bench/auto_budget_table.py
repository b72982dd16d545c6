"""The budget train.micro_batch_tokens=auto chooses for every shipped Qwen config on 24, 48 and 80 GB cards,
from the memory model alone (train/memory.py, train/update/budget.py), offline: the Markdown table in docs/training.md
(Memory). Estimates, not measurements.

    python scripts/bench/auto_budget_table.py [--work DIR]

Each config's model is scripts/build/qwen_offline.py's config.json for its size (no weights, no tokenizer); a
card is taken as all free (a fresh card's free memory less its CUDA context is about its nominal size in GB:
a 48 GB card has 48 GiB = 51.5e9 bytes), less auto's 10% margin; the prompt is the longest a run keeps,
data.max_prompt_length (a run's own longest prompt is no longer, so its budget is no smaller); qwen7b-fsdp.yaml
per card with FSDP over its 8 cards. Takes a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "build"))

FSDP_CARDS = {"qwen7b-fsdp.yaml": 8}  # the cards a config shards its training state over (its header says so)


def row(path: Path, folder: Path) -> str:
    from transformers import AutoConfig

    from dapo_train.config.load import load_config
    from dapo_train.train.memory import ModelShape
    from dapo_train.train.update.budget import CARD_SIZES, budget_lines, describe_choice

    cfg = load_config(str(path), [f"model.name_or_path={folder}"])
    shape = ModelShape.from_config(AutoConfig.from_pretrained(folder), cfg.model.lora)
    shards = FSDP_CARDS.get(path.name, 1)
    cells = [describe_choice(*budget_lines(shape, cfg, cfg.data.max_prompt_length, shards, card_bytes=size), size)
             for size in CARD_SIZES]
    setting = str(cfg.train.micro_batch_tokens)
    return f"| `configs/{path.name}` | {setting} | " + " | ".join(cells) + " |"


def main() -> None:
    import qwen_offline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="folder for the model configs (default: a temporary one)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="auto-budget-table-"))
    print("| config | train.micro_batch_tokens | 24 GB | 48 GB | 80 GB |\n|---|---|---|---|---|")
    for path in sorted((ROOT / "configs").glob("qwen*.yaml")):
        size = "7b" if "7b" in path.name else "1.5b"
        folder = work / size
        folder.mkdir(parents=True, exist_ok=True)
        qwen_offline.write_model_configs(folder, size)
        print(row(path, folder), flush=True)


if __name__ == "__main__":
    main()
