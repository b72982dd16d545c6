"""One training session's objects, built once: the accelerator and seeds, rewards, prompts, the model
and its optimizer (the Learner), the rollout engine and the dynamic-sampling buffer (`Run`).

`setup` checks what is cheap first (rewards, engine, policy objective, data) so that bad input
fails in one line before the model loads, and says at start which settings cannot act. Reward
models load after the policy, once per run, on its device (never adapted: the optimizer holds the
policy's parameters only).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dapo_train.config.schema import Config, DataConfig
from dapo_train.errors import ConfigError, UserError
from dapo_train.evaluation.generate import eval_max_new_tokens, longest_sequence
from dapo_train.evaluation.sampled import sampled_note
from dapo_train.model.loading import (
    check_attention_kernel,
    check_lora_targets,
    check_sequence_budget,
    compute_dtype,
    cpu_has_bf16_units,
    enable_gradient_checkpointing,
    gradient_checkpointing,
    load_policy,
    load_tokenizer,
    mixed_precision,
    reference_policy,
    trainable_parameters,
)
from dapo_train.model.threads import set_cpu_threads
from dapo_train.rewards.scoring import RewardSet, rewards_from_config
from dapo_train.rollout.completions import pad_token_id
from dapo_train.rollout.engines import RolloutEngine, build_engine, engine_factory, rollout_tools
from dapo_train.rollout.vllm_settings import check_memory, inert_settings
from dapo_train.run.checkpoint import CheckpointScore, keep_best_note
from dapo_train.task.prompts import Prompt, PromptSampler, fixed_eval_subset, load_prompt_splits
from dapo_train.task.sources import load_split
from dapo_train.tools.turns import ToolTurns, tool_turns
from dapo_train.train import distributed
from dapo_train.train.card_memory import CardMemory
from dapo_train.train.collect.history import PromptHistory
from dapo_train.train.collect.rounds import GroupBuffer, KeepRate, max_rounds
from dapo_train.train.determinism import use_deterministic
from dapo_train.train.health import StepHealth
from dapo_train.train.lowered_budgets import SessionBudgets, in_force
from dapo_train.train.regression import RegressionWatch, stop_note
from dapo_train.train.update.batching import Batching
from dapo_train.train.update.card import estimated_peak, resolve_budget
from dapo_train.train.update.objective import OBJECTIVE_KEYS, clip_bound_keys, inert_objective_keys, loss_settings
from dapo_train.train.update.old_policy import clip_can_act, log_behaviour, resolve, rollout_differences, truncation
from dapo_train.train.update.optim import adamw, allocate_state, warmup_note
from dapo_train.train.update.out_of_memory import OutOfMemoryGuard, guard_note
from dapo_train.train.update.passes import Learner, Reference

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    """Everything the loop touches, built once by `setup`."""

    cfg: Config
    run_dir: Path
    accelerator: Accelerator
    tokenizer: PreTrainedTokenizerBase
    reward_set: RewardSet
    learner: Learner  # the model (as accelerate prepared it), its optimizer, the loss
    engine: RolloutEngine
    prompt_sampler: PromptSampler  # the training prompts' order
    eval_prompts: list[Prompt]  # the fixed subset of every periodic eval (eval.num_items)
    final_prompts: list[Prompt]  # the whole eval split, for the end-of-run eval (eval.final_full; else empty)
    buffer: GroupBuffer
    prompts_by_uid: dict[str, Prompt]
    step: int = 0
    health: StepHealth = field(default_factory=StepHealth)  # bad steps since the last that trained
    saved_step: int | None = None  # the step of the checkpoint on disk that holds these weights
    started: float = field(default_factory=time.monotonic)  # when this session began (train: before setup)
    seconds_before: float = 0.0  # wall time of the sessions before this one (a resumed run's checkpoint)
    rollouts: list[dict] = field(default_factory=list)  # the last step's rollout records (main process)
    eval_split_missing: str | None = None  # why `dapo-train eval` of a checkpoint would fail (no eval split)
    keep_rate: KeepRate = field(default_factory=KeepRate)  # sizes the generation rounds (dapo.max_round_prompts)
    history: PromptHistory = field(default_factory=PromptHistory)  # skips prompts (dapo.skip_history)
    tool_turns: ToolTurns | None = None  # rollout.tools for the tokenizer; the in-training eval runs them too
    last_eval: CheckpointScore | None = None  # the latest periodic eval: the score of a checkpoint saved at its step
    best: CheckpointScore | None = None  # the best checkpoint saved so far (checkpoint.keep_best; else None)
    final_eval_stopped: bool = False  # a stop ended the end-of-run eval (nothing of it recorded)
    start_records: list[dict] | None = None  # step 0's eval records: every later eval's change is paired on them
    start_sampled: list[dict] | None = None  # step 0's sampled eval records (eval.samples), the same for those
    regression: RegressionWatch = field(default_factory=RegressionWatch)  # the evals against step 0 (regression.py)
    guard: OutOfMemoryGuard = field(default_factory=OutOfMemoryGuard)  # steps 2-3 out of memory: redone smaller
    engine_stale: bool = False  # the engine ran out of memory taking the last step's weights (loop.sync_weights)
    budgets: SessionBudgets = field(default_factory=SessionBudgets)  # as set up: what out of memory lowers is below
    card_memory: CardMemory = field(default_factory=CardMemory)  # each step's peaks on CUDA (card_memory.py)

    @property
    def wall_seconds(self) -> float:
        """The run's wall time so far, every session up to its checkpoint included."""
        return self.seconds_before + time.monotonic() - self.started

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model


def start_accelerator(cfg: Config, cuda: bool, run_dir: Path):
    """The Accelerator (under torchrun / accelerate launch it joins the other ranks; its trackers
    write under the run folder), this rank's seeds, and a log line from each rank saying what it does."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # A process that trains more than once (preflight's rehearsal and resume, a sweep's points, tests) may
    # ask for another mixed precision than its last run's; accelerate keeps one per process and refuses a
    # change, so the finished run's state goes (the process group, PartialState's, stays).
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg, cuda), cpu=not cuda, log_with=cfg.logging.trackers or None,
        project_dir=str(run_dir), fsdp_plugin=distributed.fsdp_plugin(),  # float32 gathered and reduced
    )
    distributed.check_strategy(accelerator)
    seed = distributed.rank_seed(cfg.seed, accelerator.process_index)
    seed_everything(seed)
    distributed.configure_rank_logging(
        accelerator.process_index, accelerator.num_processes,
        f"at work: {accelerator.distributed_type.value} on {accelerator.device}, seed {seed}, generating its slice "
        f"of each round's {cfg.train.prompts_per_step} prompts",
    )
    return accelerator


def setup(cfg: Config, run_dir: Path, resume_from: Path | None) -> Run:
    """Validate cheap things first (rewards, engine, objective, budget, LoRA targets, data), then load the
    model."""
    cuda = torch.cuda.is_available()
    use_deterministic(cfg, cuda)  # before the first CUDA matmul (cuBLAS's workspace); top-p on CUDA refused
    accelerator = start_accelerator(cfg, cuda, run_dir)
    set_cpu_threads(cfg.train.num_threads)
    reward_set = rewards_from_config(cfg)
    engine_factory(cfg.rollout.engine)  # an unknown engine or objective fails here, before anything loads
    check_memory(cfg.rollout, cuda)  # a vllm KV cache the device cannot hold too
    tools = rollout_tools(cfg.rollout)  # a bad tool, or one the engine cannot run, too
    loss_settings(cfg)
    check_sequence_budget(cfg, cfg.rollout.max_new_tokens)
    if cfg.eval.every_steps or cfg.eval.final_full:
        check_sequence_budget(cfg, eval_max_new_tokens(cfg), "eval.max_new_tokens")
    check_lora_targets(cfg.model)
    if cfg.model.attn_implementation:
        check_attention_kernel(cfg.model.attn_implementation, accelerator.device)  # load_model would, after the data
    tokenizer = load_tokenizer(cfg.model)
    turns = tool_turns(tokenizer, tools, cfg.rollout.max_tool_calls)  # a template without tools fails here
    evaluating, final = cfg.eval.every_steps > 0, cfg.eval.final_full
    wanted = [cfg.data.train_split, cfg.data.eval_split] if evaluating or final else [cfg.data.train_split]
    splits = load_prompt_splits(cfg.data, tokenizer, wanted, turns and turns.schemas)  # each split logs its rows
    train_prompts = splits[cfg.data.train_split][0]
    check_data_use(cfg, len(train_prompts))
    all_eval = splits[cfg.data.eval_split][0] if evaluating or final else []
    eval_prompts = eval_subset(cfg, all_eval) if evaluating else []
    final_prompts = all_eval if final else []
    _log_final_eval_cost(cfg, len(eval_prompts), len(final_prompts))
    lengths = [len(p.input_ids) for p in train_prompts]
    budget = resolve_budget(cfg, accelerator, lengths)  # before the model loads
    card_memory = CardMemory.start(accelerator.device, estimated_peak(cfg, accelerator, lengths, budget))
    model = load_policy(cfg, accelerator.device, resume_from)
    if gradient_checkpointing(cfg, cuda):
        enable_gradient_checkpointing(model)
    alone = distributed.world_size() == 1  # the out-of-memory guard acts in one process (update/out_of_memory.py)
    model, optimizer = accelerator.prepare(model, adamw(cfg, trainable_parameters(model), fused=cuda and alone))
    if alone:
        allocate_state(getattr(optimizer, "optimizer", optimizer))  # AdamW's state now, not at its first step
    unwrapped = accelerator.unwrap_model(model)
    with distributed.full_weights(accelerator, model):  # a rollout copy is made of whole weights
        engine = build_engine(cfg.rollout, unwrapped, tokenizer, turns, longest_sequence(cfg), compute_dtype(cfg, cuda))
    reward_set = reward_set.load(accelerator.device)  # the reward models' weights, frozen
    behaviour = resolve(cfg, rollout_differences(cfg, engine, unwrapped, cuda), truncation(cfg, unwrapped))
    learner = Learner.build(cfg, model, optimizer, accelerator, pad_token_id(unwrapped, tokenizer),
                            prepare_reference(cfg, accelerator, model, unwrapped), behaviour=behaviour,
                            micro_batch_tokens=budget)
    log_behaviour(behaviour, cfg, unwrapped)
    _log_speed_settings(cfg, learner.batching, unwrapped, cuda)
    logger.info("%s", guard_note(alone))
    _warn_inert_settings(cfg)
    return Run(
        cfg=cfg, run_dir=run_dir, accelerator=accelerator, tokenizer=tokenizer, reward_set=reward_set,
        learner=learner, engine=engine, prompt_sampler=PromptSampler(train_prompts, cfg.seed),
        eval_prompts=eval_prompts, final_prompts=final_prompts, buffer=GroupBuffer(),
        prompts_by_uid={p.uid: p for p in train_prompts}, tool_turns=turns,
        eval_split_missing=None if evaluating or final else missing_split(cfg.data, cfg.data.eval_split),
        guard=OutOfMemoryGuard(enabled=alone, longest_prompt=max(len(p.input_ids) for p in train_prompts),
                               completion_tokens=cfg.rollout.max_new_tokens, group_size=cfg.rollout.group_size),
        card_memory=card_memory, budgets=SessionBudgets(in_force(learner.batching, engine)),
    )


def check_data_use(cfg: Config, usable: int) -> None:
    """Refuse fewer usable training prompts than the largest generation round draws (a round would repeat
    prompts within itself), and say at start how much of the data the run will see: each round draws
    train.prompts_per_step prompts, or under dapo.max_round_prompts as many as the keep rate asks, up to
    that many; with dynamic sampling a step runs 1 to dapo.max_gen_rounds rounds (how many depends on the
    groups it keeps), so the count is a range."""
    wanted, steps = cfg.train.prompts_per_step, cfg.train.max_steps
    # Without Eq. 11 every group is kept (keep rate 1), so a sized round draws exactly the missing prompts.
    sized = cfg.dapo.max_round_prompts if cfg.dapo.dynamic_sampling else 0
    if usable < wanted:
        raise ConfigError(
            "train.prompts_per_step", f"a step needs {wanted} different prompts, but {cfg.data.path} "
            f"[{cfg.data.train_split}] has {usable} usable; set train.prompts_per_step to at most {usable}, or give "
            "more data",
        )
    if usable < sized:
        raise ConfigError(
            "dapo.max_round_prompts", f"a generation round draws up to {sized} prompts, but {cfg.data.path} "
            f"[{cfg.data.train_split}] has {usable} usable, so a round would draw {sized - usable} of them twice; set "
            f"dapo.max_round_prompts to at most {usable}, or give more data",
        )
    least, most = wanted * steps, max(wanted, sized) * steps * max_rounds(cfg)
    if cfg.dapo.skip_history and most <= usable:
        logger.warning("dapo.skip_history cannot act: the run draws at most %d prompts, no more than the %d usable "
                       "training prompts, so none is drawn twice and none has a history to be skipped on (it acts "
                       "from the second epoch on)", most, usable)
    if most == least:
        logger.info("data: the run draws %d prompts per step x %d steps = %d prompts, %.3g epochs of the %d "
                    "usable training prompts", wanted, steps, least, least / usable, usable)
    elif sized:
        logger.info(
            "data: the run trains %d prompts' groups per step x %d steps, so it draws at least about %d prompts, "
            "%.3g epochs of the %d usable training prompts (an estimate: dapo.max_round_prompts sizes each "
            "generation round by the keep rate, up to %d prompts, 1 to %d rounds a step, so up to %d prompts, %.3g "
            "epochs)", wanted, steps, least, least / usable, usable, sized, max_rounds(cfg), most, most / usable,
        )
    else:
        logger.info(
            "data: the run draws %d prompts per generation round x %d steps = %d prompts, %.3g epochs of the %d "
            "usable training prompts (an estimate: dynamic sampling runs 1 to %d rounds a step, so up to %d "
            "prompts, %.3g epochs)", wanted, steps, least, least / usable, usable, max_rounds(cfg), most,
            most / usable,
        )


def missing_split(data_cfg: DataConfig, split: str) -> str | None:
    """Why `split` of data.path cannot be read (None: it can): a run without evals has not read its
    eval split, and the end-of-run summary must not suggest an eval that fails."""
    try:
        load_split(data_cfg, split)
    except UserError as exc:
        return str(exc)
    return None


def eval_subset(cfg: Config, split: list[Prompt]) -> list[Prompt]:
    """The fixed items of every periodic eval (eval.num_items of the eval split; 0 = all), saying so
    when eval.num_items asks for more than the split holds."""
    if cfg.eval.num_items > len(split):
        logger.warning("eval.num_items=%d is more than the %d items of %r: every periodic eval covers all %d "
                       "(eval.num_items=0 means all)", cfg.eval.num_items, len(split), cfg.data.eval_split, len(split))
    return fixed_eval_subset(split, cfg.eval.num_items)


def _log_final_eval_cost(cfg: Config, periodic: int, final: int) -> None:
    """Say at start what the end-of-run eval on the whole split adds (eval.final_full): nothing when
    the periodic eval already covers the split (its last records are reused)."""
    if not final or periodic == final:
        return
    compared = f", {final / periodic:.1f}x a periodic eval of {periodic} items" if periodic else ""
    logger.info(
        "eval.final_full: the run ends with a greedy eval on all %d items of %r%s (eval.final_full=false skips it)",
        final, cfg.data.eval_split, compared,
    )


def prepare_reference(cfg: Config, accelerator: Accelerator, model, unwrapped) -> Reference | None:
    """dapo.beta > 0: the frozen reference, prepared as the policy was (accelerate's mixed-precision
    autocast, the device) but not wrapped for training, so that while the policy's weights are the
    reference's their log-probs agree and the KL is 0. With LoRA it is the prepared policy itself."""
    ref_model, scope = reference_policy(cfg, model, unwrapped, accelerator.device)
    if ref_model is None:
        return None
    if ref_model is not model:
        ref_model = accelerator.prepare_model(ref_model, evaluation_mode=True)
    return Reference(ref_model, scope)


def _warn_inert_settings(cfg: Config) -> None:
    """Say at start which settings cannot act as configured."""
    if cfg.train.updates_per_step > cfg.train.prompts_per_step:
        logger.warning(
            "train.updates_per_step=%d > train.prompts_per_step=%d: updates train whole groups, so a step makes "
            "at most %d", cfg.train.updates_per_step, cfg.train.prompts_per_step, cfg.train.prompts_per_step,
        )
    if not clip_can_act(cfg):
        low, high = clip_bound_keys(cfg.dapo.policy_loss)
        logger.warning(
            "dapo.%s / dapo.%s cannot act: each rollout batch gets one on-policy update (ratio 1, carried-over "
            "groups aside); set train.updates_per_step > 1 (or dapo.num_iterations > 1) to let it act", low, high,
        )
    if not cfg.rollout.tools and any(spec.name == "tool_format" for spec in cfg.rewards):
        logger.warning("the reward tool_format cannot act: rollout.tools names no tool, so no completion makes a "
                       "call and it scores 0")
    for note in (keep_best_note(cfg), stop_note(cfg), warmup_note(cfg), sampled_note(cfg)):
        if note is not None:
            logger.warning("%s", note)
    for message in inert_settings(cfg.rollout, torch.cuda.is_available()):
        logger.warning(message)
    inert = inert_objective_keys(cfg)
    if inert:
        logger.warning("%s cannot act: dapo.policy_loss=%s reads %s", ", ".join(inert), cfg.dapo.policy_loss,
                       " / ".join(f"dapo.{key}" for key in OBJECTIVE_KEYS[cfg.dapo.policy_loss]))


def _log_speed_settings(cfg: Config, batching: Batching, model, cuda: bool) -> None:
    """Say at start which speed settings act, and which cannot."""
    from dapo_train.model.scoring import attention_implementation

    logger.info("update: %s", "each group's prompt scored once for all its completions (train.shared_prefix)"
                if batching.share_prefix else "each completion scored with its own copy of the prompt "
                "(train.shared_prefix)")
    if cfg.train.shared_prefix == "auto" and not batching.share_prefix:
        logger.warning("train.shared_prefix=auto is off: the attention kernel %r takes no 4-D mask (sdpa and eager "
                       "do)", attention_implementation(model))
    if not cuda and cfg.model.dtype in ("bfloat16", "float16"):
        units = cfg.model.dtype == "bfloat16" and cpu_has_bf16_units()
        logger.warning(
            "model.dtype=%s on a CPU %s; rollout.dtype=%s samples from a %s copy of those weights%s",
            cfg.model.dtype, "(it has bf16 units: fine for speed)" if units else "without units for it: its matmuls "
            "run emulated, much slower than float32; set model.dtype=float32 for a CPU run", cfg.rollout.dtype,
            "float32" if cfg.rollout.dtype in ("auto", "float32") else cfg.rollout.dtype,
            " (rollout.dtype=bfloat16 samples from the weights themselves)" if cfg.rollout.dtype == "auto" else "",
        )
    if cfg.rollout.compile == "on" and not cuda:
        logger.warning("rollout.compile=on without CUDA: the rollout uses transformers' static KV cache, but "
                       "transformers compiles its decode step on CUDA only")
