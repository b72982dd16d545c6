"""LoRA through the peft library: adapters on the policy, the base as the reference, adapter checkpoints.

With model.lora.r > 0 the loaded model is wrapped in LoRA adapters (peft) and only they train, so
the optimizer holds a few million numbers instead of three copies of every weight. With
dapo.beta > 0 the reference policy is the same model inside `disable_adapter()`: the frozen base
weights, already in memory, instead of a second copy of them.

A LoRA run's checkpoint holds the adapter (adapter_model.safetensors, adapter_config.json), the
tokenizer, config.yaml and trainer_state.pt; its base model is config.yaml's model.name_or_path (a relative
path there is the folder the run started in's, found from wherever the checkpoint is read: _base_as_recorded).
Resume rebuilds the adapters from the config and loads their weights; eval loads base + adapter;
`dapo-train export --merge` folds them into a plain transformers folder.

Every name in model.lora.target_modules must match a layer peft can adapt: a typo in one of seven
names would otherwise train fewer layers without a word (peft only fails when none match).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from pathlib import Path

import torch

from dapo_train.config.load import CONFIG_FILE, read_saved_config
from dapo_train.config.schema import Config, LoraConfig
from dapo_train.errors import ConfigError, UserError
from dapo_train.task.locations import looks_like_path, resolve_model_path

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_HINT = "pip install 'dapo-train[lora]' (or pip install peft)"


def require_peft(why: str) -> None:
    """One UserError when peft cannot be imported; `why` says what needed it."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError(f"{why} needs the peft package, which is not installed: {PEFT_HINT}") from None


def check_lora_start(cfg: Config) -> None:
    """Before the run folder exists: a LoRA run needs peft; LoRA settings with r = 0 cannot act."""
    lora = cfg.model.lora
    if lora.r > 0:
        require_peft(f"model.lora.r={lora.r}")
        return
    inert = [f"model.lora.{name}" for name, value in vars(lora).items() if value != getattr(LoraConfig(), name)]
    if inert:
        logger.warning("%s set but model.lora.r=0 (LoRA off): they have no effect", ", ".join(inert))


# peft's warnings for an adapter on an embedding its model ties to the LM head: that the tie "can lead to
# complications" (wrapping, loading) and that each save holds the embedding layers. _say_tied says what they
# mean here instead.
_TIED_WARNING = r"Model has `tie_word_embeddings=True` and a tied layer is part of the adapter"
_SAVE_WARNING = r"Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`"


@contextlib.contextmanager
def _quiet_peft():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model; its
    FutureWarning says nothing the user can act on. Its warning about a tied embedding is _say_tied's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=_TIED_WARNING, category=UserWarning)
        yield


def _say_tied(model, model_name: str) -> None:
    """Where the adapter sits on an embedding or head the base ties into one weight (unties_embeddings), one line
    for what peft warns of: the adapted embedding and head differ, which the trainer keeps; and each checkpoint
    then holds the embedding's whole weight, whose save warning is left out from here on."""
    if not unties_embeddings(model):
        return
    base = model.get_base_model()
    tied = (base.get_input_embeddings(), base.get_output_embeddings())
    adapted = [name.rsplit(".", 1)[-1] for name, module in base.named_modules() if module in tied
               and any(module is layer for layer, _ in _adapted_layers(base).values())]
    embedding = _weight(tied[0])
    logger.info("LoRA on %s of %s, which ties its input embedding and LM head into one weight: the adapted embedding "
                "and head differ (each adds its own adapter's change), which a vLLM copy keeps and `dapo-train export "
                "--merge` writes untied; each checkpoint also holds the whole embedding weight (%.1f MB)",
                " and ".join(adapted), model_name, embedding.numel() * embedding.element_size() / 1e6)
    warnings.filterwarnings("ignore", message=_SAVE_WARNING, category=UserWarning)


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(folder: str | Path) -> str:
    """The base model an adapter folder was trained on: its config.yaml's model.name_or_path (a run's
    checkpoint; keeps builtin:tiny portable), else peft's adapter_config.json record."""
    folder = Path(folder)
    saved = folder / CONFIG_FILE
    if saved.is_file():
        config = read_saved_config(saved, notify=False)
        base = config.get("model", {}).get("name_or_path")
        if base:
            return _base_as_recorded(base, folder, config.get("output_dir"), saved)
    base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{folder}: {ADAPTER_CONFIG} does not name its base model (base_model_name_or_path)")
    return base


def _base_as_recorded(base: str, checkpoint: Path, output_dir: str | None, saved: Path) -> str:
    """`base` as a run's config.yaml records it. A relative local path is relative to the folder the run started
    in (_run_start), and read from there wherever the checkpoint is read; else from here, as given. A builtin, a
    hub id or an absolute path is as recorded."""
    path = Path(base).expanduser()
    if not looks_like_path(base) or path.is_absolute():
        return base
    start = _run_start(checkpoint.parent, output_dir)
    if start is not None and (start / path).exists():
        return str(start / path)
    if path.exists():
        return base
    where = f"the folder the run started in ({start}) nor " if start is not None else ""
    raise UserError(f"{saved} records the base model as {base!r}, a path relative to the folder the run started "
                    f"in, and neither {where}the current folder holds it; evaluate from that folder, or put the "
                    "base model's whole path in that config.yaml's model.name_or_path")


def _run_start(run_dir: Path, output_dir: str | None) -> Path | None:
    """The folder a run started in: its folder less the parts of its relative output_dir (outputs/run/ of a run
    with output_dir outputs/run started in the folder holding outputs/). None: output_dir is absolute, or no
    longer names the end of where the run is (the folder moved)."""
    if not output_dir or Path(output_dir).is_absolute():
        return None
    relative, here = Path(os.path.normpath(output_dir)).parts, Path(os.path.abspath(run_dir)).parts
    if ".." in relative or here[len(here) - len(relative):] != relative:
        return None
    return Path(*here[: len(here) - len(relative)])


def adaptable_layers(model: torch.nn.Module) -> list[str]:
    """Dotted names of the layers peft's LoRA can wrap (linear, embedding, GPT-2's Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    return [name for name, module in model.named_modules() if name and isinstance(module, kinds)]


def check_target_modules(model: torch.nn.Module, targets: list[str], model_name: str) -> None:
    """Every target matches some adaptable layer by name or dotted suffix (peft's rule), else one
    ConfigError naming the unmatched ones and the layer names the model has."""
    layers = adaptable_layers(model)
    unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in layers)]
    if unmatched:
        have = sorted({name.rsplit(".", 1)[-1] for name in layers})
        raise ConfigError(
            "model.lora.target_modules",
            f"{', '.join(unmatched)} {'matches' if len(unmatched) == 1 else 'match'} no linear or embedding layer "
            f"of {model_name}; its layers are named: {', '.join(have) or 'none'}",
        )


def apply_lora(model: torch.nn.Module, lora: LoraConfig, model_name: str):
    """Wrap `model` in trainable LoRA adapters (B = 0: the wrapped model computes what the base does);
    every other weight is frozen."""
    require_peft(f"model.lora.r={lora.r}")
    import peft

    check_target_modules(model, lora.target_modules, model_name)
    settings = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    with _quiet_peft():
        wrapped = peft.get_peft_model(model, settings)
    _say_tied(wrapped, model_name)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("LoRA r=%d on %s: %d trainable parameters of %d (%.2f%%)", lora.r,
                ", ".join(lora.target_modules), trainable, total, 100 * trainable / max(total, 1))
    return wrapped


def load_adapter_weights(model, checkpoint: Path) -> None:
    """Load a checkpoint's adapter weights into adapters built from the same settings (resume)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(checkpoint / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(model, saved)
    missing = [key for key in result.missing_keys if "lora_" in key]
    if result.unexpected_keys or missing:
        raise UserError(f"{checkpoint}: its adapter does not fit the adapters model.lora describes "
                        f"({len(missing)} missing, {len(result.unexpected_keys)} unexpected weights)")


def check_resume(cfg: Config, checkpoint: Path) -> None:
    """A resumed run keeps what its checkpoint's weights were trained as: its model (a LoRA adapter sits
    on that base; full weights are that model's, trained), LoRA on or off, the adapter's rank and layers
    (the optimizer state has their shapes). A model folder that no longer exists where the checkpoint
    says may be named anew (the run moved); alpha and dropout may change: they scale the same shapes."""
    saved = read_saved_config(checkpoint / CONFIG_FILE, notify=False).get("model", {})
    model = saved.get("name_or_path")
    if model is not None and model != cfg.model.name_or_path and _model_still_there(model):
        raise UserError(
            f"--resume {checkpoint}: model.name_or_path is {model!r} in the checkpoint and "
            f"{cfg.model.name_or_path!r} now; its weights were trained from {model!r}, so a run keeps its model "
            "(to train another model, start a new run)"
        )
    adapter = is_adapter_folder(checkpoint)
    if adapter != (cfg.model.lora.r > 0):
        held = "a LoRA adapter" if adapter else "full weights"
        raise UserError(
            f"--resume {checkpoint}: it holds {held}, but model.lora.r={cfg.model.lora.r}; a run keeps its "
            "model.lora.r (to train further with the other, start a new run from an exported model)"
        )
    if not adapter:
        return
    for key in ("r", "target_modules"):
        if key in saved.get("lora", {}) and saved["lora"][key] != getattr(cfg.model.lora, key):
            raise UserError(
                f"--resume {checkpoint}: model.lora.{key} is {saved['lora'][key]!r} in the checkpoint and "
                f"{getattr(cfg.model.lora, key)!r} now; the adapter's shapes cannot change when resuming"
            )


def _model_still_there(name_or_path: str) -> bool:
    """A builtin name, a hub id, or a local folder that exists (a path that is gone: the run moved)."""
    resolved = resolve_model_path(name_or_path)
    return Path(resolved).expanduser().exists() or not looks_like_path(resolved)


def attach_adapter(base: torch.nn.Module, folder: str, device: torch.device):
    """`base` (the model adapter_base names) with the folder's adapter on top, for inference: peft
    reads the adapter's own settings from adapter_config.json, so any peft LoRA adapter folder loads.
    Needs peft: check it with require_peft before loading the base."""
    from peft import PeftModel

    with _quiet_peft():
        return PeftModel.from_pretrained(base, folder).to(device)


def is_peft_model(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "merge_and_unload")


def _adapted_layers(base: torch.nn.Module) -> dict[str, tuple]:
    """{name of an adapted layer's base weight: (the layer, its active adapters)}: peft's linear layers keep their
    adapters in lora_A / lora_B, its embeddings in lora_embedding_A / lora_embedding_B."""
    layers = {}
    for name, module in base.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer") and not module.merged:
            adapters = [adapter for adapter in module.active_adapters
                        if adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {})]
            if adapters:
                layers[f"{name}.base_layer.weight"] = (module, adapters)
    return layers


def unties_embeddings(model: torch.nn.Module) -> bool:
    """A LoRA adapter sits on the input embedding or the LM head of a model that ties the two: the adapted model
    adds each one's delta in that layer's own forward, so its embedding and head differ and a copy of it elsewhere
    (a vLLM engine) must hold them apart. (peft's merge_and_unload folds the delta into the one shared weight.)"""
    if not is_peft_model(model):
        return False
    base = model.get_base_model()
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if head is None or _weight(embedding) is not _weight(head):
        return False
    layers = _adapted_layers(base)
    return any(module in (embedding, head) for module, _ in layers.values())


def _weight(module: torch.nn.Module) -> torch.Tensor:
    return getattr(module, "base_layer", module).weight


FSDP_WRAPPED = "_fsdp_wrapped_module"  # FSDP version 1's wrapper in the names of the layers it wraps


def merged_weights(model: torch.nn.Module):
    """(name, tensor) of every weight as the plain transformers model names it, a LoRA model's adapters folded
    in (W + alpha / r x B A, one layer at a time and leaving `model` as it is): what a copy of the model elsewhere
    (a vLLM engine) loads after each update, so that its forward is the adapted model's. Tied weights once,
    unless an adapter unties them (unties_embeddings): then the embedding and the head each with its own delta.
    Under FSDP, called while the weights are gathered (distributed.full_weights); version 1's wrapper names go."""
    base = model.get_base_model() if is_peft_model(model) else model
    layers = _adapted_layers(base)
    with torch.no_grad():
        for name, parameter in base.named_parameters(remove_duplicate=not unties_embeddings(model)):
            if ".lora_" in name:
                continue
            tensor = parameter.detach()
            if name in layers:
                module, adapters = layers[name]
                tensor = tensor + sum(module.get_delta_weight(adapter) for adapter in adapters).to(tensor.dtype)
            yield name.replace(".base_layer.", ".").replace(f"{FSDP_WRAPPED}.", ""), tensor
