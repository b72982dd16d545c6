"""`dapo-train export CHECKPOINT [--merge] -o DIR`: a checkpoint as a folder other tools load.

- A LoRA checkpoint with --merge: the adapter folded into its base (W + alpha / r * B A) and
  written as a plain transformers folder (model.safetensors, config.json, generation_config.json,
  the tokenizer) that AutoModelForCausalLM.from_pretrained and vLLM load with no peft installed.
  Adapters on the input embedding or an LM head tied to it: the model is written untied (_merged).
- A LoRA checkpoint without --merge: the adapter alone (adapter_model.safetensors and an
  adapter_config.json naming its base) with the tokenizer, for peft or a server's LoRA support.
- A full checkpoint: the plain folder, without the trainer state (--merge has nothing to merge).

Weights are written in --dtype: float32 (the training master weights, exact) unless told
otherwise; bfloat16 halves the folder. The folder is written beside DIR and renamed into place,
and an existing, non-empty DIR is never replaced (nor is DIR the current folder, home, the root, or
around or inside the checkpoint: run/outputs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch

from dapo_train.config.load import CONFIG_FILE, load_config, read_saved_config
from dapo_train.config.schema import ModelConfig
from dapo_train.errors import UserError
from dapo_train.model.loading import DTYPES, load_model
from dapo_train.model.lora import is_adapter_folder, merged_weights, require_peft, unties_embeddings
from dapo_train.run.checkpoint import usual_file_modes
from dapo_train.run.outputs import OutputKind, holds_own, mark

logger = logging.getLogger(__name__)

# An export's folder (run/outputs.py): written whole or not at all, never replaced; its marker says so and
# lists what it holds (all that a `preflight --keep` may remove of its own export).
EXPORTED = OutputKind("dapo-train export folder", ".dapo-train-export", listed=True)


def _check_paths(source: Path, target: Path, dtype: str) -> bool:
    """Everything that can be wrong before a model loads. -> whether `source` is a LoRA adapter."""
    if not source.is_dir():
        raise UserError(f"checkpoint not found: {source}")
    adapter = is_adapter_folder(source)
    if not adapter and not (source / "config.json").is_file():
        raise UserError(f"{source} is not a checkpoint or model folder (no config.json or adapter_config.json)")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: allowed: {', '.join(DTYPES)}")
    if holds_own(target, EXPORTED, option="-o", inputs={f"the checkpoint {source}": source}):
        raise UserError(f"-o {target} already exists and is not empty (an earlier export, never replaced); choose "
                        "another folder or remove it (nothing was changed)")
    if adapter:
        require_peft(f"{source} is a LoRA adapter checkpoint; exporting it")
    return adapter


def _model_settings(source: Path) -> ModelConfig:
    """How to load `source`: its run's model settings (dtype, remote code) when it has a config.yaml."""
    saved = source / CONFIG_FILE
    model_cfg = ModelConfig()
    if saved.is_file():
        model_cfg = load_config(None, [], base=read_saved_config(saved, notify=False)).model
    return dataclasses.replace(model_cfg, name_or_path=str(source), dtype="auto")


def _merged(model, source: Path):
    """The LoRA model as a plain transformers model, its adapters folded in. peft's merge_and_unload folds an
    adapter on an input embedding or LM head that the base ties to the other into the one weight they share,
    which then carries the change to both; such a model is untied instead (its own head weight), each weight with
    its own adapter's change, as the vLLM engine loads it (lora.merged_weights)."""
    if not unties_embeddings(model):
        return model.merge_and_unload()
    weights = dict(merged_weights(model))
    plain = model.unload()
    plain.config.tie_word_embeddings = False
    plain.load_state_dict(weights, strict=True, assign=True)  # each layer its own tensor: no longer one shared
    logger.info("%s: the adapter changes the input embedding or the LM head, which the base model ties into one "
                "weight; the merged model is written untied (tie_word_embeddings false, its own LM head weight) so "
                "that each keeps its own change", source)
    return plain


def export_checkpoint(checkpoint: str, out: str, merge: bool = False, dtype: str = "float32") -> Path:
    """Write the export of `checkpoint` to `out`; returns its path."""
    from transformers import AutoTokenizer

    source, target = Path(checkpoint).expanduser(), Path(out).expanduser()
    adapter = _check_paths(source, target, dtype)
    if merge and not adapter:
        logger.warning("--merge: %s holds full weights, not a LoRA adapter; there is nothing to merge", source)
    model = load_model(_model_settings(source), torch.device("cpu"))
    if adapter and merge:
        model = _merged(model, source)
    model = model.to(DTYPES[dtype])
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        mark(tmp, EXPORTED)
        usual_file_modes(tmp)
        if target.is_dir():
            target.rmdir()  # empty (checked above)
        os.replace(tmp, target)
    except OSError as exc:
        raise UserError(f"could not write {target}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kind = "merged model" if adapter and merge else "LoRA adapter" if adapter else "model"
    print(f"wrote {target}: {kind} ({dtype}) and tokenizer", flush=True)
    return target
