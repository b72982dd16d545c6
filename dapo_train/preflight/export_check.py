"""Preflight's export check: the export of the rehearsal's last checkpoint, made as a user would
(`dapo-train export`, `--merge` for a LoRA run), must hold every trained tensor with its value, and
load in plain transformers with no tensor missing or left over.

The expected values are read from the checkpoint's own files, not through the loader the export uses:
a full checkpoint's tensors as saved; a LoRA checkpoint's base tensors with each adapted weight
W + scaling x B A (scaling alpha / r, or alpha / sqrt(r) with rsLoRA; an embedding's (B A)^T), from
adapter_model.safetensors and adapter_config.json; an adapted head that the base ties to its embedding is
its own tensor (the export unties it: run/export.py). A tensor the export lacks would otherwise load as a
fresh random one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dapo_train.errors import UserError

ADAPTER_PREFIX = "base_model.model."  # peft's prefix on the adapter's tensor names
TOLERANCE = 1e-5  # of a merged weight, relative to its largest entry: float32 rounding of B A


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, in float32."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({name: value.float() for name, value in load_file(str(file)).items()})
    return tensors


def expected_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights the checkpoint holds, as a merged export must hold them."""
    adapter_config = checkpoint / "adapter_config.json"
    if not adapter_config.is_file():
        return read_tensors(checkpoint)
    settings = json.loads(adapter_config.read_text())
    r, alpha = settings["r"], settings["lora_alpha"]
    scaling = alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r
    expected = read_tensors(Path(settings["base_model_name_or_path"]))
    adapter = read_tensors(checkpoint)
    for name, down in adapter.items():
        if ".lora_A." in name:  # a linear layer's: lora_A (r, in), lora_B (out, r)
            layer, delta = name.split(".lora_A.")[0], scaling * (adapter[name.replace(".lora_A.", ".lora_B.")] @ down)
        elif name.endswith(".lora_embedding_A"):  # an embedding's: A (r, vocab), B (hidden, r); W (vocab, hidden)
            layer, delta = name.removesuffix(".lora_embedding_A"), scaling * (adapter[name[:-1] + "B"] @ down).T
        else:
            continue
        target = layer.removeprefix(ADAPTER_PREFIX) + ".weight"
        # A head tied to the embedding is not in the base's files: peft saves the base weight of an adapted
        # embedding or head beside its adapter (save_embedding_layers); the export holds it untied, with its delta.
        base = expected.get(target, adapter.get(f"{layer}.base_layer.weight"))
        if base is None:
            raise UserError(f"{checkpoint}: the adapter on {target} has no base weight in its base model's files or "
                            "beside it, so its export cannot be checked")
        expected[target] = base + delta
    return expected


def check_export(checkpoint: Path, exported: Path) -> int:
    """Raise a UserError unless `exported` holds every tensor `checkpoint` trained, equal to it, and plain
    transformers loads it with no tensor missing or unexpected. -> tensors compared."""
    from transformers import AutoModelForCausalLM

    expected, found = expected_tensors(checkpoint), read_tensors(exported)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise UserError(f"the export lacks {len(missing)} of the {len(expected)} trained tensors: "
                        f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    for name, value in expected.items():
        gap = float((found[name] - value).abs().max()) if found[name].shape == value.shape else math.inf
        if gap > TOLERANCE * max(1.0, float(value.abs().max())):
            raise UserError(f"the export's {name} differs from the trained tensor (largest difference {gap:.3g})")
    _, info = AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
    odd = [f"{kind} {', '.join(sorted(names)[:3])}" for kind, names in
           (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"])) if names]
    if odd:
        raise UserError(f"transformers loads the export with tensors {'; '.join(odd)}")
    return len(expected)
