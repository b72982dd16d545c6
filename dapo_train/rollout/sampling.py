"""The sampling distribution every engine samples from and records, and the token draw from it.

`SamplingSettings` is everything that shapes the distribution (temperature, top-k, top-p), passed to
each engine explicitly. `sampling_distribution` is the one definition of it: the behaviour log-prob of
a token is taken from `behaviour_distribution`, and under top-k / top-p the log of the mass the
truncation kept comes with it. A top_k of at least the vocabulary, or top_p 1, truncates nothing and is
no truncation. `draw_tokens` draws one token per row from it (the device's FULL_VOCABULARY_DRAWS entry
over the whole vocabulary); decoding.py's decode loop calls it at every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

Tensor = torch.Tensor


@dataclass(frozen=True)
class SamplingSettings:
    """Everything that shapes the sampling distribution, passed to generate explicitly."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def generation_config(self, eos_ids: list[int], pad_id: int):
        """A fresh GenerationConfig for `generate`: these settings and the stop ids, nothing else (a
        checkpoint's suppress_tokens, min_p, no_repeat_ngram_size, ... must not shape the rollout).
        Temperature, top-k and top-p are left neutral here: the BehaviourRecorder applies them itself,
        so generate samples from exactly the distribution it records."""
        from transformers import GenerationConfig

        neutral = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if self.do_sample else {}
        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=self.do_sample, eos_token_id=eos_ids,
                                pad_token_id=pad_id, **neutral)

    def truncates(self, vocab_size: int) -> bool:
        """Whether sampling drops any token of a vocabulary of this size: top_k below it, or top_p < 1."""
        return self.do_sample and (0 < self.top_k < vocab_size or self.top_p < 1.0)

    def warpers(self, vocab_size: int | None = None) -> LogitsProcessorList:
        """The logits warpers `generate` applies for these settings, in its order (temperature,
        top-k, top-p); an empty list for greedy decoding. A top_k of at least vocab_size keeps every
        token, so it is left out."""
        return LogitsProcessorList([*self._temperature(), *self._truncation(vocab_size)])

    def _temperature(self) -> list:
        from transformers import TemperatureLogitsWarper

        return [TemperatureLogitsWarper(self.temperature)] if self.do_sample and self.temperature != 1.0 else []

    def _truncation(self, vocab_size: int | None) -> list:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        if not self.do_sample:
            return []
        warpers = []
        if self.top_k > 0 and (vocab_size is None or self.top_k < vocab_size):
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers


def sampling_distribution(scores: Tensor, settings: SamplingSettings) -> tuple[Tensor, Tensor | None]:
    """The distribution an engine samples from and records, and what its truncation cut: the rollout
    model's raw logits (A, V), cast to float32, -> (log-probs (A, V): log_softmax(logits / temperature)
    after top-k / top-p truncation, renormalised, truncated tokens at -inf; greedy: log_softmax(logits);
    kept_log_mass (A,) <= 0: log of the probability the truncation kept, log Z = logsumexp(kept
    logits / T) - logsumexp(logits / T), so that a token's log-prob before truncation is its log-prob
    plus it; None when nothing is truncated)."""
    scaled = LogitsProcessorList(settings._temperature())(None, scores)  # (A, V)
    truncation = settings._truncation(scores.shape[-1])
    if not truncation:
        return torch.log_softmax(scaled, dim=-1), None
    kept = LogitsProcessorList(truncation)(None, scaled)  # (A, V), -inf where cut
    return torch.log_softmax(kept, dim=-1), torch.logsumexp(kept, dim=-1) - torch.logsumexp(scaled, dim=-1)


def behaviour_distribution(scores: Tensor, settings: SamplingSettings) -> Tensor:
    """The log-probs (A, V) of sampling_distribution: what an engine samples from and records."""
    return sampling_distribution(scores, settings)[0]


def draw_tokens(distribution: Tensor, top_k: int = 0, generators: Sequence[torch.Generator] | None = None) -> Tensor:
    """One token per row from a behaviour distribution, log-probs (A, V) -> (A,) ids: the categorical
    distribution that generate's multinomial draws from (truncated tokens, at -inf, are never drawn).

    Under top-k truncation only the k largest entries of a row are finite (more only when values tie
    at the k-th), so the draw runs over those k alone (Gumbel-max over k candidates). Over the whole
    vocabulary the draw is the device's FULL_VOCABULARY_DRAWS entry: at Qwen's 151,936 ids an
    exponential per entry (Gumbel-max) was most of a CPU decode step, and the inverse-CDF draw is the
    same distribution at a fraction of the cost there (docs/benchmarks.md, scripts/bench/bench_draw.py).
    generators: one per row, each row's exponentials drawn from its own over the whole vocabulary
    (Gumbel-max), so that a row's token does not depend on the other rows of the batch: keyed draws
    (dapo.screen_size), at the cost of an exponential per entry."""
    if generators is not None:
        noise = torch.stack([torch.empty(distribution.shape[-1], device=distribution.device).exponential_(
            generator=generator) for generator in generators])  # (A, V)
        return (distribution - noise.log()).argmax(dim=-1)
    if 0 < top_k < distribution.shape[-1]:
        values, indices = distribution.topk(top_k + 1, dim=-1)  # (A, k + 1), largest first
        if not bool(torch.isfinite(values[:, -1]).any()):  # no tie beyond the k-th: these k are all there is
            picked = gumbel_max_draw(values[:, :-1])  # (A,)
            return indices.gather(-1, picked[:, None])[:, 0]
    return FULL_VOCABULARY_DRAWS.get(distribution.device.type, gumbel_max_draw)(distribution)


def gumbel_max_draw(distribution: Tensor) -> Tensor:
    """argmax(log p - log E) with E ~ Exp(1) per entry: log-probs (A, V) -> (A,) ids, exactly
    categorical(p); an exponential per entry."""
    return (distribution - torch.empty_like(distribution).exponential_().log()).argmax(dim=-1)


def inverse_cdf_draw(distribution: Tensor) -> Tensor:
    """Inverse-CDF sampling in two levels: log-probs (A, V) -> (A,) ids, categorical(p) with each
    token's probability exact to float32 rounding (relative), two uniforms per row.

    A float32 cumulative sum over the whole vocabulary is not exact: a token whose probability is below
    half a unit in the last place of the running sum (3e-8 near 1) adds nothing to it and is never
    drawn, and a vocabulary's long tail is such tokens. So the V probabilities are summed in blocks of
    about sqrt(V) (one pass, each block's sum exact to float32 rounding relative to it), a block is
    drawn from the float64 cumulative sum of the block sums, then a token of that block from the
    float64 cumulative sum of its entries: float64 only on (A, sqrt(V)) tensors."""
    probs = distribution.exp()  # (A, V), 0 where truncated
    rows, vocab = probs.shape
    width = math.isqrt(vocab - 1) + 1  # block size, ceil(sqrt(V))
    full = vocab // width * width
    sums = probs[:, :full].view(rows, -1, width).sum(dim=-1)  # (A, V // width)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(dim=-1, keepdim=True)], dim=-1)  # the short last block
    block = _inverse_cdf(sums.double())  # (A,)
    columns = block[:, None] * width + torch.arange(width, device=probs.device)  # (A, width)
    inside = columns < vocab
    weights = probs.gather(-1, columns.clamp(max=vocab - 1)).double() * inside  # (A, width)
    return (block * width + _inverse_cdf(weights)).clamp(max=vocab - 1)  # the clamp acts on unusable rows only


def _inverse_cdf(weights: Tensor) -> Tensor:
    """weights (A, K) >= 0, float64, each row with a positive entry -> (A,) index i with probability
    weights[i] / sum: the first i whose cumulative sum exceeds u ~ U[0, sum). u is kept strictly below
    the row's total, so i < K, and an entry of weight 0 never raises the cumulative sum, so it is never
    the first to exceed u: a zero-probability (truncated) token is never drawn. A row with no usable
    weight (NaN or inf from diverged weights) gets some index below K, as Gumbel-max's argmax gives one:
    the step's non-finite loss then stops it (train/health.py), not an index error here."""
    cumulative = weights.cumsum(dim=-1)  # (A, K)
    total = cumulative[:, -1:]  # (A, 1)
    uniform = torch.rand(total.shape, dtype=total.dtype, device=total.device) * total
    uniform = torch.minimum(uniform, total.nextafter(torch.zeros_like(total)))  # rounding could reach the total
    return torch.searchsorted(cumulative, uniform, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


# The full-vocabulary draw per device type (draw_tokens); Gumbel-max where none is named. The inverse-CDF
# draw measured 5-10x cheaper on the CPU at Qwen's vocabulary; scripts/bench/bench_cuda.sh times both on CUDA.
FULL_VOCABULARY_DRAWS = {"cpu": inverse_cdf_draw}
