"""Peak memory of the scoring path (per-token log-probs, forward + backward) against the naive one.

    python scripts/bench/bench_logprob_memory.py            # V = 151,936 (Qwen2.5), float32 on CPU

A random Qwen2 with Qwen's vocabulary (hidden size 64, 2 layers, tied embeddings) scores 8 rows
of 128 prompt + 128 completion tokens, forward and backward:
- naive: the forward with `logits_to_keep`, then `logits.float().log_softmax(-1).gather(...)`;
- dapo-train: `logprobs.score_tokens` (hidden states only, the LM head chunk by chunk with
  recompute in backward), at train.logprob_chunk_mib's default.
Each is measured in its own process as peak RSS minus RSS just before the call (the kernel's
high-water mark is reset first), after one warm-up call. Also checks that both give the same
log-probs and gradients (to 1e-5). Prints both figures and their ratio; the target is <= 30%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROWS, PROMPT, COMPLETION, VOCAB = 8, 128, 128, 151936


def build():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_train.model.scoring import collate

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).float().train()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=g) for _ in range(ROWS)]
    completions = [torch.randint(0, VOCAB, (COMPLETION,), generator=g) for _ in range(ROWS)]
    return model, collate(prompts, completions, pad_id=0)


def naive(model, batch) -> torch.Tensor:
    width = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False, logits_to_keep=width + 1)
    logits = out.logits[:, :-1, :]
    return logits.float().log_softmax(-1).gather(-1, batch.completion_ids[..., None])[..., 0]


def ours(model, batch, chunk_mib: float) -> torch.Tensor:
    from dapo_train.model.scoring import score_tokens

    return score_tokens(model, batch, temperature=1.0, chunk_mib=chunk_mib)[0]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(path: str, chunk_mib: float) -> dict:
    torch.set_num_threads(1)
    model, batch = build()
    call = (lambda: naive(model, batch)) if path == "naive" else (lambda: ours(model, batch, chunk_mib))

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        logprobs = call()
        (logprobs * batch.completion_mask).sum().backward()
        return logprobs.detach()

    step()  # warm-up: allocator pools, lazy inits, gradient buffers
    model.zero_grad(set_to_none=False)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (VmHWM)
    before = _status("VmRSS")
    logprobs = step()
    peak = _status("VmHWM")
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"path": path, "extra_mib": (peak - before) / 2**20, "logprobs": logprobs.tolist(),
            "grad_sample": grads[:: max(1, grads.numel() // 20000)].tolist()}


def main() -> None:
    from dapo_train.config.schema import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=TrainConfig().logprob_chunk_mib)
    parser.add_argument("--child", choices=("naive", "ours"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args.chunk_mib)), flush=True)
        return
    results = {}
    for path in ("naive", "ours"):
        done = subprocess.run([sys.executable, __file__, "--child", path, "--chunk-mib", str(args.chunk_mib)],
                              capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{path} failed:\n{done.stderr[-2000:]}")
        results[path] = json.loads(lines[-1][len("RESULT "):])
    a, b = (torch.tensor(results[p]["logprobs"]) for p in ("naive", "ours"))
    ga, gb = (torch.tensor(results[p]["grad_sample"]) for p in ("naive", "ours"))
    logprob_error, grad_error = float((a - b).abs().max()), float((ga - gb).abs().max())
    naive_mib, ours_mib = results["naive"]["extra_mib"], results["ours"]["extra_mib"]
    print(f"rows {ROWS} x ({PROMPT} prompt + {COMPLETION} completion) tokens, V = {VOCAB}, float32, forward + backward")
    print(f"max |difference|: log-probs {logprob_error:.2e}, gradients {grad_error:.2e}")
    print(f"naive log_softmax path: {naive_mib:.0f} MiB above the RSS before the call")
    print(f"dapo-train (chunk {args.chunk_mib:g} MiB): {ours_mib:.0f} MiB above the RSS before the call")
    print(f"ratio dapo-train/naive extra memory: {ours_mib / naive_mib:.1%} (target <= 30%)")
    if logprob_error > 1e-5 or grad_error > 1e-5:
        sys.exit("the two paths disagree beyond 1e-5")


if __name__ == "__main__":
    main()
