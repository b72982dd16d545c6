"""The CUDA-only paths a speed change can break, on the shipped tiny model: the chunked vocabulary
kernels on bf16 logits, and a short run with the CUDA defaults (bf16 autocast, gradient
checkpointing). Marked `gpu` and skipped without CUDA (`pytest -m gpu` selects them)."""

import pytest
import torch
from safetensors.torch import load_file

from dapo_train.config import load_config
from dapo_train.logprobs import entropy_from_logits, selected_logprobs
from dapo_train.metrics import read_metrics
from dapo_train.modeling import gradient_checkpointing, mixed_precision
from dapo_train.trainer import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_vocabulary_kernels_on_cuda_bf16_logits_match_float64():
    """Chosen-token log-probs, their gradient and the entropy from bf16 logits on the GPU equal the
    float64 reference of the same (bf16-rounded) logits to float32 precision."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 7, 1000, generator=g)).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 7), generator=g)
    weights = torch.randn(2, 7, generator=g)
    reference = logits.double().requires_grad_(True)
    expected = torch.log_softmax(reference, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (expected * weights.double()).sum().backward()
    ours = logits.cuda().requires_grad_(True)
    got = selected_logprobs(ours, ids.cuda(), chunk_size=5)
    (got * weights.cuda()).sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), expected.detach(), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.grad.double().cpu(), reference.grad, atol=1e-2, rtol=1e-2)  # grad is bf16
    probs = torch.softmax(reference.detach(), -1)
    entropy = -(probs * torch.log_softmax(reference.detach(), -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits.cuda(), 3).double().cpu(), entropy, atol=1e-4, rtol=0)


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
    assert 0.0 <= rows[-1]["accuracy"] <= 1.0
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
