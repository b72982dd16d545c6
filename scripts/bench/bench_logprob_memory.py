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

    python scripts/bench/bench_logprob_memory.py --budget 4096 --max-new-tokens 64 128 256 512 --repeats 3

The update's peak at a token budget (train.micro_batch_tokens) as the completions grow: preflight's
rehearsal stand-in (a random Qwen2 of width 32, 2 layers, Qwen's vocabulary, tied embeddings, sdpa)
trains one mini-batch of groups of G completions (prompts of 100-200 tokens, completion lengths uniform
in 1..max_new_tokens, a quarter of them at the limit) holding BUDGETS budgets' worth of tokens at every
max_new_tokens (so every length fills its micro-batches alike: more, shorter groups at 64), cut by
batching.Batching with shared-prefix rows, each micro-batch scored and back-propagated as the update
does. Per max_new_tokens, in its own process (glibc's mmap threshold at 64 KiB, so freed blocks leave
the resident set, as tests/preflight/test_memory.py measures) and interleaved over the repeats: peak
RSS minus RSS before the mini-batch (after a warm-up micro-batch), and the micro-batches' widest row.
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
G, BUDGETS = 16, 4  # the budget sweep's mini-batch: groups of G completions, BUDGETS budgets' worth of tokens


def random_qwen(hidden: int, intermediate: int, positions: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float().train()


def build():
    from dapo_train.model.layout import collate

    model = random_qwen(64, 128, 512)
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


def budget_samples(max_new_tokens: int, budget: int) -> list:
    """The sweep's mini-batch (module docstring), the same prompts at every max_new_tokens."""
    from dapo_train.train.update.batching import TrainSample

    g = torch.Generator().manual_seed(2)
    samples = []
    while sum(s.prompt_ids.numel() / G + s.completion_ids.numel() for s in samples) < BUDGETS * budget:
        prompt = torch.randint(0, VOCAB, (int(torch.randint(100, 201, (1,), generator=g)),), generator=g)
        lengths = torch.randint(1, max_new_tokens + 1, (G,), generator=g)
        lengths[: G // 4] = max_new_tokens
        samples += [TrainSample(prompt, torch.randint(0, VOCAB, (int(n),), generator=g),
                                float(torch.randn(1, generator=g)), in_loss=True) for n in lengths]
    return samples


def measure_budget(budget: int, max_new_tokens: int, chunk_mib: float) -> dict:
    """One mini-batch at the budget: peak RSS above the RSS before it (after a warm-up micro-batch)."""
    from dapo_train.train.update.batching import Batching, Scorer

    torch.set_num_threads(1)
    model = random_qwen(32, 64, 2048)
    batching = Batching(0, torch.device("cpu"), share_prefix=True, max_count=1, max_tokens=budget)
    scorer = Scorer(1.0, chunk_mib)
    samples = budget_samples(max_new_tokens, budget)

    def mini_batch() -> list:
        micro_batches = batching.micro_batches(samples)
        for micro in micro_batches:
            logprobs, _ = scorer(model, micro.batch)
            (logprobs * micro.batch.completion_mask * micro.advantages[:, None]).sum().backward()
        return [micro.batch for micro in micro_batches]

    warm = batching.micro_batches(samples)[0]  # allocator pools, lazy inits, gradient buffers
    scorer(model, warm.batch)[0].sum().backward()
    model.zero_grad(set_to_none=False)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    batches = mini_batch()
    peak = _status("VmHWM")
    return {"max_new_tokens": max_new_tokens, "extra_mib": (peak - before) / 2**20, "micro_batches": len(batches),
            "widest_row": max(b.input_ids.shape[1] for b in batches),
            "forward_tokens": max(b.forward_tokens for b in batches)}


def _child(args: list[str], env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        sys.exit(f"{args} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def budget_sweep(budget: int, lengths: list[int], repeats: int, chunk_mib: float) -> None:
    runs: dict[int, list[dict]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            runs[n].append(_child(["--child", "budget", "--budget", str(budget), "--max-new-tokens", str(n),
                                   "--chunk-mib", str(chunk_mib)], {"MALLOC_MMAP_THRESHOLD_": "65536"}))
    print(f"train.micro_batch_tokens={budget}: a mini-batch of ~{BUDGETS} budgets in groups of G={G}, V = {VOCAB}, "
          "width 32, 2 layers, float32")
    medians = {}
    for n in lengths:
        extra = sorted(run["extra_mib"] for run in runs[n])
        medians[n] = extra[len(extra) // 2]
        last = runs[n][-1]
        listed = ", ".join(f"{e:.0f}" for e in extra)
        print(f"max_new_tokens {n}: {medians[n]:.0f} MiB above the RSS before (runs {listed}); "
              f"{last['micro_batches']} micro-batches, widest row {last['widest_row']}, "
              f"largest forward {last['forward_tokens']} positions")
    low = min(medians.values())
    print(f"largest / smallest median: {max(medians.values()) / low:.2f} (target <= 1.15)")


def main() -> None:
    from dapo_train.config.schema import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk-mib", type=float, default=TrainConfig().logprob_chunk_mib)
    parser.add_argument("--budget", type=int, help="sweep max_new_tokens at this train.micro_batch_tokens")
    parser.add_argument("--max-new-tokens", type=int, nargs="*", default=[64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=("naive", "ours", "budget"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "budget":
        print("RESULT " + json.dumps(measure_budget(args.budget, args.max_new_tokens[0], args.chunk_mib)), flush=True)
        return
    if args.child:
        print("RESULT " + json.dumps(measure(args.child, args.chunk_mib)), flush=True)
        return
    if args.budget:
        budget_sweep(args.budget, args.max_new_tokens, args.repeats, args.chunk_mib)
        return
    results = {}
    for path in ("naive", "ours"):
        results[path] = _child(["--child", path, "--chunk-mib", str(args.chunk_mib)])
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
