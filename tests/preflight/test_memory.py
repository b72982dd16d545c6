"""The memory estimate preflight prints (dapo_train.train.memory) against MEASURED peaks: the real code paths
(the rollout engines, an update micro-batch, a reward model's scoring) run on small random Qwen2 models in
one child process (tests/preflight/memory_probe.py: resident high-water marks), each shape chosen so that
the term under test is a large share of the peak, and the estimate must lie within 25% of the measurement
while the estimate without that term must not; then the recorded peaks of docs/benchmarks.md that the
current code still has (the H200 optimizer step, the CPU step at Qwen2.5-0.5B's shape)."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from dapo_train.config.load import load_config
from dapo_train.config.schema import LoraConfig
from dapo_train.model.lora import apply_lora
from dapo_train.train.memory import (
    GIB,
    ModelShape,
    RewardModelLoad,
    Setting,
    estimate,
    reward_model_loads,
)

import qwen_offline

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.25
SMALL = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
# KV_HEAVY: a small vocabulary (the per-step logits stay small) and 4 KiB of float32 keys and values per
# position (KV_WIDE: 8 KiB); HEAD_HEAVY: a 32,768 x 256 tied head whose (V, h) float32 gradient temporaries
# are most of an update's peak.
KV_HEAVY = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": True}
KV_WIDE = {**KV_HEAVY, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8}
HEAD_HEAVY = {**KV_HEAVY, "vocab_size": 32768, "hidden_size": 256, "num_hidden_layers": 2, "num_key_value_heads": 2}
DEEP = {**KV_HEAVY, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 8}
ROLLOUT = ["rollout.group_size=8", "train.prompts_per_step=8"]
JOBS = {
    # 64 rows x (64 + 64) positions of float32 keys and values: the KV cache is most of the peak
    "loop": {"path": "rollout", "model": KV_WIDE, "prompts": 8, "prompt": 64,
             "overrides": [*ROLLOUT, "rollout.max_new_tokens=64", "rollout.compile=off", "rollout.dtype=float32"]},
    # the static cache prefills all 64 rows of 256 prompt tokens, then decodes 8 tokens
    "static": {"path": "rollout", "model": KV_HEAVY, "prompts": 8, "prompt": 256,
               "overrides": [*ROLLOUT, "rollout.max_new_tokens=8", "rollout.compile=on", "rollout.dtype=float32"]},
    # a bfloat16 base with float32 LoRA adapters on every projection, prefilled as the static cache does
    "lora": {"path": "rollout", "model": KV_HEAVY, "prompts": 8, "prompt": 128,
             "overrides": [*ROLLOUT, "rollout.max_new_tokens=8", "rollout.compile=on", "rollout.dtype=bfloat16",
                           "model.dtype=bfloat16", "model.lora.r=8", "model.lora.target_modules=[q_proj, k_proj, "
                           "v_proj, o_proj, gate_proj, up_proj, down_proj]"]},
    "head": {"path": "update", "model": HEAD_HEAVY, "rows": 2, "prompt": 16, "completion": 32, "chunk_mib": 4},
    # 8 narrow layers over 8 x 256 positions: what the forward saves is most of the peak
    "activations": {"path": "update", "model": DEEP, "rows": 8, "prompt": 128, "completion": 128, "chunk_mib": 4},
    "reward": {"path": "reward", "model": KV_HEAVY, "rows": 16, "prompt": 256},
}


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    """Each job's peak in bytes, measured in one child process (one import of torch for all)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "preflight" / "memory_probe.py"),
                          json.dumps(list(JOBS.values()))], env=env, check=True, capture_output=True, text=True)
    return dict(zip(JOBS, json.loads(out.stdout.strip().splitlines()[-1])))


def _shape(spec: dict, **kwargs) -> ModelShape:
    return ModelShape.from_config(Qwen2Config(**spec), **kwargs)


def _probe_part(result, moment: str) -> int:
    """The moment less what the probe's process does not hold: AdamW state (no optimizer ran) and the process
    baseline (the probe measures above its own)."""
    return result.moments[moment] - result.terms["adamw state"] - result.terms["process baseline"]


def _rollout(job: dict, **shape_changes):
    cfg = load_config(None, job["overrides"])
    shape = dataclasses.replace(_shape(job["model"], lora=cfg.model.lora), **shape_changes)
    return estimate(shape, Setting.from_config(cfg, cuda=False, prompt_tokens=job["prompt"]))


def _update(job: dict):
    cfg = load_config(None, [f"train.micro_batch_size={job['rows']}", f"rollout.max_new_tokens={job['completion']}",
                             f"train.logprob_chunk_mib={job['chunk_mib']}", "train.shared_prefix=off"])
    return estimate(_shape(job["model"]), Setting.from_config(cfg, cuda=False, prompt_tokens=job["prompt"]))


def _within(estimated: int, measured: int) -> bool:
    return abs(estimated / measured - 1) < TOLERANCE


@pytest.mark.parametrize("job, term", [("loop", "kv cache"), ("static", "kv cache"), ("static", "prefill"),
                                       ("lora", "prefill")])
def test_a_rollout_peak_is_estimated_within_25_percent_and_not_without_its_kv_cache_or_prefill(measured, job, term):
    """The generate moment: weights, the rollout copy, the KV cache and the larger of the prefill and the
    per-step logits. The float32 loop's cache is 4 bytes an element (the estimate once fixed it at 2); a LoRA
    forward adds peft's float32 adapter outputs to the prefill."""
    result = _rollout(JOBS[job])
    estimated = _probe_part(result, "generate")
    assert _within(estimated, measured[job]), (estimated / GIB, measured[job] / GIB, result.terms)
    assert not _within(estimated - result.terms[term], measured[job]), (term, result.terms)
    if job == "loop":
        half = estimated - result.terms["kv cache"] // 2  # the cache counted at 2 bytes an element
        assert not _within(half, measured[job])
    if job == "lora":
        assert not _within(_probe_part(_rollout(JOBS[job], lora_mlp=False), "generate"), measured[job])


@pytest.mark.parametrize("job, term", [("head", "head backward"), ("activations", "activations")])
def test_an_update_micro_batch_peak_is_estimated_within_25_percent_and_not_without_its_term(measured, job, term):
    """A micro-batch after the first, forward and backward: weights, gradients, what the forward saved, the
    chunked head and its backward's (V, h) temporaries."""
    result = _update(JOBS[job])
    estimated = _probe_part(result, "backward")
    assert _within(estimated, measured[job]), (estimated / GIB, measured[job] / GIB, result.terms)
    assert not _within(estimated - result.terms[term], measured[job]), (term, result.terms)


def test_a_reward_models_scoring_is_estimated_within_25_percent_and_not_without_its_forward(measured):
    job = JOBS["reward"]
    model = RewardModelLoad(_shape(job["model"], classifier=True), 4, job["rows"] * job["prompt"])
    result = estimate(_shape(SMALL.to_dict()), Setting.from_config(load_config(None, []), cuda=False,
                                                                   reward_models=(model,)))
    estimated = result.terms["reward models"] + result.terms["reward forward"]
    assert _within(estimated, measured["reward"]), (estimated / GIB, measured["reward"] / GIB)
    assert not _within(result.terms["reward models"], measured["reward"])


def test_the_configured_reward_models_are_counted_from_their_config_at_their_dtype():
    """builtin:tiny-verifier as a config names it: its parameters exactly, bfloat16 on a CUDA card (dtype auto),
    float32 on the CPU, batch_size texts of at most the policy's prompt + completion tokens."""
    from transformers import AutoModelForSequenceClassification

    from dapo_train.task.locations import TINY_VERIFIER_DIR

    rewards = "rewards=[{name: accuracy}, {name: reward_model, args: {path: builtin:tiny-verifier, batch_size: 4}}]"
    cfg = load_config(None, [rewards])
    (cuda,) = reward_model_loads(cfg, cuda=True, sequence=300)
    (cpu,) = reward_model_loads(cfg, cuda=False, sequence=1000)
    verifier = AutoModelForSequenceClassification.from_pretrained(TINY_VERIFIER_DIR)
    assert cuda.shape.parameters == sum(p.numel() for p in verifier.parameters())
    assert (cuda.weight_bytes, cuda.tokens) == (2, 4 * 300)
    assert (cpu.weight_bytes, cpu.tokens) == (4, 4 * 512)  # its max_position_embeddings cut the texts
    assert reward_model_loads(load_config(None, []), cuda=True, sequence=300) == ()
    resident = estimate(ModelShape.from_config(SMALL), Setting.from_config(cfg, reward_models=(cuda,)))
    assert resident.terms["reward models"] == 2 * cuda.shape.parameters


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


def _qwen_shape(tmp_path, size: str) -> ModelShape:
    from transformers import AutoConfig

    qwen_offline.write_model_configs(tmp_path, size)
    return ModelShape.from_config(AutoConfig.from_pretrained(tmp_path))


def test_the_recorded_h200_optimizer_step_within_10_percent(tmp_path):
    """Issue 14's bench_step.py on one H200 (docs/benchmarks.md, CUDA): a random Qwen2.5-1.5B, float32 weights,
    bf16 autocast, gradient checkpointing, plain generate without a copy, one update of qwen1.5b-seed.yaml (2 x G=4,
    micro-batch 4), 128 completion tokens: peak 28.9 GiB (torch.cuda.max_memory_allocated). Its peak is the
    optimizer step (weights, gradients, AdamW state and the foreach step's sqrt(exp_avg_sq): 20 bytes a
    parameter), which the later changes (the chunked head, the rollout copy, the static cache) left as it was; the
    estimate of that step is the foreach one's (fused_step off: one process on a card now steps fused, with no
    temporaries, and its peak is then the backward's). Its 16 x G=8 figure (37.3 GiB) was the backward of the head
    before chunking, which no config runs now."""
    shape = _qwen_shape(tmp_path, "1.5b")
    cfg = load_config(str(ROOT / "configs" / "qwen1.5b-seed.yaml"), [
        "rollout.engine=hf-generate", "rollout.dtype=float32", "rollout.compile=off", "train.shared_prefix=off",
        "eval.every_steps=0", "eval.final_full=false", "train.micro_batch_tokens=0"])  # measured by count
    measured = dataclasses.replace(Setting.from_config(cfg, cuda=True, prompt_tokens=137), fused_step=False)
    result = estimate(shape, measured)
    assert result.peak_moment == "optimizer step"
    assert estimate(shape, Setting.from_config(cfg, cuda=True, prompt_tokens=137)).peak_moment != "optimizer step"
    assert abs(result.peak / GIB / 28.9 - 1) < 0.10, result.peak / GIB


def test_the_measured_cpu_peak_at_the_real_half_billion_shape_within_25_percent(tmp_path):
    """scripts/bench/bench_memory.py (one step of configs/qwen1.5b-seed.yaml, the seed trainer's settings that
    qwen1.5b.yaml had when it was measured, on a random Qwen2.5-0.5B, float32, the GSM8K-zh stand-in whose
    longest train prompt is 211 tokens, no eval): 11.44 GiB peak RSS (docs/benchmarks.md, Memory)."""
    shape = _qwen_shape(tmp_path, "0.5b")
    cfg = load_config(str(ROOT / "configs" / "qwen1.5b-seed.yaml"), ["model.dtype=float32", "eval.every_steps=0",
                                                                       "eval.final_full=false",
                                                                       "train.micro_batch_tokens=0"])  # by count
    peak = estimate(shape, Setting.from_config(cfg, cuda=False, prompt_tokens=211)).peak / GIB
    assert abs(peak / 11.44 - 1) < TOLERANCE, peak


LARGE_MINI_BATCH = ["train.prompts_per_step=64", "rollout.group_size=16", "train.updates_per_step=1"]


def test_a_token_budget_sets_the_update_terms_whatever_the_completion_length():
    """train.micro_batch_tokens wins over micro_batch_size: the backward's terms follow the budget, and at
    a fixed budget they do not follow rollout.max_new_tokens (without one they do)."""
    shape = _shape(DEEP)

    def terms(*overrides: str) -> dict:
        cfg = load_config(None, ["train.micro_batch_size=8", *LARGE_MINI_BATCH, *overrides])
        return estimate(shape, Setting.from_config(cfg, cuda=False, prompt_tokens=128)).terms

    update_terms = ("activations", "attention mask")
    short, long = (terms("train.micro_batch_tokens=4096", f"rollout.max_new_tokens={n}") for n in (64, 512))
    assert all(short[name] == long[name] > 0 for name in update_terms)
    assert terms("rollout.max_new_tokens=64")["activations"] < terms("rollout.max_new_tokens=512")["activations"]
    assert terms("train.micro_batch_tokens=8192")["activations"] == 2 * short["activations"]
    # a sequence longer than the budget is a micro-batch of its own: its positions are counted
    assert terms("train.micro_batch_tokens=256", "rollout.max_new_tokens=512")["activations"] == \
        terms("train.micro_batch_tokens=640", "rollout.max_new_tokens=512")["activations"]
    # a budget over what a mini-batch holds (2 groups x (16 x 64 + 128) = 2,304 tokens) counts the mini-batch
    small = ["train.prompts_per_step=2", "rollout.max_new_tokens=64"]
    assert terms(*small, "train.micro_batch_tokens=100000")["activations"] == \
        terms(*small, "train.micro_batch_tokens=2304")["activations"] < short["activations"]


def test_a_vllm_engine_is_counted_in_place_of_the_rollouts_generation_and_sleeps_through_the_update_on_cuda(
        tmp_path):
    """rollout.engine=vllm on qwen1.5b.yaml: on CUDA its share of the 48 GB card (0.3 x 48e9 bytes =
    14.4e9) at the generate and eval moments, no bf16 rollout copy and no generation terms of the trainer's
    model, and nothing in the backward (asleep); with rollout.vllm_kv_cache_mib its bf16 weights (P x 2)
    and that cache instead; on a CPU its float32 weights and KV cache all the time."""
    shape = _qwen_shape(tmp_path, "1.5b")
    path = str(ROOT / "configs" / "qwen1.5b.yaml")
    hf = estimate(shape, Setting.from_config(load_config(path, []), cuda=True, prompt_tokens=211))
    vllm = estimate(shape, Setting.from_config(load_config(path, ["rollout.engine=vllm"]), cuda=True,
                                               prompt_tokens=211))
    resident = sum(hf.terms[name] for name in ("weights", "adamw state"))
    assert vllm.terms["vllm engine"] == 14.4e9 and hf.terms["vllm engine"] == 0
    assert vllm.terms["rollout copy"] == vllm.terms["kv cache"] == vllm.terms["eval kv cache"] == 0
    assert vllm.moments["generate"] == resident + 14.4e9 == vllm.moments["eval"]
    assert vllm.moments["backward"] == hf.moments["backward"] - hf.terms["rollout copy"]  # no copy, engine asleep
    kv_set = load_config(path, ["rollout.engine=vllm", "rollout.vllm_kv_cache_mib=1024"])
    kv = estimate(shape, Setting.from_config(kv_set, cuda=True, prompt_tokens=211))
    assert kv.terms["vllm engine"] == shape.parameters * 2 + 2**30
    cpu = estimate(shape, Setting.from_config(load_config(path, ["rollout.engine=vllm"]), cuda=False,
                                              prompt_tokens=211))
    # 256 sequences x (256 + 512) positions x 28 layers x 2 (K, V) x 2 KV heads x 128 x 4 bytes
    assert cpu.terms["vllm engine"] == shape.parameters * 4 + 256 * 768 * 28 * 2 * 2 * 128 * 4
    assert cpu.moments["backward"] - estimate(shape, Setting.from_config(load_config(path, []), cuda=False,
                                                                         prompt_tokens=211)).moments["backward"] \
        == cpu.terms["vllm engine"]
