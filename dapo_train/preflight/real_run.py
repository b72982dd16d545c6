"""What preflight reads and estimates of the real run, which the rehearsal (rehearsal.py) stands in for:
the checks `run` makes before anything loads, the model's config and tokenizer (never its weights),
every data row under the chat template with one prompt shown, a call of rollout.tools at that template
(tool_check.py), and the real model's estimated peak memory on a CUDA card and its checkpoints on disk.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.preflight import rehearsal
from dapo_train.preflight.report import Report
from dapo_train.train.memory import CARD_BYTES, GIB, ModelShape, Setting, estimate, reward_model_loads
from dapo_train.train.update.budget import CARD_SIZES, MARGIN, budget_lines, choose_budget, describe_choice

PROMPT_LINES = 12  # lines of the templated prompt shown


def check_cheap(cfg: Config) -> None:
    """What `run` checks before anything loads: rewards, objective, engine, trackers."""
    from dapo_train.rewards.scoring import rewards_from_config
    from dapo_train.rollout.engines import engine_factory, rollout_tools
    from dapo_train.run.trackers import check_trackers
    from dapo_train.train.update.objective import loss_settings

    rewards_from_config(cfg)
    loss_settings(cfg)
    engine_factory(cfg.rollout.engine)
    rollout_tools(cfg.rollout)
    check_trackers(cfg.logging.trackers)


def describe_model(cfg: Config, shape: ModelShape, model_config, generation, tokenizer) -> str:
    ids = rehearsal.eos_ids(generation, tokenizer)
    eos = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)}" for i in ids)
    tied = "tied" if getattr(model_config, "tie_word_embeddings", False) else "untied"
    return (f"{cfg.model.name_or_path}: {type(model_config).__name__.removesuffix('Config')}, "
            f"{shape.parameters / 1e9:.2f}B parameters ({shape.trainable / 1e6:.1f}M trained), vocabulary "
            f"{shape.vocab:,} (tokenizer {len(tokenizer):,}), {tied} embeddings\n"
            f"EOS {eos}; pad {tokenizer.pad_token_id} {tokenizer.pad_token}; config and tokenizer read, no weights")


def report_data(cfg: Config, tokenizer, report: Report) -> tuple[list, str]:
    """Every row of the train and eval splits through the real prompt builder: counts, lengths, a prompt.
    -> (the train prompts, the split the rehearsal's eval reads)."""
    built = load_splits(cfg, tokenizer)
    lines = []
    for split, (_, stats) in built.items():
        lengths = sorted(stats.lengths)
        p95 = lengths[min(len(lengths) - 1, int(0.95 * len(lengths)))]
        lines.append(f"{split}: {stats.summary()}; prompt tokens (template and system prompt included) min "
                     f"{lengths[0]}, median {statistics.median(lengths):g}, p95 {p95}, max {lengths[-1]} (budget "
                     f"data.max_prompt_length={cfg.data.max_prompt_length})")
    report.add("data", f"{cfg.data.path}\n" + "\n".join(lines))
    train = built[cfg.data.train_split][0]
    shown = train[0].text.splitlines()
    more = f"\n... ({len(shown) - PROMPT_LINES} more lines)" if len(shown) > PROMPT_LINES else ""
    report.add("prompt", f"{train[0].uid}, {len(train[0].input_ids)} tokens, as the model sees it:\n" +
               "\n".join(shown[:PROMPT_LINES]) + more)
    return train, cfg.data.eval_split if cfg.data.eval_split in built else cfg.data.train_split


def load_splits(cfg: Config, tokenizer) -> dict:
    """The train and eval splits' prompts, listing rollout.tools as `run`'s do (its template check too). A
    config that runs no eval needs no eval split, and a data set without one (or with one `run` would not
    read) leaves the train split alone."""
    from dapo_train.rollout.engines import rollout_tools
    from dapo_train.task.prompts import load_prompt_splits
    from dapo_train.tools.turns import tool_turns

    turns = tool_turns(tokenizer, rollout_tools(cfg.rollout), cfg.rollout.max_tool_calls)
    tools = turns and turns.schemas
    splits = [cfg.data.train_split, cfg.data.eval_split]
    if cfg.eval.every_steps or cfg.eval.final_full:
        return load_prompt_splits(cfg.data, tokenizer, splits, tools)
    try:
        return load_prompt_splits(cfg.data, tokenizer, splits, tools)
    except UserError:
        return load_prompt_splits(cfg.data, tokenizer, splits[:1], tools)


def rehearse_tool_call(cfg: Config, tokenizer) -> str:
    """A tool call through the rollout's code at the run's chat template (tool_check.py)."""
    from dapo_train.preflight import tool_check
    from dapo_train.rollout.engines import rollout_tools
    from dapo_train.tools.turns import ToolTurns

    turns = ToolTurns(tokenizer, rollout_tools(cfg.rollout), cfg.rollout.max_tool_calls)
    return tool_check.rehearse_tool_call(tokenizer, turns)


def memory_estimate(cfg: Config, shape: ModelShape, prompts: list, shards: int) -> str:
    """The real model's peak per CUDA card under this config (train/memory.py), train.micro_batch_tokens=auto
    taken as on a 48 GB card; and the budget auto chooses on 24, 48 and 80 GB cards (train/update/budget.py),
    each with why none fits or that it is a whole mini-batch."""
    longest = max(len(p.input_ids) for p in prompts)
    reward_models = reward_model_loads(cfg, cuda=True, sequence=longest + cfg.rollout.max_new_tokens)
    cards = [budget_lines(shape, cfg, longest, shards, reward_models, card_bytes=size) for size in CARD_SIZES]
    budget = cfg.train.micro_batch_tokens
    shown = cfg
    if budget == "auto":
        chosen = choose_budget(*cards[CARD_SIZES.index(CARD_BYTES)], CARD_BYTES)
        shown = replace(cfg, train=replace(cfg.train, micro_batch_tokens=chosen or 0))
    result = estimate(shape, Setting.from_config(shown, cuda=True, prompt_tokens=longest, shards=shards,
                                                 reward_models=reward_models))
    terms = ", ".join(f"{name} {value / GIB:.1f}" for name, value in result.terms.items() if value)
    where = "one CUDA card" if shards == 1 else f"each of {shards} CUDA cards with FSDP/ZeRO sharding"
    at = f" at train.micro_batch_tokens={shown.train.micro_batch_tokens} (auto on a 48 GB card)" \
        if budget == "auto" else ""
    choices = ", ".join(f"{size // 10**9} GB {describe_choice(lines, need, size)}"
                        for size, (lines, need) in zip(CARD_SIZES, cards))
    return (f"estimated peak on {where} for the real model as configured{at}: {result.peak / GIB:.1f} GiB (at the "
            f"{result.peak_moment}); GiB: {terms}; CUDA context not included (docs/benchmarks.md#memory); "
            f"train.micro_batch_tokens=auto would choose (the card's memory all free, less a {MARGIN:.0%} margin): "
            f"{choices}")


def checkpoint_space(cfg: Config, shape: ModelShape) -> str:
    """The real model's checkpoints on disk (run/disk_space.py): its weights at model.dtype (float32 for
    auto), or a LoRA run's float32 adapter alone, and AdamW's two moments of the trained ones."""
    from dapo_train.run.disk_space import disk_plan

    lora = cfg.model.lora.r > 0
    size = 4 if lora or cfg.model.dtype in ("auto", "float32") else 2
    return disk_plan(cfg, (shape.trainable if lora else shape.parameters) * size, shape.trainable * size)
