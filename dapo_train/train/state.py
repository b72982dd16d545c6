"""The run's state across a checkpoint: what each rank saves beside the weights, and how a resumed
run takes it back, so that resume equals the uninterrupted run.

checkpoint_<step>/trainer_state.pt holds the run's position (step, optimizer steps, the prompt
order's state, the keep rate that sizes generation rounds, the prompt history, wall time, the best
checkpoint so far under checkpoint.keep_best, the memory budgets an out-of-memory error lowered:
lowered_budgets.py) and rank 0's own state; each rank r > 0 adds trainer_state_rank<r>.pt (its RNG
streams, its carried-over groups and, under FSDP/ZeRO, its optimizer shard). The folder's format
(atomic save, discovery, pruning) is run/checkpoint.py's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

from dapo_train.config.load import config_to_dict
from dapo_train.errors import CheckpointNotSaved, UserError
from dapo_train.model.random_state import rng_state, set_rng_state
from dapo_train.run import checkpoint as ckpt
from dapo_train.run import disk_space
from dapo_train.run.folder import checkpoint_step, resume_command
from dapo_train.run.layout import run_kind
from dapo_train.run.outputs import owned_bytes
from dapo_train.train import distributed
from dapo_train.train.health import StepHealth
from dapo_train.train.lowered_budgets import LOWERED_KEY, keep_lowered
from dapo_train.train.session import Run

logger = logging.getLogger(__name__)


def rank_state(run: Run) -> dict:
    """What differs between ranks: RNG streams, the dynamic-sampling carry-over, and under FSDP/ZeRO
    the optimizer shard. (The data order is the same on every rank: each takes its slice.)"""
    state = {"buffer": run.buffer.state_dict(), "rng": rng_state()}
    if distributed.shards_optimizer(run.accelerator, run.model):
        state["optimizer"] = run.learner.optimizer.state_dict()
    return state


def trainer_state(run: Run) -> dict:
    """trainer_state.pt: the run's position and rank 0's own state (rank_state)."""
    state = {
        "step": run.step,
        "bad_steps": run.health.nonfinite,  # what checkpoints before the health record read
        "health": run.health.state_dict(),
        "good": not run.health.suspect,  # run/checkpoint.py's pruning keeps the newest good checkpoint
        "optimizer_steps": run.learner.optimizer.steps,
        "sampler": run.prompt_sampler.state_dict(),
        "keep_rate": run.keep_rate.state_dict(),  # the same on every rank: saved once, read by all
        "history": run.history.state_dict(),  # the same on every rank too
        "num_processes": distributed.world_size(),
        "wall_seconds": run.wall_seconds,
        ckpt.BEST_KEY: run.best.state() if run.best is not None else None,  # pruning keeps it
        ckpt.SAVED_CONFIG_KEY: config_to_dict(run.cfg),  # what config.yaml said at the save: a resume names edits
        LOWERED_KEY: run.budgets.state(run.cfg, run.learner.batching, run.engine),  # a resume keeps them
        **rank_state(run),
    }
    state.setdefault("optimizer", run.learner.optimizer.state_dict())  # replicated under DDP: one copy, here
    return state


def restore(run: Run, state: dict, checkpoint: Path) -> None:
    """Every rank reads trainer_state.pt; rank r > 0 its own file too. A checkpoint of another
    number of processes resumes (the data order is shared) but does not reproduce the run."""
    run.step, run.health = int(state["step"]), StepHealth.from_state(state)
    run.seconds_before = float(state.get("wall_seconds", 0.0))
    # A checkpoint without the counter was written by a run that made one optimizer step per step.
    run.learner.optimizer.steps = int(state.get("optimizer_steps", run.step))
    run.prompt_sampler.load_state_dict(state["sampler"])
    run.keep_rate.load_state_dict(state.get("keep_rate"))
    run.history.load_state_dict(state.get("history"))
    run.best = _still_there(run, ckpt.recorded_best(state)) if run.cfg.checkpoint.keep_best else None
    keep_lowered(state, run.cfg, run.learner, run.engine, checkpoint.name)
    saved, ranks, rank = int(state.get("num_processes", 1)), distributed.world_size(), distributed.rank()
    if saved != ranks:
        if distributed.shards_optimizer(run.accelerator, run.model):
            raise UserError(
                f"{checkpoint} was saved by {saved} processes with a sharded optimizer (FSDP/ZeRO); resume it with "
                f"as many (torchrun --nproc_per_node {saved}, accelerate launch --num_processes {saved})"
            )
        logger.warning(
            "%s was saved by %d process(es), this run has %d: it continues, but ranks without a saved state start "
            "with fresh RNG streams and no carried-over groups, so it will not reproduce the original run",
            checkpoint, saved, ranks,
        )
    own = state if rank == 0 else ckpt.load_rank_state(checkpoint, rank)
    if own is not None:
        run.buffer.load_state_dict(own["buffer"], run.prompts_by_uid)
        set_rng_state(own["rng"])
    own_optimizer = own is not None and "optimizer" in own
    run.learner.optimizer.load_state_dict(own["optimizer"] if own_optimizer else state["optimizer"])
    run.saved_step = run.step


@dataclass(frozen=True)
class StepStart:
    """The run's position as a step begins: the prompt order's, the keep rate's and the prompt history's state,
    the carried-over groups and the random streams, all a step's collection moves. A step that ran out of memory
    before its update moved a weight is given back its start (`rewind`), so the checkpoint of the last good step
    holds that step's position and a resume trains the failed step's prompts (train/loop.py)."""

    state: dict

    @classmethod
    def take(cls, run: Run) -> StepStart:
        return cls(copy.deepcopy({"sampler": run.prompt_sampler.state_dict(), "keep_rate": run.keep_rate.state_dict(),
                                  "history": run.history.state_dict(), "buffer": run.buffer.state_dict(),
                                  "rng": rng_state()}))

    def rewind(self, run: Run) -> None:
        state = copy.deepcopy(self.state)
        run.prompt_sampler.load_state_dict(state["sampler"])
        run.keep_rate.load_state_dict(state["keep_rate"])
        run.history.load_state_dict(state["history"])
        run.buffer.load_state_dict(state["buffer"], run.prompts_by_uid)
        set_rng_state(state["rng"])



def save(run: Run) -> Path:
    """checkpoint_<step>/ from every rank: the full weights (gathered first under FSDP/ZeRO), then each
    rank r > 0 writes its own state into the temporary folder, then the main process completes and
    renames it. Every rank calls it at the same step; a write the disk refuses stops them all
    (CheckpointNotSaved), naming the last checkpoint saved and how to resume from it."""
    state_dict = distributed.full_state_dict(run.model)
    run.best = ranked_best(run)
    tmp, problem = None, None
    if distributed.is_main():
        try:
            tmp = ckpt.temporary_dir(run.run_dir, run.step)
        except CheckpointNotSaved as exc:
            problem = str(exc)
    tmp, problem = distributed.broadcast((tmp, problem))
    _stop_if(run, problem)
    if not distributed.is_main():
        ckpt.save_rank_state(tmp, distributed.rank(), rank_state(run))
    distributed.barrier()
    path = run.run_dir / f"checkpoint_{run.step}"
    if distributed.is_main():
        try:
            path = ckpt.save_checkpoint(
                run.run_dir, run.step, model=run.accelerator.unwrap_model(run.model), tokenizer=run.tokenizer,
                cfg=run.cfg, state=trainer_state(run), keep_last=run.cfg.checkpoint.keep_last, state_dict=state_dict,
                tmp=tmp,
            )
            logger.info("saved %s", path)
            run.budgets.note(run.cfg, run.learner.batching, run.engine, run.run_dir / ckpt.CONFIG_FILE)
        except CheckpointNotSaved as exc:
            problem = str(exc)
    _stop_if(run, distributed.broadcast(problem))  # every rank waits here, as at a barrier
    run.saved_step = run.step
    return path


def ranked_best(run: Run) -> ckpt.CheckpointScore | None:
    """checkpoint.keep_best: the best checkpoint once this step's is saved. This step's when its periodic
    eval beats the best so far; a tie keeps the earlier, the one already kept (HF Trainer does the same)."""
    score = run.last_eval
    if not run.cfg.checkpoint.keep_best or score is None or score.step != run.step:
        return run.best
    return score if run.best is None or score.accuracy > run.best.accuracy else run.best


def _still_there(run: Run, best: ckpt.CheckpointScore | None) -> ckpt.CheckpointScore | None:
    """A resumed run's recorded best, unless its folder is gone (removed by hand): ranking starts again."""
    if best is None or (run.run_dir / best.name).is_dir():
        return best
    logger.warning("checkpoint.keep_best: %s, the best checkpoint so far (eval accuracy %.3f), is not in %s; the "
                   "checkpoints from here on are ranked anew", best.name, best.accuracy, run.run_dir)
    return None


def _stop_if(run: Run, problem: str | None) -> None:
    if problem is None:
        return
    last = ckpt.latest_checkpoint(run.run_dir)
    then = (f"{last.name}, the last saved, is intact: free space, then resume with: {resume_command(run.run_dir)}"
            if last is not None else "no checkpoint was saved before it: free space, then start the run again")
    raise CheckpointNotSaved(f"{problem} and {then}")


def check_disk(run: Run, resume_from: Path | None, replacing: bool) -> None:
    """Before the first step: one checkpoint of this model (its saved weights, AdamW's moments of its
    trainable ones) times what the run holds at once, against the free space (run/disk_space.py);
    `replacing`: --overwrite is about to free what the old run wrote."""
    model = run.accelerator.unwrap_model(run.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    saved = trainable if run.cfg.model.lora.r > 0 else list(model.parameters())  # a LoRA run saves its adapter
    done = (checkpoint_step(resume_from) or 0) if resume_from is not None else 0
    existing = [c for c in ckpt.checkpoint_dirs(run.run_dir) if checkpoint_step(c) <= done] if done else []
    disk_space.check_disk_space(run.cfg, run.run_dir, disk_space.checkpoint_bytes(_bytes(saved), _bytes(trainable)),
                                done, len(existing), owned_bytes(run.run_dir, run_kind(run.cfg)) if replacing else 0)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
