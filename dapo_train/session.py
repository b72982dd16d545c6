"""One training session's objects, built once: the accelerator and seeds, rewards, prompts, the model
and its optimizer (the Learner), the rollout engine and the dynamic-sampling buffer (`Run`).

`setup` checks what is cheap first (rewards, engine, policy objective, data) so that bad input
fails in one line before the model loads, and says at start which settings cannot act.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from dapo_train import distributed
from dapo_train.batches import Batching
from dapo_train.behaviour import log_behaviour, resolve, rollout_differences
from dapo_train.collect import GroupBuffer
from dapo_train.config import Config
from dapo_train.data import Prompt, PromptSampler, fixed_eval_subset, load_prompts
from dapo_train.modeling import (
    gradient_checkpointing,
    load_policy,
    load_tokenizer,
    mixed_precision,
    reference_policy,
    trainable_parameters,
)
from dapo_train.old_logprobs import clip_can_act
from dapo_train.optim import adamw
from dapo_train.rewards import RewardSet, rewards_from_config
from dapo_train.rollout import RolloutEngine, build_engine, engine_factory, pad_token_id
from dapo_train.update import Learner, Reference, loss_settings

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
    eval_prompts: list[Prompt]
    buffer: GroupBuffer
    prompts_by_uid: dict[str, Prompt]
    step: int = 0
    bad_steps: int = 0
    saved_step: int | None = None  # the step of the checkpoint on disk that holds these weights

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model


def start_accelerator(cfg: Config, cuda: bool, run_dir: Path):
    """The Accelerator (under torchrun / accelerate launch it joins the other ranks; its trackers
    write under the run folder), this rank's seeds, and a log line from each rank saying what it does."""
    from accelerate import Accelerator

    accelerator = Accelerator(
        mixed_precision=mixed_precision(cfg, cuda), cpu=not cuda, log_with=cfg.logging.trackers or None,
        project_dir=str(run_dir),
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
    """Validate cheap things first (rewards, engine, objective, data), then load the model."""
    cuda = torch.cuda.is_available()
    accelerator = start_accelerator(cfg, cuda, run_dir)
    if cfg.train.num_threads > 0:
        torch.set_num_threads(cfg.train.num_threads)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    reward_set = rewards_from_config(cfg)
    engine_factory(cfg.rollout.engine)  # an unknown engine or objective fails here, before anything loads
    loss_settings(cfg)
    tokenizer = load_tokenizer(cfg.model)
    train_prompts, _ = load_prompts(cfg.data, tokenizer, cfg.data.train_split)  # each split logs its row counts
    eval_prompts = []
    if cfg.eval.every_steps > 0:
        all_eval, _ = load_prompts(cfg.data, tokenizer, cfg.data.eval_split)
        eval_prompts = fixed_eval_subset(all_eval, cfg.eval.num_items)
    model = load_policy(cfg, accelerator.device, resume_from)
    if gradient_checkpointing(cfg, cuda):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, optimizer = accelerator.prepare(model, adamw(cfg, trainable_parameters(model)))
    unwrapped = accelerator.unwrap_model(model)
    with distributed.full_weights(accelerator, model):  # a rollout copy is made of whole weights
        engine = build_engine(cfg.rollout, unwrapped, tokenizer)
    behaviour = resolve(cfg, rollout_differences(cfg, engine, unwrapped, cuda))
    learner = Learner.build(cfg, model, optimizer, accelerator, pad_token_id(unwrapped, tokenizer),
                            prepare_reference(cfg, accelerator, model, unwrapped), behaviour=behaviour)
    log_behaviour(behaviour, cfg, unwrapped)
    _log_speed_settings(cfg, learner.batching, unwrapped, cuda)
    _warn_inert_settings(cfg)
    return Run(
        cfg=cfg, run_dir=run_dir, accelerator=accelerator, tokenizer=tokenizer, reward_set=reward_set,
        learner=learner, engine=engine, prompt_sampler=PromptSampler(train_prompts, cfg.seed),
        eval_prompts=eval_prompts, buffer=GroupBuffer(), prompts_by_uid={p.uid: p for p in train_prompts},
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
        logger.warning(
            "dapo.eps_low / dapo.eps_high cannot act: each rollout batch gets one on-policy update (ratio 1, "
            "carried-over groups aside); set train.updates_per_step > 1 (or dapo.num_iterations > 1) to let it act"
        )


def _log_speed_settings(cfg: Config, batching: Batching, model, cuda: bool) -> None:
    """Say at start which speed settings act, and which cannot."""
    from dapo_train.logprobs import attention_implementation

    logger.info("update: %s", "each group's prompt scored once for all its completions (train.shared_prefix)"
                if batching.share_prefix else "each completion scored with its own copy of the prompt "
                "(train.shared_prefix)")
    if cfg.train.shared_prefix == "auto" and not batching.share_prefix:
        logger.warning("train.shared_prefix=auto is off: the attention kernel %r takes no 4-D mask (sdpa and eager "
                       "do)", attention_implementation(model))
    if cfg.rollout.compile == "on" and not cuda:
        logger.warning("rollout.compile=on without CUDA: the rollout uses transformers' static KV cache, but "
                       "transformers compiles its decode step on CUDA only")
