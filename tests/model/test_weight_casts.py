"""The weight casts a card pays under bf16 autocast over float32 master weights, counted on the CPU with the
instrument of scripts/bench/bench_casts.py (a dispatch mode below autocast: a cast served from autocast's cache is
not counted, one it makes is). The LM head casts its weight once per call however many chunks it runs in; a decode
through the run's engine casts no weight per forward."""

import sys
from pathlib import Path

import torch

from dapo_train.model.scoring import head_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from bench_casts import CastCounter  # noqa: E402


def _head_casts(chunk_rows_wanted: int, rows: int = 12, vocab: int = 50, hidden_size: int = 8) -> tuple[int, int]:
    """Casts of the head's weight in one forward and in its backward, under CPU bf16 autocast, with the head's
    logits cut into chunks of `chunk_rows_wanted` rows."""
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    ids = torch.randint(vocab, (rows,))
    chunk_mib = chunk_rows_wanted * vocab * 4 / 2**20  # chunk_rows: rows whose float32 logits fill chunk_mib
    counter = CastCounter({"head": head.weight})
    with counter, torch.autocast("cpu", dtype=torch.bfloat16):
        with counter.phase("forward"):
            picked, _ = head_logprobs(head, hidden, ids, temperature=1.0, chunk_mib=chunk_mib)
        with counter.phase("backward"):
            picked.sum().backward()
    assert head.weight.grad is not None and hidden.grad is not None
    return counter.count("forward"), counter.count("backward")


def test_the_head_casts_its_weight_once_per_call_however_many_chunks():
    one_chunk = _head_casts(chunk_rows_wanted=12)  # all 12 rows in one chunk
    twelve_chunks = _head_casts(chunk_rows_wanted=1)  # a chunk per row
    # One cast of the (V, H) weight to bf16 in the forward, kept for the backward: none there.
    assert one_chunk == twelve_chunks == (1, 0)
