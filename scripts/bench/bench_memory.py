"""Peak memory of one training step at a real Qwen2.5 shape on the CPU, against the estimate preflight prints
(dapo_train.train.memory) for the same config.

    python scripts/bench/bench_memory.py   # Qwen2.5-0.5B shape, configs/qwen1.5b-seed.yaml's batch
    python scripts/bench/bench_memory.py --size 1.5b --set train.micro_batch_size=2

A random model of the real shape (its config.json and tokenizer from scripts/build/qwen_offline.py, random
weights: every completion runs to the budget, the worst case) trains one step of the config on the
GSM8K-zh stand-in, in a child process whose peak resident memory (ru_maxrss) is the measurement. The
last line is JSON: measured and estimated GiB, their ratio, and the estimate's terms. Takes about 2
minutes and 12 GB of memory for 0.5B on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "build"))

import qwen_offline  # noqa: E402  (a build script)

GSM8K = qwen_offline.GSM8K_TEST


def random_model_folder(folder: Path, size: str) -> Path:
    """The offline Qwen2.5 folder of `size` with random float32 weights saved beside its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    qwen_offline.build_qwen_folder(folder, size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def estimated(config: str, overrides: list[str], folder: Path, data: Path) -> dict:
    from transformers import AutoConfig

    from dapo_train.config.load import load_config
    from dapo_train.model.loading import load_tokenizer
    from dapo_train.task.prompts import load_prompt_splits
    from dapo_train.train.memory import GIB, ModelShape, Setting, estimate

    cfg = load_config(config, overrides)
    prompts = load_prompt_splits(cfg.data, load_tokenizer(cfg.model), [cfg.data.train_split])[cfg.data.train_split][0]
    longest = max(len(p.input_ids) for p in prompts)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(folder), cfg.model.lora)
    result = estimate(shape, Setting.from_config(cfg, cuda=False, prompt_tokens=longest))
    return {"estimated_gib": result.peak / GIB, "moment": result.peak_moment,
            "terms_gib": {k: round(v / GIB, 3) for k, v in result.terms.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(qwen_offline.ARCHITECTURES), default="0.5b")
    parser.add_argument("--config", default=str(ROOT / "configs" / "qwen1.5b-seed.yaml"))
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE overrides of the config.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_model_folder(Path(tmp) / "model", args.size)
        data = qwen_offline.build_gsm8k_zh_folder(Path(tmp) / "gsm8k_zh", GSM8K)
        overrides = [f"model.name_or_path={folder}", f"data.path={data}", "train.max_steps=1", "eval.every_steps=0",
                     "eval.final_full=false", "dapo.dynamic_sampling=false", "logging.progress_bar=false",
                     "model.dtype=float32", f"output_dir={Path(tmp) / 'run'}", *args.set]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dapo_train", "run", args.config, *overrides], check=True)
        seconds = time.perf_counter() - start
        measured = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 1024**3  # KiB -> GiB
        report = estimated(args.config, overrides, folder, data)
    report.update(size=args.size, config=Path(args.config).name, overrides=args.set, measured_gib=measured,
                  ratio=report["estimated_gib"] / measured, seconds=seconds)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
