"""An evaluation's settings against the checkpoint's own (the config its run trained and evaluated with), and
the file name they give its results.

Every key falls in one of three kinds. Keys that change what is evaluated (the data, the prompt, the budget,
the tools, the model's numerics, the engine) name the result files, so evals with different settings coexist,
and they leave out the change from step 0 (the run's step-0 eval decoded with its own). Keys that act without
changing it (NEUTRAL: speed, the bar, where files go) do neither. Keys an evaluation never reads
(TRAINING_ONLY: a checkpoint loads with the weights and the adapter it saved, so model.lora.* cannot reshape
it) are said in one line when given as KEY=VALUE, and do neither either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field

from dapo_train.config.keys import schema_keys
from dapo_train.config.load import config_to_dict
from dapo_train.config.naming import name_part
from dapo_train.config.schema import Config
from dapo_train.evaluation.generate import eval_max_new_tokens

logger = logging.getLogger(__name__)

# Keys (or whole sections) an evaluation never reads. seed acts only on sampled evals (setting_changes).
TRAINING_ONLY = (
    "run_name", "model.gradient_checkpointing", "model.keep_dropout", "model.lora", "data.train_split",
    "rollout.group_size", "rollout.temperature", "rollout.top_p", "rollout.top_k", "dapo", "rewards",
    "train.max_steps", "train.prompts_per_step", "train.updates_per_step", "train.micro_batch_size",
    "train.micro_batch_tokens", "train.learning_rate", "train.lr_scheduler", "train.warmup_steps",
    "train.weight_decay", "train.adam_beta1", "train.adam_beta2", "train.max_grad_norm", "train.logprob_chunk_mib",
    "train.shared_prefix", "train.deterministic", "train.max_bad_steps", "train.max_starved_steps",
    "eval.every_steps", "eval.num_items", "eval.print_samples", "eval.final_full", "eval.stop_on_regression",
    "checkpoint", "logging.trackers", "logging.project", "logging.rollout_groups", "logging.rollout_every",
)
# Keys an evaluation reads that change how fast it runs, what it shows or where it writes, not its numbers.
NEUTRAL = (
    "output_dir", "logging.progress_bar", "eval.batch_size", "train.num_threads", "rollout.generation_batch_size",
    "rollout.compile", "rollout.vllm_memory", "rollout.vllm_kv_cache_mib",
)
# Keys compared by what they resolve to, each named in the file name on its own: the model (the target
# itself), the split (--split or data.eval_split), the completion budget (_len) and the engine (_<engine>).
RESOLVED = ("model.name_or_path", "data.eval_split", "rollout.max_new_tokens", "eval.max_new_tokens",
            "rollout.engine")
_NAME_PARTS = 60  # characters of settings in a file name; past it, a hash of them


def _within(key: str, names: tuple[str, ...]) -> bool:
    return any(key == name or key.startswith(name + ".") for name in names)


def _inert(key: str, samples: int) -> bool:
    return _within(key, TRAINING_ONLY) or (key == "seed" and samples == 1)


@dataclass(frozen=True)
class SettingChanges:
    """How an eval's settings differ from the checkpoint's own. evaluated: key -> this eval's value, for the
    keys that change what is evaluated; budget: the completion budget where it is not the own config's;
    engine: this eval's engine where it is not the one the own config evaluates with; inert: the KEY=VALUE
    overrides that cannot act on an evaluation."""

    evaluated: dict[str, object] = field(default_factory=dict)
    budget: int | None = None
    engine: str | None = None
    inert: tuple[str, ...] = ()

    def named(self) -> dict[str, object]:
        """The evaluated changes the file name spells out itself (rollout.tools is its _tools part)."""
        return {key: value for key, value in self.evaluated.items() if not _within(key, ("rollout.tools",))}

    def why_not_step_0(self, samples: int) -> str | None:
        """Why this eval cannot be paired with the run's step-0 eval, or None when it decodes as that did."""
        given = [f"{key}={_text(value)}" for key, value in self.evaluated.items()]
        given += [f"a completion budget of {self.budget}"] if self.budget is not None else []
        given += [f"the {self.engine} engine"] if self.engine is not None else []
        given += [f"{samples} samples per item"] if samples > 1 else []
        if not given:
            return None
        return (f"{', '.join(given)} {'differs' if len(given) == 1 else 'differ'} from how the run evaluated step 0 "
                "(greedy, its own config)")


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _values(cfg: Config) -> dict[str, object]:
    """Each schema key -> its value (a list or the rewards whole, as one setting)."""
    data = config_to_dict(cfg)
    values = {}
    for info in schema_keys():
        node = data
        for part in info.key.split("."):
            node = node[part]
        values[info.key] = node
    return values


def setting_changes(own: Config, cfg: Config, overrides: tuple[str, ...], max_new_tokens: int, engine: str,
                    own_engine: str, samples: int) -> SettingChanges:
    """cfg (the eval's config: own <- --config <- KEY=VALUE) against own (the checkpoint's saved config, or the
    --config file alone); max_new_tokens / engine: what this eval uses, own_engine: what own evaluates with."""
    before, after = _values(own), _values(cfg)
    evaluated = {key: value for key, value in after.items() if value != before[key] and not _inert(key, samples)
                 and not _within(key, NEUTRAL + RESOLVED)}
    inert = tuple(item.strip() for item in overrides if _inert(item.partition("=")[0].strip(), samples))
    return SettingChanges(evaluated, None if max_new_tokens == eval_max_new_tokens(own) else max_new_tokens,
                          None if engine == own_engine else engine, inert)


def say_inert(changes: SettingChanges, label: str) -> None:
    """One line for the KEY=VALUE overrides an evaluation cannot act on."""
    if changes.inert:
        seed = any(item.partition("=")[0].strip() == "seed" for item in changes.inert)
        logger.warning("%s cannot act on an evaluation of %s: training settings; a checkpoint loads with the weights "
                       "(and a LoRA checkpoint the adapter) it saved%s", ", ".join(changes.inert), label,
                       "; seed draws only for --samples above 1" if seed else "")


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def result_name(split: str, limit: int | None, samples: int, temperature: float, max_new_tokens: int | None,
                tools: bool = False, engine: str = "hf", changes: dict[str, object] | None = None) -> str:
    """What an eval covered, as a file-name part, so different evals of one checkpoint coexist:
    'test' (every item, greedy), 'test_limit100', 'test_k8_t0.9', 'test_limit100_len64', 'test_tools'
    (with the config's rollout.tools), 'test_vllm' (generated by an engine other than hf: eval_engine_name),
    'test_system_prompt=1a2b3c' (changes: the other settings that change what is evaluated, as a run name
    spells them; past 60 characters 'settings' and a hash of them all)."""
    parts = [safe_name(split)]
    if limit is not None:
        parts.append(f"limit{limit}")
    if samples > 1:
        parts.append(f"k{samples}_t{temperature:g}")
    if max_new_tokens is not None:
        parts.append(f"len{max_new_tokens}")
    if tools:
        parts.append("tools")
    if engine != "hf":
        parts.append(safe_name(engine))
    settings = [name_part(key, _text(value)) for key, value in (changes or {}).items()]
    if len("_".join(settings)) > _NAME_PARTS:
        digest = hashlib.sha256("\n".join(settings).encode("utf-8", "surrogatepass")).hexdigest()[:8]
        settings = [f"settings{digest}"]
    return "_".join(parts + settings)
