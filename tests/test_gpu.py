"""The CUDA-only paths a speed change can break, on the shipped tiny model: the chunked LM-head
kernel under bf16 autocast, the rollout's bf16 copy and compiled static-cache decode, a short
run with the CUDA defaults (bf16 autocast, gradient checkpointing, compiled bf16 rollout, its
mismatch measured, each step's peak memory recorded), and the reference scored like the policy under autocast;
then what only a card breaks (issue 58): a compile that fails (no C compiler for Triton) falling back to the
decode loop, and train.deterministic on CUDA (top-p refused; cuBLAS's workspace set).
Marked `gpu` and skipped without CUDA (`pytest -m gpu` selects them)."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from dapo_train.config.load import load_config
from dapo_train.evaluation.generate import eval_max_new_tokens, eval_records
from dapo_train.model.loading import gradient_checkpointing, mixed_precision
from dapo_train.model.scoring import head_logprobs
from dapo_train.run.files import read_jsonl
from dapo_train.run.logs import read_metrics
from dapo_train.train.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_lm_head_kernel_under_cuda_bf16_autocast_matches_float64():
    """Chosen-token log-probs and their gradients through the chunked LM head, under bf16 autocast
    on the GPU, equal the float64 reference of the same bf16-rounded operands to bf16 precision."""
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 1000, bias=False)
    hidden = torch.randn(2, 7, 64, generator=g)
    ids = torch.randint(0, 1000, (2, 7), generator=g)

    ref_hidden = hidden.bfloat16().double().requires_grad_(True)
    expected = torch.log_softmax(ref_hidden @ head.weight.detach().bfloat16().double().T, -1)
    expected = expected.gather(-1, ids[..., None])[..., 0]
    expected.sum().backward()
    head.cuda()
    ours = hidden.cuda().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, entropy = head_logprobs(head, ours, ids.cuda(), temperature=1.0, chunk_mib=0.01)
    got.sum().backward()
    assert got.dtype == torch.float32 and entropy.shape == (2, 7)
    torch.testing.assert_close(got.double().cpu(), expected.detach(), atol=1e-3, rtol=0)
    torch.testing.assert_close(ours.grad.double().cpu(), ref_hidden.grad, atol=2e-2, rtol=2e-2)


def test_the_cuda_rollout_samples_from_a_bf16_copy_with_the_compiled_static_cache():
    from dapo_train.model.loading import load_model, load_tokenizer
    from dapo_train.rollout import SamplingSettings, StaticCacheEngine, build_engine
    from dapo_train.task.prompts import load_prompts

    cfg = load_config(None, [])
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.train_split)
    model = load_model(cfg.model, torch.device("cuda"))
    engine = build_engine(cfg.rollout, model, tokenizer)  # auto: bf16 copy, compiled
    assert isinstance(engine, StaticCacheEngine) and next(engine.rollout_model.parameters()).dtype == torch.bfloat16
    for _ in range(2):  # a second call with the same shapes reuses the compiled step
        completions = engine.generate([p.input_ids for p in prompts[:6]], SamplingSettings(48), group_size=4)
        assert len(completions) == 24 and all(1 <= c.length <= 48 for c in completions)
        recorded = [c.behaviour_logprobs for c in completions]  # recorded while the compiled step ran
        assert all(r.shape == (c.length,) and bool(torch.isfinite(r).all() and (r <= 0).all())
                   for r, c in zip(recorded, completions))
    assert any(not c.truncated for c in completions)


def cpu_eval(cfg, model_path, uids: list[str]) -> list[bool]:
    """Each item's correctness under a plain float32 greedy eval of `model_path` on the CPU (no autocast, no
    bf16 copy, no compiled decode): the reference the CUDA run's evals are held to, item by item."""
    from dapo_train.model.loading import load_model, load_tokenizer
    from dapo_train.task.prompts import load_prompts

    model_cfg = dataclasses.replace(cfg.model, name_or_path=str(model_path))
    tokenizer = load_tokenizer(model_cfg)
    prompts = {p.uid: p for p in load_prompts(cfg.data, tokenizer, cfg.data.eval_split)[0]}
    records = eval_records(load_model(model_cfg, torch.device("cpu")), tokenizer, [prompts[uid] for uid in uids],
                           max_new_tokens=eval_max_new_tokens(cfg), batch_size=len(uids))
    return [record["correct"] for record in records]


def assert_eval_matches_the_cpu(run, cfg, rows, step: int, model_path) -> None:
    """The run's eval at `step`: its accuracy is its items' share correct, and those items are judged as the
    float32 CPU eval of the same weights judges them, but for at most one bf16 near-tie in 8."""
    items = read_jsonl(run / "eval_items" / f"step_{step}.jsonl")
    (row,) = [row for row in rows if row["step"] == step and "accuracy" in row]
    assert len(items) == cfg.eval.num_items and row["accuracy"] == pytest.approx(
        sum(item["correct"] for item in items) / len(items), abs=1e-12)
    on_cpu = cpu_eval(cfg, model_path, [item["uid"] for item in items])
    assert sum(item["correct"] != cpu for item, cpu in zip(items, on_cpu)) <= 1, (step, items, on_cpu)


def test_a_short_run_with_the_cuda_defaults(tmp_path):
    cfg = load_config(None, [
        "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.updates_per_step=2", "train.max_steps=2", "eval.every_steps=2", "eval.num_items=8",
        "logging.progress_bar=false", f"output_dir={tmp_path / 'run'}",
    ])
    assert mixed_precision(cfg, cuda=True) == "bf16" and gradient_checkpointing(cfg, cuda=True)
    run = train(cfg)
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert all(row["skipped_nonfinite"] == 0 for row in rows if "skipped_nonfinite" in row)
    # The evals under bf16 autocast judge the items as float32 on the CPU does: the shipped weights at step 0,
    # the trained ones at step 2.
    assert_eval_matches_the_cpu(run, cfg, rows, 0, cfg.model.name_or_path)
    assert_eval_matches_the_cpu(run, cfg, rows, 2, run / "checkpoint_2")
    # The bf16 compiled rollout is not the training forward: its mismatch is measured and corrected (tis).
    assert all(row["rollout_kl"] > 0 and row["old_logprob_rows"] > 0 for row in rows if "loss" in row)
    # Each step's peaks on the card (train/card_memory.py): the reserved memory holds the allocated.
    assert all(0 < row["cuda_peak_allocated_gib"] <= row["cuda_peak_reserved_gib"] for row in rows if "loss" in row)
    weights = load_file(run / "checkpoint_2" / "model.safetensors")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())  # fp32 master weights


def test_a_short_lora_run_with_the_cuda_defaults_and_a_bf16_base(tmp_path):
    """configs/qwen1.5b-lora.yaml's path on the tiny model: a bfloat16 frozen base with float32
    adapters, bf16 autocast, gradient checkpointing through peft, and the reference with adapters
    disabled (dapo.beta > 0)."""
    cfg = load_config(None, [
        "rollout.group_size=4", "rollout.max_new_tokens=48", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.updates_per_step=2", "train.max_steps=2", "eval.every_steps=2", "eval.num_items=8",
        "logging.progress_bar=false", "model.dtype=bfloat16", "model.lora.r=8", "train.learning_rate=1e-3",
        "dapo.beta=0.1", f"output_dir={tmp_path / 'run'}",
    ])
    run = train(cfg)
    rows = read_metrics(run)
    assert all(row["skipped_nonfinite"] == 0 for row in rows if "skipped_nonfinite" in row)
    assert any(row.get("kl", 0) > 0 for row in rows)
    adapter = load_file(run / "checkpoint_2" / "adapter_model.safetensors")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in adapter.values())


def test_the_reference_agrees_with_the_policy_under_cuda_autocast(tmp_path):
    """dapo.beta > 0 without LoRA: the reference is prepared like the policy (bf16 autocast), so at the
    first update, where the policy is the reference, their KL is 0."""
    cfg = load_config(None, [
        "rollout.group_size=4", "rollout.max_new_tokens=32", "train.prompts_per_step=2", "train.micro_batch_size=8",
        "train.updates_per_step=1", "train.max_steps=1", "eval.every_steps=0", "dapo.dynamic_sampling=false",
        "dapo.beta=0.1", "logging.progress_bar=false", f"output_dir={tmp_path / 'run'}",
    ])
    assert read_metrics(train(cfg))[0]["kl"] == pytest.approx(0.0, abs=1e-6)


FAILING_COMPILE = """
import logging, torch
from dapo_train.config.load import load_config
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rollout import SamplingSettings, StaticCacheEngine, build_engine
from dapo_train.task.prompts import load_prompts
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
cfg = load_config(None, [])
tokenizer = load_tokenizer(cfg.model)
prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.train_split)
engine = build_engine(cfg.rollout, load_model(cfg.model, torch.device("cuda")), tokenizer)
assert isinstance(engine, StaticCacheEngine)
for _ in range(2):
    completions = engine.generate([p.input_ids for p in prompts[:4]], SamplingSettings(32), group_size=4)
    assert len(completions) == 16 and all(1 <= c.length <= 32 for c in completions)
print("generated")
"""


def card_process(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    """A fresh process on the card (its compile caches in tmp_path, so nothing compiled before is reused)."""
    environment = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=environment)


def test_a_compile_that_fails_on_the_card_falls_back_to_the_decode_loop(tmp_path):
    """CC names a compiler that is not there: Triton cannot build the compiled step's launchers, the first
    generate call's compile fails, and the engine says so once and decodes with the decode loop (compiled.py).
    A failure raised as anything but torch's compile errors fails here with its traceback."""
    done = card_process(["-c", FAILING_COMPILE], tmp_path, CC="/nonexistent/cc")
    assert done.returncode == 0 and "generated" in done.stdout, done.stderr[-4000:]
    said = [line for line in done.stderr.splitlines() if "compiling the decode step failed" in line]
    assert len(said) == 1 and "the static-cache engine decodes eagerly from now on" in said[0], done.stderr[-4000:]


def test_deterministic_top_p_is_refused_on_the_card_and_without_it_a_run_sets_cublas(tmp_path):
    """The refusal's premise, then both sides: torch still has no deterministic float cumsum on CUDA; a run with
    train.deterministic and rollout.top_p < 1 stops at start in one line (exit 2); with top_p 1 it trains, with
    CUBLAS_WORKSPACE_CONFIG set for it (it was unset)."""
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="cumsum"):
            torch.ones(8, device="cuda").cumsum(0)
    finally:
        torch.use_deterministic_algorithms(False)
    small = ["rollout.group_size=4", "rollout.max_new_tokens=32", "train.prompts_per_step=2", "train.max_steps=1",
             "train.micro_batch_size=4", "eval.every_steps=0", "eval.final_full=false", "logging.progress_bar=false",
             "rewards=[{name: accuracy}, {name: overlong, args: {cache_length: 8}}]", "train.deterministic=true"]
    environment = {key: value for key, value in os.environ.items() if key != "CUBLAS_WORKSPACE_CONFIG"}
    refused = subprocess.run([sys.executable, "-m", "dapo_train", "run", *small, "rollout.top_p=0.9",
                              f"output_dir={tmp_path / 'top_p'}"], capture_output=True, text=True, timeout=600,
                             env=environment)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: config key 'train.deterministic': true with rollout.top_p=0.9 on CUDA"), refused.stderr[-3000:]
    ran = subprocess.run([sys.executable, "-m", "dapo_train", "run", *small, f"output_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=600, env=environment)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "CUBLAS_WORKSPACE_CONFIG=:4096:8" in ran.stderr
