"""Loading the policy (and optional reference) model and its tokenizer, with clear errors.

Real-model paths stay real: a hub id or a local folder goes through the Auto classes; the shipped
tiny model is just another local folder (builtin:tiny). Weights load as safetensors and remote
code stays off unless the config turns it on.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dapo_train.config import Config, ModelConfig, looks_like_path, resolve_model_path
from dapo_train.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_path(name_or_path: str) -> str:
    """Resolve builtin names; a path-like value that does not exist is an error now, not later.

    An existing folder is local; `name` or `org/name` that is not a folder is a hub id; anything else
    (./x, /x, ~/x, a/b/c) is a local path that must exist.
    """
    resolved = resolve_model_path(name_or_path)
    local = Path(resolved).expanduser()
    if local.is_dir():
        return str(local)
    if looks_like_path(resolved):
        raise UserError(f"model.name_or_path: folder not found: {resolved}")
    return resolved


def load_tokenizer(model_cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = check_model_path(model_cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as exc:
        raise UserError(_unreachable(path, exc)) from None
    if tokenizer.chat_template is None:
        raise UserError(f"the tokenizer of {path} has no chat template; use an instruct/chat model")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_cfg: ModelConfig, device: torch.device):
    """The policy in training dtype: float32 on CPU; on CUDA `auto` keeps float32 master weights
    and lets bf16 autocast do the matmuls."""
    from transformers import AutoModelForCausalLM

    path = check_model_path(model_cfg.name_or_path)
    dtype = torch.float32 if model_cfg.dtype == "auto" else DTYPES[model_cfg.dtype]
    kwargs = {"dtype": dtype, "trust_remote_code": model_cfg.trust_remote_code, "use_safetensors": None}
    if model_cfg.attn_implementation:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise UserError(_unreachable(path, exc)) from None
    return model.to(device)


def _unreachable(path: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"could not load model '{path}' ({first[:200]}); without network access, download it elsewhere "
        "and set model.name_or_path to the local folder (e.g. ./Qwen2.5-1.5B-Instruct)"
    )


# model.gradient_checkpointing -> whether to recompute activations, given CUDA.
GRADIENT_CHECKPOINTING = {"auto": lambda cuda: cuda, "on": lambda cuda: True, "off": lambda cuda: False}


def gradient_checkpointing(cfg: Config, cuda: bool) -> bool:
    """model.gradient_checkpointing resolved: "auto" is on for CUDA."""
    return GRADIENT_CHECKPOINTING[cfg.model.gradient_checkpointing](cuda)


def mixed_precision(cfg: Config, cuda: bool) -> str:
    """train.mixed_precision resolved: "auto" is bf16 on CUDA and none on CPU."""
    if cfg.train.mixed_precision == "auto":
        return "bf16" if cuda else "no"
    return cfg.train.mixed_precision
