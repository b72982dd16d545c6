"""The rehearsal: a small random model that stands in for the config's model, and the config shrunk to
what runs in a minute without changing the wiring.

The model keeps everything the pipeline depends on and nothing it does not: the architecture class,
the vocabulary size (151,936 rows for Qwen2.5, more than the tokenizer's ids), tied or untied
embeddings, the special-token ids, the positions, the generation config; it gets LAYERS layers of
width WIDTH and random weights. A random model never stops and answers nothing, which would leave
every group uninformative and the update without a gradient, so one constant feature of the residual
stream is read by the EOS rows alone, tuned so that each EOS id is drawn with probability EOS_RATE per
token under the configured sampling: completion lengths (hence the overlong reward) vary within a
group.

The shrink changes counts, never code paths: steps, prompts per step, updates, the completion budget
(an overlong buffer in tokens scaled with it), eval items, CPU threads; a bf16 base becomes float32 on
a CPU without bf16 units; and dynamic sampling filters on the summed reward, since a random model's
correctness bits never vary (so a screen, dapo.screen_size, rules out all-right screens only: every
prompt is screened and completed). Every change is listed with its reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo_train.config.load import config_from_dict, config_to_dict
from dapo_train.config.schema import Config, RewardSpec
from dapo_train.model.loading import cpu_has_bf16_units
from dapo_train.rollout.decoding import SamplingSettings, behaviour_distribution

EOS_RATE = 0.02  # each EOS id's probability per generated token, before any training
WIDTH, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
STEPS, PROMPTS, UPDATES, COMPLETION_TOKENS, EVAL_ITEMS = 2, 2, 2, 16, 4


@dataclass(frozen=True)
class Change:
    """One setting the rehearsal changes: key, the config's value, the rehearsal's, and why."""

    key: str
    old: object
    new: object
    why: str


def small_config(config):
    """The model config with the width and depth of a rehearsal model; every other field kept."""
    small = config.__class__.from_dict(config.to_dict())
    fields = {
        "num_hidden_layers": LAYERS, "hidden_size": WIDTH, "intermediate_size": FFN, "num_attention_heads": HEADS,
        "num_key_value_heads": min(KV_HEADS, getattr(config, "num_key_value_heads", None) or KV_HEADS),
        "head_dim": WIDTH // HEADS, "max_window_layers": LAYERS,
    }
    for name, value in fields.items():
        if hasattr(small, name):
            setattr(small, name, value)
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:LAYERS]
    return small


def eos_ids(generation_config, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS ids and the tokenizer's."""
    listed = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    ids = listed if isinstance(listed, list) else [listed]
    return list(dict.fromkeys(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None))


def build_model(config, generation_config, tokenizer, folder: Path, sampling: SamplingSettings, seed: int = 0):
    """A rehearsal model of `config`'s class saved in `folder` with the tokenizer and generation config:
    random weights, but a constant feature in dimension 0 that only the EOS rows read strongly, tuned
    so that under `sampling` (temperature, top-k, top-p) each EOS id has probability EOS_RATE."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small_config(config), dtype=torch.float32).eval()
    _bias_towards_eos(model, eos_ids(generation_config, tokenizer), tokenizer, sampling)
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@torch.no_grad()
def _bias_towards_eos(model, eos: list[int], tokenizer, sampling: SamplingSettings) -> None:
    """Dimension 0 of every input embedding is 1 and no layer writes to it, so after the final norm it is
    a constant-ish c > 0 at every position; the LM head's EOS rows get a weight w on it, found by
    bisection so that the sampled distribution (after the configured truncation) gives the EOS ids
    len(eos) x EOS_RATE together. The other rows are random: near-uniform logits. With tied embeddings
    the EOS rows' own input embedding carries w too, which is harmless."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight  # (V, h) each
    embedding[:, 0] = 1.0
    for module in model.get_decoder().modules():
        if isinstance(module, torch.nn.Linear) and module.out_features == embedding.shape[1]:
            module.weight[0] = 0.0  # no layer writes into dimension 0 of the residual stream
            if module.bias is not None:
                module.bias[0] = 0.0
    others = float(head[:, 0].mean())  # 1 with tied embeddings, ~0 untied
    head[eos, 0] = others
    ids = torch.tensor(tokenizer("The answer is 42. 答案是 7", add_special_tokens=False)["input_ids"])[None]
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]  # (A, h), after the final norm
    base = (hidden @ head.T).float()  # (A, V)
    settings = dataclasses.replace(sampling, max_new_tokens=1)
    target = EOS_RATE * len(eos)

    def eos_mass(weight: float) -> float:
        logits = base.clone()
        logits[:, eos] += weight * hidden[:, :1]
        return float(behaviour_distribution(logits, settings).exp()[:, eos].sum(-1).mean())

    low, high = 0.0, 64.0 / float(hidden[:, 0].min())
    for _ in range(20):  # the interval shrinks a millionfold
        middle = (low + high) / 2
        low, high = (middle, high) if eos_mass(middle) < target else (low, middle)
    head[eos, 0] = others + (low + high) / 2


def _scaled(value: int, factor: float) -> int:
    return max(1, round(value * factor))


def _shrunk_rewards(rewards: list[RewardSpec], factor: float) -> tuple[list[dict], list[Change]]:
    """Token-count args (cache_length, max_length) scaled with the completion budget; fractions follow it."""
    out, changes = [], []
    for index, spec in enumerate(rewards):
        args = dict(spec.args)
        for name in ("cache_length", "max_length"):
            value = args.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and factor != 1.0:
                args[name] = _scaled(value, factor)
                changes.append(Change(f"rewards.{index}.args.{name}", value, args[name], "scaled with the budget"))
        out.append(dataclasses.asdict(dataclasses.replace(spec, args=args)))
    return out, changes


def shrink(cfg: Config, model_folder: Path, run_folder: Path, cuda: bool) -> tuple[Config, list[Change]]:
    """The rehearsal's config and what it changed (model, output folder, counts), each with its reason."""
    data = config_to_dict(cfg)
    changes: list[Change] = []

    def put(key: str, new: object, why: str, show: bool = True) -> None:
        *sections, name = key.split(".")
        owner = data
        for section in sections:
            owner = owner[section]
        if owner[name] != new:
            if show:
                changes.append(Change(key, owner[name], new, why))
            owner[name] = new

    put("model.name_or_path", str(model_folder), "a random 2-layer model of the same class, vocabulary, special "
        "tokens and generation config", show=False)
    put("output_dir", str(run_folder), "the rehearsal's folder", show=False)
    put("run_name", "preflight", "", show=False)
    if not cuda and cfg.model.dtype in ("bfloat16", "float16") and not (cfg.model.dtype == "bfloat16"
                                                                         and cpu_has_bf16_units()):
        put("model.dtype", "float32", f"this CPU has no {cfg.model.dtype} units: emulated matmuls are far slower")
    t, r = cfg.train, cfg.rollout
    put("train.max_steps", STEPS, f"{STEPS} steps, then a resume for one more")
    put("train.prompts_per_step", min(t.prompts_per_step, PROMPTS), "a small rollout batch")
    put("train.updates_per_step", min(t.updates_per_step, UPDATES, PROMPTS), "still more than one when configured")
    put("train.warmup_steps", min(t.warmup_steps, 1), "a short run")
    budget = min(r.max_new_tokens, COMPLETION_TOKENS)
    put("rollout.max_new_tokens", budget, "a short completion budget")
    data["rewards"], reward_changes = _shrunk_rewards(cfg.rewards, budget / r.max_new_tokens)
    changes += reward_changes
    if cfg.dapo.dynamic_sampling and cfg.dapo.filter_metric == "correct":
        put("dapo.filter_metric", "total", "a random model's correct bits never vary; its rewards do")
    if cfg.dapo.screen_size and "all_wrong" in cfg.dapo.screen_drop:
        put("dapo.screen_drop", ["all_right"], "a random model's screens are all wrong: all continue to the group")
    put("eval.every_steps", STEPS, "step 0 and the last")
    put("eval.num_items", min(cfg.eval.num_items or EVAL_ITEMS, EVAL_ITEMS), "a few eval items")
    put("eval.batch_size", min(cfg.eval.batch_size, EVAL_ITEMS), "a few eval items")
    put("eval.final_full", False, "no eval of the whole split")
    if cfg.eval.max_new_tokens:
        put("eval.max_new_tokens", min(cfg.eval.max_new_tokens, COMPLETION_TOKENS), "a short budget")
    put("eval.print_samples", min(cfg.eval.print_samples, 1), "one sample", show=False)
    put("checkpoint.every_steps", 0, "one checkpoint, at the end")
    put("checkpoint.keep_last", 0, "keep it for the resume")
    if cfg.logging.trackers:
        put("logging.trackers", [], "checked installed, not started")
    if not cuda and cfg.train.num_threads != 1:
        put("train.num_threads", 1, "the rehearsal model is small: a second thread costs more than it saves")
    put("logging.progress_bar", False, "", show=False)
    return config_from_dict(data), changes
