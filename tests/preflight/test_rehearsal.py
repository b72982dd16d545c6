"""The rehearsal's pieces: the shrink changes counts and says why (token-count reward args scaled with
the budget, fractions left to follow it), and the rehearsal model keeps the real model's vocabulary,
embeddings and special tokens while stopping at each EOS id at the calibrated rate under the configured
sampling (top-k included)."""

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen2Config

from dapo_train.config.load import load_config
from dapo_train.preflight import rehearsal
from dapo_train.rollout import DecodeLoopEngine, EngineSetup, SamplingSettings
from dapo_train.task.locations import TINY_MODEL_DIR


def test_the_shrink_changes_counts_only_and_says_why(tmp_path, monkeypatch):
    cfg = load_config(None, ["rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 32}}, "
                             "{name: overlong, args: {cache_length: 0.25, max_length: 64}}]", "model.dtype=bfloat16",
                             "train.num_threads=0"])
    monkeypatch.setattr(rehearsal, "cpu_has_bf16_units", lambda: False)
    small, changes = rehearsal.shrink(cfg, tmp_path / "model", tmp_path / "run", cuda=False)
    changed = {change.key: (change.old, change.new) for change in changes}
    assert small.rollout.max_new_tokens == 16 and changed["rollout.max_new_tokens"] == (96, 16)
    assert small.rewards[1].args["cache_length"] == 5  # 32 of 96 tokens -> 16/96 of it, rounded
    assert small.rewards[2].args == {"cache_length": 0.25, "max_length": 11}  # the fraction follows by itself
    assert changed["dapo.filter_metric"] == ("correct", "total")
    assert changed["model.dtype"] == ("bfloat16", "float32")
    assert small.model.name_or_path == str(tmp_path / "model") and small.output_dir == str(tmp_path / "run")
    assert (small.rollout.group_size, small.train.micro_batch_size) == (cfg.rollout.group_size,
                                                                        cfg.train.micro_batch_size)
    assert small.train.updates_per_step == 2 and small.eval.num_items == 4 and not small.eval.final_full
    monkeypatch.setattr(rehearsal, "cpu_has_bf16_units", lambda: True)
    kept, changes = rehearsal.shrink(cfg, tmp_path / "model", tmp_path / "run", cuda=False)
    assert kept.model.dtype == "bfloat16" and "model.dtype" not in {change.key for change in changes}
    plain, changes = rehearsal.shrink(load_config(None, ["dapo.dynamic_sampling=false"]), tmp_path, tmp_path, False)
    assert plain.dapo.filter_metric == "correct" and all(c.why for c in changes)
    screened, changes = rehearsal.shrink(load_config(None, ["dapo.screen_size=2"]), tmp_path, tmp_path, False)
    assert screened.dapo.screen_size == 2 and screened.dapo.screen_drop == ["all_right"]  # screens, then continues


def test_the_rehearsal_does_not_warn_about_its_own_regression_stop(tmp_path):
    """qwen1.5b.yaml stops a run that gets worse; the rehearsal's 2 steps on 4 eval items cannot judge one, so it
    rehearses without the stop (and says why in its changes) instead of warning that the stop cannot act."""
    from dapo_train.train.regression import stop_note

    cfg = load_config("configs/qwen1.5b.yaml", [])
    small, changes = rehearsal.shrink(cfg, tmp_path / "model", tmp_path / "run", cuda=False)
    assert stop_note(cfg) is None and stop_note(small) is None
    assert {change.key: change.new for change in changes}["eval.stop_on_regression"] is False


@pytest.mark.parametrize("tied, top_k", [(True, 0), (False, 50)])
def test_the_rehearsal_model_stops_at_each_eos_id_at_the_calibrated_rate(tmp_path, tied, top_k):
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    generation = GenerationConfig(eos_token_id=[552, 550], pad_token_id=550, repetition_penalty=1.05)
    config = Qwen2Config(vocab_size=600, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tied,
                         max_position_embeddings=1024)
    settings = SamplingSettings(16, temperature=0.9, top_k=top_k)
    model = rehearsal.build_model(config, generation, tokenizer, tmp_path, settings)
    assert model.config.vocab_size == 600 and model.config.tie_word_embeddings is tied  # 600 > tokenizer's 553
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (rehearsal.LAYERS, rehearsal.WIDTH)
    assert model.config.max_position_embeddings == 1024 and model.generation_config.eos_token_id == [552, 550]
    engine = DecodeLoopEngine(EngineSetup(model=model, tokenizer=tokenizer, batch_size=512, dtype="float32",
                                          compile="off"))
    torch.manual_seed(0)
    prompts = [tokenizer("小明有3个苹果", add_special_tokens=False)["input_ids"]] * 8
    completions = engine.generate(prompts, settings, group_size=32)  # 256 completions of at most 16 tokens
    ends = [int(c.completion_ids[-1]) for c in completions if not c.truncated]
    tokens = sum(c.length for c in completions)
    assert ends.count(552) > 20 and ends.count(550) > 20  # each EOS id ends completions
    rate = len(ends) / tokens  # stops per sampled token: 2 x EOS_RATE = 0.04 by construction
    assert 0.025 < rate < 0.06, rate
    assert any(c.truncated for c in completions) and len({c.length for c in completions}) > 8
