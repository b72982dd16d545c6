"""The invariants across a config's fields: every impossible value names its key and the allowed
range (a ConfigError, one line), before anything loads. schema.Config calls validate() when it is
built; the functions take the Config duck-typed because schema imports this module.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath
from typing import Any

from dapo_train.errors import ConfigError


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _check_choices(section: Any, prefix: str) -> None:
    """Every field with a fixed set of values (each item, for a list) holds one of them; nested
    sections (model.lora) are walked too."""
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
            continue
        choices = f.metadata.get("choices")
        for item in value if isinstance(value, list) else [value]:
            if choices and item not in choices:
                allowed = ", ".join("null" if choice is None else choice for choice in choices)
                raise ConfigError(key, f"got {item!r}; allowed: {allowed}")


# Names that must not be empty: an empty path is the current folder, an empty column or plugin no name.
NON_EMPTY = (
    "model.name_or_path", "data.path", "data.prompt_field", "data.answer_field", "data.correctness",
    "data.train_split", "data.eval_split", "rollout.engine", "dapo.policy_loss", "dapo.filter_metric",
    "logging.project",
)


def _check_names(cfg: Any) -> None:
    for key in NON_EMPTY:
        section, name = key.split(".")
        _require(bool(getattr(getattr(cfg, section), name).strip()), key, "must not be empty")


def _leaves(name: str) -> bool:
    """Whether a path made by joining `name` to a folder lies outside that folder: absolute, through '..', or
    under a home folder (~)."""
    return PurePosixPath(name).is_absolute() or ".." in PurePosixPath(name).parts or name.startswith("~")


def _check_run_paths(cfg: Any) -> None:
    """What the run derives inside a folder stays there: its folder outputs/<run_name> (output_dir, the user's own
    choice, may be anywhere) and TensorBoard's, <output_dir>/<logging.project>, where the run's checks and
    --overwrite look for it."""
    _require(not _leaves(cfg.run_name), "run_name", f"{cfg.run_name!r} leaves outputs/ (the run's folder is "
             "outputs/<run_name>); give a name, or set output_dir=... for a folder elsewhere")
    _require(not _leaves(cfg.logging.project), "logging.project", f"{cfg.logging.project!r} leaves the run folder "
             "(TensorBoard writes its folder at <output_dir>/<logging.project>); give a name")


def _check_seed_and_optimizer(cfg: Any) -> None:
    """Values torch, numpy, AdamW or the fp16 loss scaler refuse only once the model is built or trains."""
    t = cfg.train
    _require(0 <= cfg.seed < 2**32, "seed", f"got {cfg.seed}; must be in [0, 2**32) (numpy's seed range)")
    _require(0.0 <= t.adam_beta1 < 1.0, "train.adam_beta1", f"got {t.adam_beta1}; must be in [0, 1)")
    _require(0.0 <= t.adam_beta2 < 1.0, "train.adam_beta2", f"got {t.adam_beta2}; must be in [0, 1)")
    _require(t.weight_decay >= 0.0, "train.weight_decay", f"got {t.weight_decay}; must be >= 0")
    _require(not (t.mixed_precision == "fp16" and cfg.model.dtype == "float16"), "train.mixed_precision",
             "fp16 over model.dtype=float16: fp16's loss scaler unscales float32 master gradients only (it raises at "
             "the first optimizer step); set model.dtype=auto (float32 master weights) or train.mixed_precision=bf16")


def _check_dapo(d: Any) -> None:
    """The clip bounds of every objective, the KL weight, dynamic sampling and the rollout correction."""
    _require(0.0 <= d.eps_low < 1.0, "dapo.eps_low", f"got {d.eps_low}; must be in [0, 1)")
    _require(d.eps_high >= 0.0, "dapo.eps_high", f"got {d.eps_high}; must be >= 0")
    _require(0.0 <= d.gspo_eps_low < 1.0, "dapo.gspo_eps_low", f"got {d.gspo_eps_low}; must be in [0, 1)")
    _require(d.gspo_eps_high >= 0.0, "dapo.gspo_eps_high", f"got {d.gspo_eps_high}; must be >= 0")
    _require(0.0 <= d.cispo_eps_low <= 1.0, "dapo.cispo_eps_low", f"got {d.cispo_eps_low}; must be in [0, 1]")
    _require(d.cispo_eps_high >= 0.0, "dapo.cispo_eps_high", f"got {d.cispo_eps_high}; must be >= 0")
    _require(
        d.clip_ratio_c is None or d.clip_ratio_c > 1.0,
        "dapo.clip_ratio_c", f"got {d.clip_ratio_c}; must be > 1 or null",
    )
    _require(d.beta >= 0.0, "dapo.beta", f"got {d.beta}; must be >= 0")
    _require(
        d.filter_metric in ("correct", "total") or (d.filter_metric.startswith("reward:") and len(d.filter_metric) > 7),
        "dapo.filter_metric", f"got {d.filter_metric!r}; allowed: correct, total, reward:<name of a configured reward>",
    )
    _require(d.max_gen_rounds >= 1, "dapo.max_gen_rounds", f"got {d.max_gen_rounds}; must be >= 1")
    _require(d.num_iterations >= 1, "dapo.num_iterations", f"got {d.num_iterations}; must be >= 1")
    _require(d.rollout_correction_cap > 1.0, "dapo.rollout_correction_cap",
             f"got {d.rollout_correction_cap}; must be > 1")


def _check_screen(cfg: Any) -> None:
    """Round sizes, the prompt history and screening (dapo.screen_size), which moves part of Eq. 11
    before generation: it needs Eq. 11 on, a continuation to sample, and a side that rules prompts out."""
    d, group_size = cfg.dapo, cfg.rollout.group_size
    _require(d.max_round_prompts == 0 or d.max_round_prompts >= cfg.train.prompts_per_step, "dapo.max_round_prompts",
             f"got {d.max_round_prompts}; must be 0 (every round draws train.prompts_per_step) or at least "
             f"train.prompts_per_step ({cfg.train.prompts_per_step})")
    _require(0.0 < d.skip_floor <= 1.0, "dapo.skip_floor", f"got {d.skip_floor}; must be in (0, 1]: a prompt is "
             "never skipped for sure")
    _require(d.dynamic_sampling or not d.skip_history, "dapo.skip_history", "needs dapo.dynamic_sampling=true: "
             "its history is of the groups Eq. 11 drops")
    _require(d.screen_size == 0 or 2 <= d.screen_size < group_size, "dapo.screen_size",
             f"got {d.screen_size}; must be 0 (off) or in 2..{group_size - 1} (a screen of 1 is always all alike; "
             "below rollout.group_size)")
    if d.screen_size == 0:
        return
    _require(d.dynamic_sampling, "dapo.screen_size", "needs dapo.dynamic_sampling=true: without it every group "
             "trains, and a screen would drop some")
    _require(bool(d.screen_drop), "dapo.screen_drop", "empty: name all_wrong, all_right or both, or set "
             "dapo.screen_size=0")


def _check_rollout_and_train(cfg: Any) -> None:
    """Sampling, prompt and step sizes, the learning schedule and the update's layout."""
    r, t = cfg.rollout, cfg.train
    _require(r.group_size >= 2, "rollout.group_size", f"got {r.group_size}; must be >= 2 (advantages need a group)")
    _require(r.max_new_tokens >= 1, "rollout.max_new_tokens", f"got {r.max_new_tokens}; must be >= 1")
    _require(r.temperature > 0.0, "rollout.temperature", f"got {r.temperature}; must be > 0")
    _require(0.0 < r.top_p <= 1.0, "rollout.top_p", f"got {r.top_p}; must be in (0, 1]")
    _require(r.top_k >= 0, "rollout.top_k", f"got {r.top_k}; must be >= 0 (0 = off)")
    _require(r.generation_batch_size >= 1, "rollout.generation_batch_size", "must be >= 1")
    _require(r.max_tool_calls >= 1, "rollout.max_tool_calls", f"got {r.max_tool_calls}; must be >= 1")
    _require(0.0 < r.vllm_memory < 1.0, "rollout.vllm_memory", f"got {r.vllm_memory}; must be in (0, 1)")
    _require(r.vllm_kv_cache_mib >= 0, "rollout.vllm_kv_cache_mib", "must be >= 0 (0 = auto)")
    _require(cfg.data.max_prompt_length >= 1, "data.max_prompt_length", "must be >= 1")
    _require(t.max_steps >= 1, "train.max_steps", f"got {t.max_steps}; must be >= 1")
    _require(t.prompts_per_step >= 1, "train.prompts_per_step", f"got {t.prompts_per_step}; must be >= 1")
    _require(t.updates_per_step >= 1, "train.updates_per_step", f"got {t.updates_per_step}; must be >= 1")
    step_sequences = t.prompts_per_step * r.group_size
    _require(
        1 <= t.micro_batch_size <= step_sequences,
        "train.micro_batch_size",
        f"got {t.micro_batch_size}; must be in [1, {step_sequences}] "
        "(prompts_per_step x group_size sequences per step)",
    )
    _require(t.micro_batch_tokens == "auto" if isinstance(t.micro_batch_tokens, str) else t.micro_batch_tokens >= 0,
             "train.micro_batch_tokens", f"got {t.micro_batch_tokens!r}; must be >= 0 (0 = off) or auto")
    _require(t.learning_rate > 0.0, "train.learning_rate", f"got {t.learning_rate}; must be > 0")
    _require(t.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
    _require(t.max_grad_norm >= 0.0, "train.max_grad_norm", "must be >= 0 (0 = off)")
    _require(t.logprob_chunk_mib > 0, "train.logprob_chunk_mib", f"got {t.logprob_chunk_mib}; must be > 0")
    _require(
        t.shared_prefix != "on" or cfg.model.attn_implementation in (None, "sdpa", "eager"),
        "train.shared_prefix",
        f"'on' needs an attention kernel that takes a 4-D mask (sdpa, eager), not {cfg.model.attn_implementation}; "
        "use auto or off",
    )
    _require(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
    _require(t.max_starved_steps >= 1, "train.max_starved_steps", "must be >= 1")
    _require(t.num_threads >= 0, "train.num_threads", "must be >= 0 (0 = torch default)")


def _check_eval_checkpoint_lora_logging(cfg: Any) -> None:
    """Eval and checkpoint cadence, the LoRA adapter, the trackers and the rollout records."""
    _require(cfg.eval.print_samples >= 0, "eval.print_samples", f"got {cfg.eval.print_samples}; must be >= 0")
    _require(cfg.eval.every_steps >= 0, "eval.every_steps", "must be >= 0 (0 = off)")
    _require(cfg.eval.num_items >= 0, "eval.num_items", "must be >= 0 (0 = whole split)")
    _require(cfg.eval.batch_size >= 1, "eval.batch_size", "must be >= 1")
    _require(cfg.eval.samples == 0 or cfg.eval.samples >= 2, "eval.samples",
             f"got {cfg.eval.samples}; must be 0 (off) or K >= 2 samples per item")
    _require(cfg.eval.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0")
    _require(0.0 < cfg.eval.regression_alpha < 1.0, "eval.regression_alpha",
             f"got {cfg.eval.regression_alpha}; must be in (0, 1), e.g. 0.01")
    _require(cfg.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0")
    _require(cfg.checkpoint.keep_last >= 0, "checkpoint.keep_last", "must be >= 0 (0 = keep all)")
    lora = cfg.model.lora
    _require(lora.r >= 0, "model.lora.r", f"got {lora.r}; must be >= 0 (0 = off)")
    _require(lora.alpha > 0.0, "model.lora.alpha", f"got {lora.alpha}; must be > 0")
    _require(0.0 <= lora.dropout < 1.0, "model.lora.dropout", f"got {lora.dropout}; must be in [0, 1)")
    _require(
        bool(lora.target_modules) and all(lora.target_modules),
        "model.lora.target_modules",
        f"got {lora.target_modules!r}; must name at least one layer, e.g. [q_proj, v_proj]",
    )
    _require(
        len(set(cfg.logging.trackers)) == len(cfg.logging.trackers),
        "logging.trackers", f"got {cfg.logging.trackers!r}; a tracker is named twice",
    )
    _require(cfg.logging.rollout_groups >= -1, "logging.rollout_groups",
             f"got {cfg.logging.rollout_groups}; must be >= 0, or -1 (every group)")
    _require(cfg.logging.rollout_every >= 0, "logging.rollout_every", "must be >= 0 (0 = off)")


def validate(cfg: Any) -> None:
    """Invariants across fields; called from Config.__post_init__. Rewards (names, args, overlong
    lengths) are checked by rewards.build_rewards, which `run` (first thing in setup) and `config`
    call, before anything heavy loads."""
    _check_choices(cfg, "")
    _check_names(cfg)
    _check_run_paths(cfg)
    _check_seed_and_optimizer(cfg)
    _check_dapo(cfg.dapo)
    _check_screen(cfg)
    _check_rollout_and_train(cfg)
    _check_eval_checkpoint_lora_logging(cfg)
