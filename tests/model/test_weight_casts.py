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


def _run_casts(tmp_path, *overrides: str):
    from bench_casts import CARD_SETTINGS, run_counted

    counter, _ = run_counted([*CARD_SETTINGS, "train.max_steps=1", "eval.every_steps=1", "eval.num_items=4",
                              "eval.final_full=false", "train.prompts_per_step=2", "train.updates_per_step=2",
                              "logging.progress_bar=false", "eval.print_samples=0", *overrides], tmp_path / "run")
    return counter


def test_an_eval_decodes_through_the_bf16_rollout_copy_and_casts_no_weight(tmp_path):
    counter = _run_casts(tmp_path)
    assert counter.forwards["eval"] > 10  # steps 0 and 1, every decode step a forward
    assert counter.count("eval") == 0
    assert counter.count("update") > 0  # the counter sees the update's casts: autocast over float32 weights


def test_a_decode_over_float32_weights_under_autocast_casts_each_weight_once_per_generate_call(tmp_path):
    """rollout.dtype=float32 with bf16 autocast: no copy, so the rollout and the eval decode the float32 weights in
    one autocast region per generate call, and autocast's cache serves every forward after the call's first."""
    counter = _run_casts(tmp_path, "rollout.dtype=float32")
    weights = len(counter.names)
    for phase in ("eval", "rollout"):
        calls = counter.calls[phase]
        assert counter.forwards[phase] > 5 * calls  # many decode steps per call
        assert 0 < counter.count(phase) <= weights * calls


def test_the_card_check_fails_a_decode_that_casts_per_forward_and_a_head_that_casts_per_chunk():
    """bench_casts.py --check (bench_cuda.sh runs it on a card): hand-made rows, 50 float32 weights. A decode of 2
    generate calls may cast each weight once a call (100); the old eval's 7,011 over 3 calls is refused, so is
    a head cast 3 times an update call; the figures after the fix pass."""
    from bench_casts import failures

    def rows(eval_casts: int, head: float) -> dict:
        phase = {"forwards": 171, "calls": 3, "weight_casts": 0, "projection_casts": 0, "casts_per_forward": 0.0}
        return {"float32_weights": 50, "rollout": {**phase, "calls": 2, "weight_casts": 100},
                "eval": {**phase, "weight_casts": eval_casts}, "head_casts_per_update_call": head}

    assert failures(rows(0, 1.0)) == []
    assert failures(rows(150, 1.0)) == []  # 50 weights x 3 calls: once each a call
    assert failures(rows(7011, 1.0)) == ["eval: 7011 weight casts over 3 generate calls of 50 float32 weights (at "
                                         "most one each a call)"]
    assert failures(rows(0, 3.0)) == ["the LM head: 3.0 casts per update call (at most 1)"]
