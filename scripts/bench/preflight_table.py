"""`dapo-train preflight` on every shipped config, and on several seeds of each Qwen config, offline:
the verdict and the seconds of each, as the Markdown table in docs/benchmarks.md (Preflight on every
shipped config).

    python scripts/bench/preflight_table.py [--seeds 20] [--only qwen1.5b.yaml] [--gsm8k GSM8K_TEST_JSONL] [--work DIR]

The Qwen configs run on scripts/build/qwen_offline.py's Qwen2.5-Instruct folders (tokenizer and config, no
weights) and a GSM8K-zh-shaped parquet folder made from --gsm8k (GSM8K's test.jsonl, the copy in data/gsm8k by
default); the others run
as shipped (the tiny task). configs/accelerate/ holds `accelerate launch` files, not dapo-train configs.
One process, one after another; seconds are each preflight's wall time in it (no interpreter start-up).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "build"))


def shipped_configs() -> list[Path]:
    return sorted(path for path in (ROOT / "configs").rglob("*.yaml") if path.parent.name != "accelerate")


def run_one(path: Path, overrides: list[str]) -> tuple[str, float]:
    """-> (ready, or the one-line problem; seconds)."""
    from dapo_train.config.load import load_config
    from dapo_train.errors import UserError
    from dapo_train.preflight.command import preflight

    threads, start = torch.get_num_threads(), time.perf_counter()
    try:
        rows = preflight(load_config(str(path), overrides), path.name).rows
        verdict = rows[-1][0]
    except UserError as err:
        verdict = f"not ready: {err}"
    torch.set_num_threads(threads)  # preflight sets them as a run would
    return verdict, time.perf_counter() - start


def main() -> None:
    import qwen_offline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=Path, default=qwen_offline.GSM8K_TEST,
                        help="GSM8K's test.jsonl (for the GSM8K-zh stand-in); default: the copy in data/gsm8k")
    parser.add_argument("--seeds", type=int, default=20, help="seeds of each Qwen config (seed=0..N-1)")
    parser.add_argument("--work", type=Path, help="folder for the offline Qwen files (default: a temporary one)")
    parser.add_argument("--only", default="", help="only the configs whose path contains this text")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="preflight-table-"))
    small = qwen_offline.build_qwen_folder(work / "Qwen2.5-1.5B-Instruct", "1.5b")
    large = work / "Qwen2.5-7B-Instruct"
    shutil.copytree(small, large, dirs_exist_ok=True)
    qwen_offline.write_model_configs(large, "7b")
    data = qwen_offline.build_gsm8k_zh_folder(work / "gsm8k_chinese", args.gsm8k)
    print("| config | seeds | ready | seconds (median, max) |\n|---|---|---|---|", flush=True)
    for path in shipped_configs():
        name = str(path.relative_to(ROOT))
        if args.only not in name:
            continue
        overrides, seeds = [], [None]
        if path.name.startswith("qwen"):
            model = large if "7b" in path.name else small
            overrides, seeds = [f"model.name_or_path={model}", f"data.path={data}"], list(range(args.seeds))
        results = [run_one(path, overrides + ([f"seed={seed}"] if seed is not None else [])) for seed in seeds]
        problems = [verdict for verdict, _ in results if verdict != "ready"]
        seconds = [s for _, s in results]
        print(f"| `{name}` | {len(seeds) if seeds != [None] else 'as shipped'} | "
              f"{len(results) - len(problems)} of {len(results)} | {statistics.median(seconds):.1f}, "
              f"{max(seconds):.1f} |", flush=True)
        for problem in dict.fromkeys(problems):
            print(f"|   | | {problem} | |", flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
