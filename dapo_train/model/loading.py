"""Loading the policy (and optional reference) model and its tokenizer, with clear errors.

Real-model paths stay real: a hub id or a local folder goes through the Auto classes; the shipped
tiny model is just another local folder (builtin:tiny). Weights load as safetensors and remote
code stays off unless the config turns it on. A hub id is checked with one short request first,
so a machine without network fails in seconds with one line (or uses the cached copy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
from pathlib import Path

import huggingface_hub
import torch
from safetensors import SafetensorError

from dapo_train.config.schema import Config, ModelConfig
from dapo_train.errors import ConfigError, UserError, folder_listing
from dapo_train.model import lora
from dapo_train.task import locations
from dapo_train.task.locations import looks_like_path, resolve_model_path

logger = logging.getLogger(__name__)

LOCAL_MODEL_HINT = (
    "download it where there is network (`hf download <id> --local-dir ./<name>`) and set model.name_or_path "
    "to that folder (e.g. ./Qwen2.5-1.5B-Instruct)"
)
MODEL_REPO = locations.RepoKind("model", "model.name_or_path", local="folder", existing="folder", hint=LOCAL_MODEL_HINT)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What makes a folder loadable: a transformers model, or a LoRA adapter on its base (lora.py).
MODEL_FILES = ("config.json", lora.ADAPTER_CONFIG)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# What a damaged or mismatched model folder makes transformers (and safetensors) raise.
LOAD_ERRORS = (OSError, ValueError, TypeError, KeyError, RuntimeError, ImportError, SafetensorError)
# model.attn_implementation -> (the module it imports, its pip package), for kernels not built into torch.
ATTENTION_KERNELS: dict[str, tuple[str, str] | None] = {
    "sdpa": None, "eager": None, "flex_attention": None,
    "flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}


def check_model_path(name_or_path: str, kind: locations.RepoKind = MODEL_REPO) -> str:
    """Resolve builtin names; a path-like value that does not exist is an error now, not later.

    An existing folder is local and must hold a model (config.json) or a LoRA adapter; `name` or
    `org/name` that is not a folder is a hub id; anything else (./x, /x, ~/x, a/b/c) is a local path
    that must exist. kind.key names the setting in the messages (model.name_or_path, a reward model's
    rewards.<i>.args.path).
    """
    resolved = resolve_model_path(name_or_path, kind.key)
    local = Path(resolved).expanduser()
    if local.is_dir():
        if not any((local / name).is_file() for name in MODEL_FILES):
            raise UserError(
                f"{kind.key} {resolved} is not a model folder (no {' or '.join(MODEL_FILES)}); "
                f"{folder_listing(local)}"
            )
        _check_json_files(local)
        return str(local)
    if local.exists():
        raise UserError(f"{kind.key} {resolved} is a file; give the folder that holds config.json")
    if looks_like_path(resolved):
        raise UserError(f"{kind.key}: folder not found: {resolved}")
    return resolved


def _check_json_files(folder: Path) -> None:
    """The folder's JSON settings parse, each an object: transformers skips a damaged
    generation_config.json without a word (and with it the EOS ids it lists)."""
    for name in (*MODEL_FILES, "generation_config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            where = f":{exc.lineno}:{exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
            problem = getattr(exc, "msg", exc)
            raise UserError(f"{path}{where} is not valid JSON ({problem}); repair or replace it") from None
        if not isinstance(data, dict):
            raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object of settings")


def load_tokenizer(model_cfg: ModelConfig):
    from transformers import AutoTokenizer

    path = check_model_path(model_cfg.name_or_path)
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {folder_listing(folder)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=model_cfg.trust_remote_code, **hub_load_kwargs(path)
        )
    except LOAD_ERRORS as exc:
        raise UserError(unreachable_message(path, exc, "tokenizer")) from None
    if tokenizer.chat_template is None:
        raise UserError(f"the tokenizer of {path} has no chat template; use an instruct/chat model")
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_cfg: ModelConfig, device: torch.device):
    """The policy in training dtype: float32 on CPU; on CUDA `auto` keeps float32 master weights
    and lets bf16 autocast do the matmuls. A LoRA adapter folder (a LoRA run's checkpoint) loads as
    its base model with the adapter on top (_load_adapter_model)."""
    from transformers import AutoModelForCausalLM

    path = check_model_path(model_cfg.name_or_path)
    if lora.is_adapter_folder(path):
        return _load_adapter_model(model_cfg, path, device)
    dtype = torch.float32 if model_cfg.dtype == "auto" else DTYPES[model_cfg.dtype]
    kwargs = {
        "dtype": dtype, "trust_remote_code": model_cfg.trust_remote_code, "use_safetensors": None,
        **hub_load_kwargs(path),
    }
    if model_cfg.attn_implementation:
        check_attention_kernel(model_cfg.attn_implementation, device)
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    try:
        if not model_cfg.keep_dropout:
            kwargs["config"] = _config_without_dropout(path, kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except LOAD_ERRORS as exc:
        raise UserError(unreachable_message(path, exc)) from None
    return model.to(device)


def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX); without them torch emulates
    bf16 matmuls, far slower than float32."""
    cpu = torch.cpu
    return any(bool(getattr(cpu, probe, lambda: False)()) for probe in ("_is_avx512_bf16_supported",
                                                                          "_is_amx_tile_supported"))


def check_attention_kernel(name: str, device: torch.device) -> None:
    """A flash-attention kernel needs its package and CUDA: say so before the weights load (transformers
    would raise mid-load)."""
    needs = ATTENTION_KERNELS[name]
    if needs is None:
        return
    module, package = needs
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            "model.attn_implementation", f"{name} needs the {package} package, which is not installed: pip install "
            f"{package}, or use sdpa"
        )
    if device.type != "cuda":
        raise ConfigError("model.attn_implementation", f"{name} runs on CUDA only, not on {device.type}; use sdpa")


def load_model_config(model_cfg: ModelConfig):
    """The model's transformers config (config.json) and its generation config (None when it has no
    generation_config.json), read without its weights; an adapter folder's are its base model's."""
    from transformers import AutoConfig, GenerationConfig

    path = check_model_path(model_cfg.name_or_path)
    if lora.is_adapter_folder(path):
        path = check_model_path(lora.adapter_base(path))
    kwargs = hub_load_kwargs(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code, **kwargs)
    except LOAD_ERRORS as exc:
        raise UserError(unreachable_message(path, exc, "config")) from None
    check_causal_lm(config, model_cfg)
    try:
        generation = GenerationConfig.from_pretrained(path, **kwargs)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        generation = None
    return config, generation


def check_causal_lm(config, model_cfg: ModelConfig) -> None:
    """The policy must be a causal LM: a sequence classifier (a reward model) would load with a
    randomly initialised LM head and only transformers' load report to say so. Its config.json's
    architectures must name a class AutoModelForCausalLM builds (or, naming none, its model_type
    must have one); remote code is trusted to know its own classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    named = list(getattr(config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if named and not any(name in causal or name.endswith("ForCausalLM") for name in named):
        why = f"its config.json names {', '.join(named)}, not a causal-LM head (*ForCausalLM)"
    elif not named and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not model_cfg.trust_remote_code:
        why = f"transformers has no causal-LM class for its model_type {config.model_type!r}"
    else:
        return
    hint = "; a reward model goes in rewards (name: reward_model)" if any(
        name.endswith("ForSequenceClassification") for name in named) else ""
    raise ConfigError("model.name_or_path", f"{model_cfg.name_or_path} is not a causal LM: {why}{hint}")


def context_length(model_cfg: ModelConfig) -> int | None:
    """The positions the model can attend over, from its config.json (None when it names no limit); an
    adapter folder's are its base model's."""
    config, _ = load_model_config(model_cfg)
    limits = [getattr(config, name, None) for name in ("max_position_embeddings", "n_positions", "max_sequence_length")]
    return next((int(limit) for limit in limits if isinstance(limit, int) and limit > 0), None)


def check_sequence_budget(cfg: Config, completion_tokens: int, budget: str = "rollout.max_new_tokens") -> None:
    """A prompt of data.max_prompt_length tokens plus `completion_tokens` must fit the model's positions:
    beyond them the model computes garbage, it does not fail. budget: what set the completion budget (a
    config key, or an option such as --max-new-tokens), blamed when the completion alone is too long."""
    positions = context_length(cfg.model)
    prompt = cfg.data.max_prompt_length
    if positions is None or prompt + completion_tokens <= positions:
        return
    source = f"{cfg.model.name_or_path} (max_position_embeddings)"
    if completion_tokens < positions:
        raise ConfigError(
            "data.max_prompt_length",
            f"{prompt} prompt + {completion_tokens} completion tokens need {prompt + completion_tokens} positions, "
            f"but {cfg.model.name_or_path} has {positions} (max_position_embeddings); set data.max_prompt_length to "
            f"at most {positions - completion_tokens} or lower {budget}",
        )
    problem = f"{completion_tokens} completion tokens exceed the {positions} positions of {source}"
    if prompt < positions:
        problem += f"; with data.max_prompt_length={prompt} it can be at most {positions - prompt}"
    raise UserError(f"{budget}: {problem}") if budget.startswith("--") else ConfigError(budget, problem)


def check_lora_targets(model_cfg: ModelConfig) -> None:
    """model.lora.r > 0: every model.lora.target_modules name matches a layer of the model, checked
    before the data is read on the model built from its config.json on the meta device (no weights)."""
    if model_cfg.lora.r == 0:
        return
    from transformers import AutoModelForCausalLM

    config, _ = load_model_config(model_cfg)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    lora.check_target_modules(skeleton, model_cfg.lora.target_modules, model_cfg.name_or_path)


def dropout_fields(config) -> dict[str, float]:
    """The non-zero dropout probabilities of a model config and its sub-configs (text_config, ...):
    dotted field -> value (HF names them *dropout* or *_pdrop)."""
    from transformers import PretrainedConfig

    found: dict[str, float] = {}
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            found.update({f"{name}.{key}": inner for key, inner in dropout_fields(value).items()})
        elif isinstance(value, float) and value > 0 and ("dropout" in name or name.endswith("pdrop")):
            found[name] = value
    return found


def _config_without_dropout(path: str, kwargs: dict):
    """The checkpoint's config with every dropout probability 0: dropout would make the old-log-prob pass
    and the update's forward two different random functions of the same weights, a noisy ratio even
    at lr 0 (model.keep_dropout keeps it). The model is built from it, and checkpoints save it so."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=kwargs["trust_remote_code"], **hub_load_kwargs(path))
    zeroed = dropout_fields(config)
    for dotted in zeroed:
        owner, _, name = dotted.rpartition(".")
        setattr(getattr(config, owner) if owner else config, name, 0.0)
    if zeroed:
        logger.info("model: dropout off in the forwards that feed the ratio (%s -> 0; model.keep_dropout keeps it)",
                    ", ".join(f"{key} {value:g}" for key, value in zeroed.items()))
    return config


def _load_adapter_model(model_cfg: ModelConfig, folder: str, device: torch.device):
    """Base model + the folder's adapter, for inference (eval, export). peft is checked first, so a
    missing package fails before the base model loads."""
    lora.require_peft(f"{folder} is a LoRA adapter checkpoint; loading it")
    base = load_model(dataclasses.replace(model_cfg, name_or_path=lora.adapter_base(folder)), device)
    return lora.attach_adapter(base, folder, device)


def load_policy(cfg: Config, device: torch.device, resume_from: Path | None = None):
    """The model to train. Full fine-tuning: the config's model, or the checkpoint's weights when
    resuming. LoRA (model.lora.r > 0): the config's model with fresh adapters, or with the
    checkpoint's adapter weights when resuming. A starting model that is itself an adapter folder
    is merged first: its weights are where this run starts."""
    if resume_from is not None and cfg.model.lora.r == 0:  # rundir.prepare_run_dir checked lora.check_resume
        return load_model(dataclasses.replace(cfg.model, name_or_path=str(resume_from)), device)
    model = load_model(cfg.model, device)
    if lora.is_peft_model(model):
        model = model.merge_and_unload().requires_grad_(True)  # peft froze the base weights
    if cfg.model.lora.r == 0:
        return model
    model = lora.apply_lora(model, cfg.model.lora, cfg.model.name_or_path)
    if resume_from is not None:
        lora.load_adapter_weights(model, resume_from)
    return model


def reference_policy(cfg: Config, model: torch.nn.Module, unwrapped: torch.nn.Module, device: torch.device):
    """dapo.beta > 0: (the reference model, the context to score it in). LoRA: the policy itself with
    its adapters disabled (the frozen base, no second copy). Otherwise a frozen copy of the config's
    model. beta = 0: (None, a null context)."""
    if cfg.dapo.beta == 0:
        return None, contextlib.nullcontext
    if cfg.model.lora.r > 0:
        return model, unwrapped.disable_adapter
    return load_model(cfg.model, device).eval().requires_grad_(False), contextlib.nullcontext


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every weight, or with LoRA only the adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def _cached(repo_id: str) -> bool:
    return isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str)


@functools.cache
def hub_load_kwargs(path: str, kind: locations.RepoKind = MODEL_REPO) -> dict:
    """Extra from_pretrained arguments for `path`. For a hub id, ask the Hub once with a timeout
    first (locations.probe): without network, from_pretrained retries for ~50 s before it fails.
    Unreachable -> the cached copy if there is one (local_files_only), else one UserError now."""
    if Path(path).is_dir() or locations.offline():
        return {}
    unreachable = locations.probe(path, kind)
    if unreachable is None:
        return {}
    if _cached(path):
        logger.warning("the Hugging Face Hub is unreachable (%s); using the cached copy of %s", unreachable, path)
        return {"local_files_only": True}
    raise UserError(unreachable_message(path, locations.reason(unreachable), kind=kind))


def unreachable_message(path: str, exc: object, what: str = "model", kind: locations.RepoKind = MODEL_REPO) -> str:
    """One line for a model (or its tokenizer or config) that did not load: what failed and, for a hub
    id, how to work offline (kind.hint: which setting to point at a local copy)."""
    text = str(exc).strip()
    first = text.splitlines()[0][:200] if text else type(exc).__name__
    if "ignore_mismatched_sizes" in first:  # transformers logs the shapes; its exception only points at them
        first = "its weights do not have the shapes its config.json describes (the load report above lists them)"
    if Path(path).is_dir() or (isinstance(exc, Exception) and not isinstance(exc, OSError)):  # not the network
        return f"could not load the {what} from {path}: {type(exc).__name__}: {first}"
    if locations.offline():
        first = "HF_HUB_OFFLINE=1 and no cached copy"
        return f"could not load model '{path}' ({first}); {kind.hint}"
    return (
        f"could not reach model '{path}' on the Hugging Face Hub ({first}); {kind.hint}, or set "
        "HF_HUB_OFFLINE=1 to use a copy already in the Hugging Face cache"
    )


# model.gradient_checkpointing -> whether to recompute activations, given CUDA.
GRADIENT_CHECKPOINTING = {"auto": lambda cuda: cuda, "on": lambda cuda: True, "off": lambda cuda: False}


def gradient_checkpointing(cfg: Config, cuda: bool) -> bool:
    """model.gradient_checkpointing resolved: "auto" is on for CUDA."""
    return GRADIENT_CHECKPOINTING[cfg.model.gradient_checkpointing](cuda)


def enable_gradient_checkpointing(model) -> None:
    """Recompute activations in the backward (model.gradient_checkpointing), non-reentrant. transformers
    renamed gradient_checkpointing_enable to activation_checkpointing_enable, and the old name warns on
    every call (5.25); a version from before the new name has only the old one."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def mixed_precision(cfg: Config, cuda: bool) -> str:
    """train.mixed_precision resolved: "auto" is bf16 on CUDA and none on CPU."""
    if cfg.train.mixed_precision == "auto":
        return "bf16" if cuda else "no"
    return cfg.train.mixed_precision


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def compute_dtype(cfg: Config, cuda: bool) -> torch.dtype | None:
    """The dtype the run's forwards compute in under train.mixed_precision's autocast (None: no autocast)."""
    return AUTOCAST_DTYPES[mixed_precision(cfg, cuda)]
