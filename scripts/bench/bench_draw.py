"""Time the decode loop's full-vocabulary token draws at Qwen's vocabulary, side by side.

    python scripts/bench/bench_draw.py                     # CPU: 64 rows x 151,936 entries, 9 interleaved repeats
    python scripts/bench/bench_draw.py --device cuda       # the line scripts/bench/bench_cuda.sh runs

One row of the behaviour distribution is a log_softmax over random logits (the shape of a decode
step's, A rows x V). Each repeat times every draw once, in turn, so load on a shared machine hits all
of them alike; the medians and the spread (min-max) are printed in ms, with each draw's ratio to
Gumbel-max per repeat. Draws: Gumbel-max (an exponential per entry), torch.multinomial on the
probabilities, a one-level float32 inverse-CDF draw (cumsum over the vocabulary: cheap, but it
rounds away the tail below 3e-8, so not used), and the two-level inverse-CDF draw that
rollout/sampling.py uses where FULL_VOCABULARY_DRAWS names it. The last JSON line holds the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _float32_cumsum_draw(distribution: torch.Tensor) -> torch.Tensor:
    cumulative = distribution.exp().cumsum(dim=-1)  # (A, V)
    uniform = torch.rand(cumulative.shape[0], 1, device=cumulative.device) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, uniform, right=True)[:, 0].clamp(max=cumulative.shape[-1] - 1)


def draws() -> dict:
    from dapo_train.rollout.sampling import gumbel_max_draw, inverse_cdf_draw

    return {
        "gumbel-max": gumbel_max_draw,
        "multinomial": lambda d: torch.multinomial(d.exp(), 1)[:, 0],
        "float32-cumsum": _float32_cumsum_draw,
        "inverse-cdf": inverse_cdf_draw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the docs' figures: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    distribution = torch.log_softmax(3 * torch.randn(args.rows, args.vocab, device=device), dim=-1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    variants = draws()
    for draw in variants.values():  # warm-up: allocations, kernels
        draw(distribution)
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, draw in variants.items():
            sync()
            start = time.perf_counter()
            draw(distribution)
            sync()
            times[name].append(1000 * (time.perf_counter() - start))
    out = {"device": str(device), "rows": args.rows, "vocab": args.vocab, "repeats": args.repeats,
           "threads": args.threads}
    for name, values in times.items():
        ratios = [g / v for g, v in zip(times["gumbel-max"], values)]
        out[name] = {"median_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3),
                     "max_ms": round(max(values), 3), "speedup_vs_gumbel_median": round(statistics.median(ratios), 2)}
        print(f"{name:15s} median {statistics.median(values):9.3f} ms  (min {min(values):.3f}, max {max(values):.3f})"
              f"  x{statistics.median(ratios):.2f} vs gumbel-max")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
