"""What the out-of-memory retry costs a step that does not run out (train/update/out_of_memory.py): the host copy of
the trainable weights and AdamW state taken before a step of several optimizer steps, and, when a step does
fail, putting them back. On a random model of a Qwen2.5 shape with AdamW's state filled by one step.

    python scripts/bench/bench_snapshot.py --size 1.5b                        # on CUDA: the real job's cost
    python scripts/bench/bench_snapshot.py --size 1.5b --layers 1 --vocab 32000   # a CPU-sized cut of it

The last line is JSON: the copied GiB, seconds per take and per restore (median of --repeats), and GiB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "build"))


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_train.train.update.out_of_memory import Snapshot

    import qwen_offline

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--layers", type=int, default=0, help="cut the shape to this many layers (0: as shipped)")
    parser.add_argument("--vocab", type=int, default=0, help="cut the vocabulary (0: as shipped)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-snapshot-"))
    qwen_offline.write_model_configs(folder, args.size)
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = args.layers or config.num_hidden_layers
    config.vocab_size = args.vocab or config.vocab_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's moments exist, as after a run's first step
    learner = SimpleNamespace(model=model, optimizer=SimpleNamespace(optimizer=optimizer, steps=1))
    snapshot, takes, restores = Snapshot(), [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        snapshot.take(learner)
        takes.append(time.perf_counter() - start)
        start = time.perf_counter()
        snapshot.restore(learner)
        if device == "cuda":
            torch.cuda.synchronize()
        restores.append(time.perf_counter() - start)
    parameters = sum(p.numel() for p in model.parameters())
    gib = parameters * 4 * 3 / 2**30  # weights and AdamW's two moments, float32
    take, restore = statistics.median(takes), statistics.median(restores)
    print(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "parameters": parameters,
                      "copied_gib": round(gib, 2), "take_s": round(take, 3), "restore_s": round(restore, 3),
                      "take_gib_per_s": round(gib / take, 2), "first_take_s": round(takes[0], 3)}))


if __name__ == "__main__":
    main()
