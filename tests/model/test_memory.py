"""The memory estimate preflight prints (dapo_train.model.memory): its counts by hand on a small model, each
setting moving the term it claims, and the recorded peaks it must reproduce within 15%: the two H200
figures of docs/benchmarks.md (issue 14, the code before the chunked LM head) and the CPU peak at
Qwen2.5-0.5B's real shape measured by scripts/bench_memory.py."""

import dataclasses
from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_train.config.load import load_config
from dapo_train.config.schema import LoraConfig
from dapo_train.model.lora import apply_lora
from dapo_train.model.memory import BASELINE_CPU_BYTES, GIB, ModelShape, Setting, estimate

import qwen_offline

ROOT = Path(__file__).resolve().parents[2]
SMALL = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def _qwen_shape(tmp_path, size: str) -> ModelShape:
    from transformers import AutoConfig

    qwen_offline.write_model_configs(tmp_path, size)
    return ModelShape.from_config(AutoConfig.from_pretrained(tmp_path))


def test_the_shape_counts_what_the_model_holds_and_lora_what_peft_trains():
    model = Qwen2ForCausalLM(SMALL)
    shape = ModelShape.from_config(SMALL)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    # one layer: q 64x64+64, k and v 64x32+32 each, o 64x64, gate/up/down 3 x 64x128, two norms; plus the
    # tied embedding 1000x64 and the final norm
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert shape.parameters == 2 * layer + 1000 * 64 + 64
    assert (shape.kv_heads, shape.head_dim) == (2, 16)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    wrapped = apply_lora(model, lora, "small")
    assert ModelShape.from_config(SMALL, lora).trainable == sum(p.numel() for p in wrapped.parameters()
                                                                if p.requires_grad) == 2 * 4 * ((64 + 64) + (64 + 32))


def test_each_setting_moves_its_term():
    shape = ModelShape.from_config(SMALL)
    cfg = load_config(None, [])
    cuda = Setting.from_config(cfg, cuda=True)
    cpu = Setting.from_config(cfg, cuda=False)
    p = shape.parameters
    on_cuda, on_cpu = estimate(shape, cuda).terms, estimate(shape, cpu).terms
    assert on_cuda["rollout copy"] == 2 * p and on_cpu["rollout copy"] == 0  # rollout.dtype auto: bf16 on CUDA
    assert on_cuda["autocast casts"] == 2 * p and on_cpu["autocast casts"] == 0
    assert on_cpu["process baseline"] == BASELINE_CPU_BYTES and on_cuda["process baseline"] == 0
    bf16 = estimate(shape, Setting.from_config(load_config(None, ["model.dtype=bfloat16"]), cuda=True)).terms
    assert bf16["weights"] == 2 * p and bf16["rollout copy"] == 0 and bf16["autocast casts"] == 0
    shared = estimate(shape, dataclasses.replace(cuda, shards=4)).terms
    assert shared["adamw state"] == 8 * p // 4 and shared["gathered weights"] == 4 * p
    longer = Setting.from_config(load_config(None, ["rollout.max_new_tokens=192"]), cuda=True)
    assert estimate(shape, longer).terms["kv cache"] > on_cuda["kv cache"]
    assert estimate(shape, longer).terms["activations"] > on_cuda["activations"]
    deep = dataclasses.replace(shape, layers=8)  # with 2 layers, recomputing one costs what it saves
    checkpointed = Setting.from_config(load_config(None, ["model.gradient_checkpointing=on"]), cuda=False)
    assert estimate(deep, checkpointed).terms["activations"] < estimate(deep, cpu).terms["activations"]
    reference = estimate(shape, Setting.from_config(load_config(None, ["dapo.beta=0.1"]), cuda=True)).terms
    assert reference["reference"] == 4 * p and on_cuda["reference"] == 0


@pytest.mark.parametrize("micro, rows, measured_gib", [(4, 8, 28.9), (32, 128, 37.3)])
def test_the_recorded_h200_peaks_within_15_percent(tmp_path, micro, rows, measured_gib):
    """Issue 14's bench_step.py on a random Qwen2.5-1.5B (float32 weights, bf16 autocast, gradient
    checkpointing, no rollout copy, plain generate, the full-logits head), prompts of the tiny task
    (137 tokens on average) and 128 completion tokens, at 2 x G=4 / micro-batch 4 and 16 x G=8 /
    micro-batch 32: peaks of 28.9 and 37.3 GiB (torch.cuda.max_memory_allocated)."""
    shape = _qwen_shape(tmp_path, "1.5b")
    setting = Setting(cuda=True, weight_bytes=4, autocast=True, checkpointing=True, rollout_copy=False,
                      reference=False, micro_rows=micro, completion=128, tokens=micro * (137 + 128), generate_rows=rows,
                      sequence=137 + 128, chunk_mib=64, old_head=True)
    peak = estimate(shape, setting).peak / GIB
    assert abs(peak / measured_gib - 1) < 0.15, peak


def test_the_measured_cpu_peak_at_the_real_half_billion_shape_within_15_percent(tmp_path):
    """scripts/bench_memory.py (one step of configs/qwen1.5b.yaml on a random Qwen2.5-0.5B, float32, the
    GSM8K-zh stand-in whose longest train prompt is 211 tokens): 11.44 GiB peak RSS (docs/benchmarks.md)."""
    shape = _qwen_shape(tmp_path, "0.5b")
    cfg = load_config(str(ROOT / "configs" / "qwen1.5b.yaml"), ["model.dtype=float32"])
    peak = estimate(shape, Setting.from_config(cfg, cuda=False, prompt_tokens=211)).peak / GIB
    assert abs(peak / 11.44 - 1) < 0.15, peak
