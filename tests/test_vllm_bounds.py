"""The vLLM tests' bounds (vllm_bounds.py) by device: on a CPU exactly the float32 bounds those tests held before
they knew their device (2 of the 100 fixed greedy completions, none of the 30, 24 or 16 the other comparisons
make; log-probs within 1e-5; a run's rollout_kl under 1e-9, its step-0 accuracy 0.16); on a card the bf16
engine's."""

import torch

import vllm_bounds


def test_on_a_cpu_the_float32_bounds_are_as_tight_as_before(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    limit = vllm_bounds.bounds()
    assert vllm_bounds.device().type == "cpu" and limit == vllm_bounds.BOUNDS[("cpu", torch.float32)]
    assert [limit.differing(n) for n in (100, 30, 24, 16)] == [2, 0, 0, 0] and limit.batch_variant(8) == 0
    assert (limit.tie, limit.logprob, limit.kept, limit.step_logprob_max, limit.step_kl) == (1e-4, 1e-5, 1e-5, 1e-4,
                                                                                              1e-9)
    assert limit.start_accuracy < 1e-6


def test_on_a_card_the_bounds_are_a_bf16_engines(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    limit = vllm_bounds.bounds()
    assert vllm_bounds.device().type == "cuda" and limit == vllm_bounds.BOUNDS[("cuda", torch.bfloat16)]
    # Above what a bf16 engine measured on the CPU (the module's docstring), below what a wrong engine gives.
    assert limit.differing(100) >= 7 and 0.036 < limit.tie < 1.0 and 0.17 < limit.logprob < 1.0
    assert 3.8e-5 < limit.step_kl < 1e-2 and 0.02 <= limit.start_accuracy < 0.1
