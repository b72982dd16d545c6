"""Measure the peak memory of one real code path on the CPU, for tests/preflight/test_memory.py.

    python tests/preflight/memory_probe.py '[{"path": "rollout", "model": {...}, ...}, ...]'

Runs in a fresh process started by the test, with glibc's malloc told to map every block of 64 KiB or more
on its own (MALLOC_MMAP_THRESHOLD_), so that a freed tensor leaves the resident set at once and the
resident high-water mark (VmHWM, reset through /proc/self/clear_refs) is the peak of what torch holds.
Each path runs once at a toy size first, so that lazy imports and first-call caches are in the baseline.
Prints one JSON line: per job, the high-water mark in bytes above the resident set before its model existed.

Paths (the code a run executes, on a random Qwen2 of the spec's shape):
- rollout: the rollout engine of `overrides` (rollout.*, model.dtype and model.lora keys) decoding `prompts`
  prompts of `prompt` tokens x rollout.group_size (its copy in rollout.dtype included)
- update: a micro-batch after the first: score_tokens and the DAPO loss, forward and backward, with the
  previous micro-batch's gradients held; `checkpointing`: gradient checkpointing on
- reward: a sequence classifier scoring `rows` texts of `prompt` tokens (rewards.model.last_token_scores)
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's package, not an installed one


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(spec: dict, classifier: bool = False, cfg=None):
    """A random Qwen2 of `spec`; with a config, in its model.dtype and with its LoRA adapters."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(**spec, num_labels=1, pad_token_id=0)
    model = (Qwen2ForSequenceClassification if classifier else Qwen2ForCausalLM)(config)
    if cfg is not None and cfg.model.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    if cfg is not None and cfg.model.lora.r > 0:
        from dapo_train.model.lora import apply_lora

        model = apply_lora(model, cfg.model.lora, "probe")
    return model


def _prompts(count: int, length: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (length,), generator=generator) for _ in range(count)]


def rollout(spec: dict, job: dict) -> None:
    from dapo_train.config.load import load_config
    from dapo_train.rollout.engines import build_engine
    from dapo_train.rollout.sampling import SamplingSettings

    cfg = load_config(None, job["overrides"])
    r = cfg.rollout
    model = _model(spec, cfg=cfg)
    engine = build_engine(r, model, tokenizer=None)
    settings = SamplingSettings(r.max_new_tokens, True, r.temperature, r.top_p, r.top_k)
    prompts = _prompts(job["prompts"], job["prompt"], spec["vocab_size"])
    engine.decode(engine.rollout_model, prompts, r.group_size, settings, eos_ids=[spec["vocab_size"] - 1], pad_id=0)


def update(spec: dict, job: dict) -> None:
    from dapo_train.algo import policy_loss
    from dapo_train.model.layout import collate
    from dapo_train.model.loading import enable_gradient_checkpointing
    from dapo_train.model.scoring import score_tokens

    model = _model(spec).train()
    if job.get("checkpointing"):
        enable_gradient_checkpointing(model)
    prompts = _prompts(job["rows"], job["prompt"], spec["vocab_size"])
    completions = _prompts(job["rows"], job["completion"], spec["vocab_size"])
    batch = collate(prompts, completions, pad_id=0)
    advantages = torch.linspace(-1, 1, job["rows"])
    for _ in range(2):  # the first micro-batch leaves its gradients: the second peaks as every later one
        logprobs, _entropy = score_tokens(model, batch, temperature=1.0, chunk_mib=job["chunk_mib"])
        loss, _metrics = policy_loss(logprobs, logprobs.detach(), advantages, batch.completion_mask, 0.2, 0.28)
        loss.backward()
        del logprobs, loss


def reward(spec: dict, job: dict) -> None:
    from dapo_train.rewards.model import last_token_scores

    model = _model(spec, classifier=True).eval().requires_grad_(False)
    ids = torch.stack(_prompts(job["rows"], job["prompt"], spec["vocab_size"]))  # (B, T)
    with torch.inference_mode():
        last_token_scores(model, model.score, ids, torch.ones_like(ids))


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


PATHS = {"rollout": rollout, "update": update, "reward": reward}
TOY = {"prompts": 1, "prompt": 4, "rows": 1, "completion": 2}


def measure(job: dict) -> int:
    """The high-water mark of one job above the resident set before its model existed, in bytes."""
    path, spec = PATHS[job["path"]], job["model"]
    path(spec, {**job, **TOY, "overrides": [*job.get("overrides", []), "rollout.max_new_tokens=2"]})
    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    path(spec, job)
    peak = _status("VmHWM") - base
    gc.collect()
    return peak


def main() -> None:
    torch.set_num_threads(1)
    print(json.dumps([measure(job) for job in json.loads(sys.argv[1])]))


if __name__ == "__main__":
    main()
