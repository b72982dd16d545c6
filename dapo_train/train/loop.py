"""The DAPO training loop (arXiv 2503.14476); the only module that knows the order of the stages.

Each step (one rollout batch; train.max_steps counts these), in train_step:
  1. collect     -- rounds of generation until the batch holds train.prompts_per_step informative
                    groups or rounds run out: G completions per prompt, rewards, group advantages
                    (Eq. 9), dynamic sampling (Eq. 11), surplus carried over (collect/rounds.py)
  2. old logprobs -- the log-probs of the policy that sampled, for every group a later update trains
                    after the policy moved, or the rollout's own when it is the training forward
                    (update/old_policy.py)
  3. update      -- the plan every rank agrees on, then train.updates_per_step mini-batches x
                    dapo.num_iterations passes, each an optimizer step on the token-level objective
                    (Eq. 10, 12), exact over micro-batches and ranks (update/passes.py, ranks.py, update/optim.py)
  4. sync        -- the rollout engine takes the new weights
  5. log         -- metrics.jsonl + training_losses.txt / accuracy_losses.txt (run/logs.py); the bar
                    or a line per step (progress.py); a sample of the step's groups, dropped ones
                    too, in rollouts/step_<N>.jsonl (collect/rollout_sample.py, run/rollouts.py)
Around the steps: greedy eval on a fixed subset every eval.every_steps, step 0 first, and at the end
on the whole eval split (eval.final_full), each eval's per-item records in eval_items/
(evaluation/generate.py, run/eval_items.py) and every eval after step 0 paired with step 0's (its change,
strict and answer accuracy, with intervals), a run worse than step 0 by the regression test said, or stopped
with eval.stop_on_regression (regression.py); checkpoint_<step>/ atomically every checkpoint.every_steps and at
the end, before the whole-split eval (state.py, run/checkpoint.py). The Run the loop works on is built by
session.setup.

Where this departs from the paper's recipe, on purpose: dynamic sampling runs a bounded number of
rounds and then trains on what it kept (or skips the update) instead of sampling until full;
informative groups beyond the batch carry over to the next step with the old log-probs of the
policy that generated them instead of being dropped; evaluation is greedy on fixed items.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import DoesNotFit, RunRegressed, TaskSolved, TrainingAborted
from dapo_train.evaluation.generate import EvalStopped
from dapo_train.faults import SYNC_STEP, out_of_memory_at
from dapo_train.rollout.engines import pause, release
from dapo_train.run import checkpoint as ckpt
from dapo_train.run.config_changes import warn_config_changes
from dapo_train.run.eval_items import FINAL, drop_items
from dapo_train.run.folder import (
    checkpoint_step,
    finished,
    finished_message,
    open_run_dir,
    prepare_run_dir,
    resume_command,
    set_aside_abandoned,
)
from dapo_train.run.lock import hold_folder
from dapo_train.run.logs import MetricsLogger, RunLog
from dapo_train.run.rollouts import drop_rollouts, write_rollouts
from dapo_train.run.signals import StopRequested
from dapo_train.run.trackers import NullTracker, start_trackers
from dapo_train.train import distributed, evals, ranks
from dapo_train.train.collect.rollout_sample import RolloutSample, merge
from dapo_train.train.collect.rounds import fill_batch
from dapo_train.train.progress import Progress
from dapo_train.train.ranks import total
from dapo_train.train.records import StepBatch
from dapo_train.train.session import Run, setup
from dapo_train.train.state import StepStart, check_disk, restore, save
from dapo_train.train.summary import end_of_run_summary
from dapo_train.train.update.old_policy import (
    needing_old_logprobs,
    require_behaviour_logprobs,
    require_kept_mass,
)
from dapo_train.train.update.passes import rollout_metrics

logger = logging.getLogger(__name__)


def step_evals(run: Run, stop: StopRequested) -> dict:
    """The evals due after a step: the fixed subset every eval.every_steps and at the last step; at the last
    step the checkpoint, then (eval.final_full) the whole split: final_eval."""
    cfg, metrics, records = run.cfg, {}, None
    last = run.step == cfg.train.max_steps
    if _due(run.step, cfg.eval.every_steps) or (cfg.eval.every_steps > 0 and last):
        metrics, records = evals.evaluate(run, run.eval_prompts)
        run.last_eval = ckpt.CheckpointScore(run.step, metrics["accuracy"])  # ranks this step's checkpoint
    if last:
        save_clean(run)  # before the whole-split eval: a stop or a kill during it must not cost the weights
        if cfg.eval.final_full:
            metrics.update(final_eval(run, stop, records))
    return metrics


def final_eval(run: Run, stop: StopRequested, records: list[dict] | None) -> dict:
    """The end-of-run eval on the whole split, from the subset's `records` when the subset is the whole split
    (eval.num_items 0 or larger). The training is over: a stop ends this eval at its next chunk of items,
    keeps nothing of it and sets run.final_eval_stopped (the summary then names the eval command)."""
    whole = records if records is not None and len(run.eval_prompts) == len(run.final_prompts) else None
    try:
        with stop.during("ending the final eval (the training finished; its last checkpoint is saved)"):
            return evals.evaluate(run, run.final_prompts, FINAL, whole, stop)[0]
    except EvalStopped:
        _stop_agreed(stop)  # every rank takes the signal of the one that had it, for its exit status
        run.final_eval_stopped = True
        return {}


def train_step(run: Run) -> dict:
    """One step (one rollout batch), numbered as in the module docstring. -> the step's metrics."""
    start = time.perf_counter()
    run.card_memory.begin_step()  # the card's peaks from here (CUDA; card_memory.py)
    sample = RolloutSample.for_step(run.cfg, run.step + 1)
    with distributed.full_weights(run.accelerator, run.model) as model:  # whole on this rank: generation, scoring
        batch = collect(run, sample)  # 1
        metrics = {**batch.metrics, **score_old_logprobs(run, batch, model)}  # 2
    if metrics["groups_kept"]:  # over all ranks: a rank without groups of its own still joins the update
        update_start = time.perf_counter()
        pause(run.engine)  # generation's memory (vllm's KV cache) free for the update
        metrics.update(run.guard.update(run.learner, batch, run.cfg, run.step))  # 3 (update/out_of_memory.py)
        run.engine_stale = not sync_weights(run)  # 4
        metrics["seconds_update"] = time.perf_counter() - update_start
    else:
        metrics.update(skipped_no_groups=1, lr=run.learner.optimizer.lr, **rollout_metrics([]))  # progress.py says so
    metrics["rollout_exact"] = int(not run.learner.behaviour.differences)  # the rollout IS the training forward
    run.step += 1
    run.rollouts = record_rollouts(run, sample, batch)  # 5
    run.health.record(run.step, metrics)
    metrics["seconds_step"] = time.perf_counter() - start
    metrics["tokens_per_second"] = metrics["generated_tokens"] / max(metrics["seconds_step"], 1e-9)
    return {**metrics, **run.card_memory.step_metrics(run.step)}


def collect(run: Run, sample: RolloutSample | None = None) -> StepBatch:
    """Step 1 (Eq. 9, 11): generation rounds until the step's batch is full, then its groups; every
    generated group is offered to `sample`."""
    return fill_batch(run.engine, run.reward_set, run.prompt_sampler, run.buffer, run.cfg,
                      version=run.learner.optimizer.steps, sample=sample, keep_rate=run.keep_rate,
                      history=run.history)


def record_rollouts(run: Run, sample: RolloutSample, batch: StepBatch) -> list[dict]:
    """Step 5's rollout records: every rank's sampled groups, fates settled against the groups this
    step trained, gathered (ranks.py) and written by the main process as rollouts/step_<N>.jsonl.
    -> the records on the main process (for the progress log and the trackers), [] elsewhere."""
    if run.cfg.logging.rollout_groups == 0:
        return []
    per_rank = ranks.gather_rollouts(sample.settle(batch.groups))
    if not distributed.is_main():
        return []
    records = merge(per_rank, run.cfg.logging.rollout_groups)
    write_rollouts(run.run_dir, run.step, records)
    return records


def score_old_logprobs(run: Run, batch: StepBatch, model: torch.nn.Module) -> dict:
    """Step 2: old log-probs, while `model` (the training weights, whole) is still the policy that
    sampled, for this step's groups and the surplus carried over."""
    start = time.perf_counter()
    behaviour = run.learner.behaviour
    if behaviour.old_from_rollout:  # the behaviour log-probs are the old ones: no pass
        require_behaviour_logprobs(batch.groups + run.buffer.groups, run.cfg.rollout.engine)
    require_kept_mass(batch.groups, run.cfg, behaviour)
    groups = needing_old_logprobs(run.cfg, batch.groups, run.buffer.groups, behaviour)
    rows = run.guard.old_logprobs(model, groups, run.learner, run.step)  # redone smaller out of memory
    return {"old_logprob_rows": int(total(rows)), "seconds_old_logprobs": time.perf_counter() - start}


def sync_weights(run: Run) -> bool:
    """Step 4: the next rollout samples from the updated policy. -> False when the engine ran out of memory taking
    the weights (vllm loading them on the card): the step trained, and the loop ends the run with its checkpoint."""
    with distributed.full_weights(run.accelerator, run.model):
        try:
            out_of_memory_at(SYNC_STEP, run.step + 1)  # a test's fault (faults.py); nothing otherwise
            run.engine.sync_weights()
        except torch.OutOfMemoryError:
            return False
    return True


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def train(
    cfg: Config, *, resume: str | Path | bool | None = None, overwrite: bool = False, stop: StopRequested | None = None
) -> Path:
    """Run (or resume) training; returns the run directory. resume: True = the latest checkpoint in
    output_dir, or a checkpoint folder. Resuming a finished run says so and changes nothing."""
    stop, started = stop or StopRequested(), time.monotonic()
    run_dir, resume_from = prepare_run_dir(cfg, resume, overwrite)
    with hold_folder(run_dir, "output_dir"):  # another run into this folder refuses until this one ends
        if resume_from is not None and finished(cfg, resume_from):
            print(finished_message(cfg, run_dir, resume_from), flush=True)
            return run_dir
        _train_session(cfg, run_dir, resume_from, overwrite, stop, started)
    return run_dir


def _train_session(cfg: Config, run_dir: Path, resume_from: Path | None, overwrite: bool, stop: StopRequested,
                   started: float) -> None:
    """train() in its folder, held: set up, the folder opened, the steps, the summary and how the run ended."""
    if resume_from is not None:
        warn_config_changes(cfg, resume_from)
    run = setup(cfg, run_dir, resume_from)
    try:
        _run_session(run, resume_from, overwrite, stop, started)
    finally:
        release(run.engine)  # its memory (vllm's KV cache) given back: a sweep's next point starts in this process


def _run_session(run: Run, resume_from: Path | None, overwrite: bool, stop: StopRequested, started: float) -> None:
    """train()'s run once set up: the folder opened, the steps, the report; TrainingAborted, TaskSolved or
    RunRegressed for how it ended."""
    cfg, run_dir = run.cfg, run.run_dir
    check_disk(run, resume_from, replacing=overwrite)
    run.started = started
    main = distributed.is_main()  # the one process that writes the run's logs and checkpoints
    distributed.barrier()  # every rank has checked output_dir before the main process may replace it
    if main:
        open_run_dir(cfg, replace=overwrite and resume_from is None)  # only now: bad input must not cost the old run
    distributed.barrier()
    if resume_from is not None:  # before run.log: a checkpoint that does not fit this run's data is bad input
        restore(run, ckpt.load_state(resume_from), resume_from)
    with RunLog(run_dir, resumed=resume_from is not None) if main else contextlib.nullcontext() as run_log:
        _open_session(run, resume_from)
        ending = _train_steps(run, stop, resumed=resume_from is not None)
        if main:
            _report(run, run_log, stop, ending, time.monotonic() - started if resume_from is not None else None)
        if ending.aborted is not None:
            raise TrainingAborted(f"step {run.step}: {ending.aborted}")
        if ending.solved is not None:
            raise TaskSolved(f"step {run.step}: {ending.solved}; the result is {ckpt.latest_checkpoint(run_dir)}")
        if ending.regressed is not None:
            raise RunRegressed(f"{ending.regressed}; stopped there (eval.stop_on_regression), its checkpoint "
                               f"{ckpt.latest_checkpoint(run_dir)} saved")


@dataclass(frozen=True)
class Ending:
    """Why the steps ended before train.max_steps or a stop, each None when it did not: the run aborted
    (train/health.py), is solved (the same) or regressed (train/regression.py, eval.stop_on_regression)."""

    aborted: str | None = None
    solved: str | None = None
    regressed: str | None = None

    @property
    def name(self) -> str | None:
        """How the summary says it ended: 'aborted', 'solved', 'regressed', or None (finished or stopped)."""
        return next((name for name in ("aborted", "solved", "regressed") if getattr(self, name) is not None), None)


def _open_session(run: Run, resume_from: Path | None) -> None:
    """The run folder as the session starts: the partial checkpoints of killed saves removed, what came after
    a resumed run's checkpoint set aside, a fresh run's old records dropped; the config it runs with saved."""
    if resume_from is not None:
        logger.info("resumed from %s at step %d", resume_from, run.step)
    if distributed.is_main():
        ckpt.remove_dead_saves(run.run_dir)  # a kill -9 during a save left its partial folder
        if resume_from is None:
            drop_items(run.run_dir)  # a fresh start, as MetricsLogger empties the logs
            drop_rollouts(run.run_dir)
        else:
            set_aside_abandoned(run.run_dir, run.step)  # what came after the checkpoint (evals too): moved, not lost
        run.budgets.save_config(run.cfg, run.learner.batching, run.engine, run.run_dir / ckpt.CONFIG_FILE)


def _train_steps(run: Run, stop: StopRequested, resumed: bool) -> Ending:
    """The steps until train.max_steps, a stop, or the run's own verdict, and the last checkpoint."""
    cfg, main = run.cfg, distributed.is_main()
    resume_step = run.step if resumed else None
    # Only the main process writes the run's logs and shows progress.
    metrics_log = MetricsLogger(run.run_dir, start_trackers(run.accelerator, cfg, resume_step),
                                resume_step=resume_step) if main else NullTracker()
    progress = Progress(cfg, run.step) if main else NullTracker()
    aborted = solved = regressed = None
    try:
        if resumed:
            evals.resume_start(run)
        elif cfg.eval.every_steps > 0:
            _log(run, metrics_log, progress, evals.evaluate(run, run.eval_prompts)[0])
        while run.step < cfg.train.max_steps and not _stop_agreed(stop):
            start = StepStart.take(run)
            try:
                metrics = train_step(run)
            except DoesNotFit as exc:  # the weights are the last good step's, or moved (update/out_of_memory.py)
                raise DoesNotFit(f"{exc}; {_keep_last_good(run, start, exc.kept)}", exc.kept) from None
            if run.engine_stale:  # the step trained; its engine lacks the weights: no eval of them, the step kept
                _log(run, metrics_log, progress, metrics)
                raise DoesNotFit(f"the rollout engine ran out of memory taking step {run.step}'s weights "
                                 f"(rollout.engine={cfg.rollout.engine}; what cuts its memory: a smaller "
                                 f"rollout.vllm_memory, rollout.generation_batch_size); {_keep_trained(run)}")
            aborted = run.health.abort_reason(cfg, run.step, run.run_dir)
            solved = run.health.solved(cfg) if aborted is None else None
            if aborted is None:  # no eval of weights that stop the run
                metrics.update(step_evals(run, stop))
            _log(run, metrics_log, progress, metrics)
            regressed = evals.regression(run, metrics) if aborted is None else None
            if aborted is not None or solved is not None or regressed is not None:
                break
            if _due(run.step, cfg.checkpoint.every_steps) and run.step < cfg.train.max_steps:
                save_clean(run)
        if aborted is None and run.step < cfg.train.max_steps and run.saved_step != run.step:
            save_clean(run)  # solved, regressed or a stop (bad steps that left the weights clean); the end saved
    finally:
        progress.close()
        metrics_log.close()
    return Ending(aborted, solved, regressed)


def _keep_last_good(run: Run, start: StepStart, kept: bool) -> str:
    """A run stopped out of memory in a step: the last good step's checkpoint, its weights (`kept`: the failed
    step moved none) at its own data position (`start`, the failed step's), saved now unless it is on disk, so a
    resume trains the failed step's prompts; the command that resumes once a setting has changed. Weights the
    failed step moved are no step's: the last checkpoint on disk is what is left, and the line says what that
    costs."""
    last = ckpt.latest_checkpoint(run.run_dir)
    if not kept:
        behind = f"{last.name}, the last checkpoint saved, holds step {checkpoint_step(last)}: steps " \
            f"{checkpoint_step(last) + 1}-{run.step} will train again" if last is not None else "no checkpoint saved"
        return f"the step had moved the weights, so step {run.step}'s are gone; {behind}; change a setting, then " \
            f"resume with: {resume_command(run.run_dir)}"
    if run.step == 0:
        return "no step had trained: nothing saved"
    start.rewind(run)  # the failed step's prompts, carried-over groups and random state, as it began
    if run.saved_step != run.step:
        save_clean(run)
    last = ckpt.latest_checkpoint(run.run_dir)
    if last is None:
        return "no checkpoint saved"
    return f"{last.name} holds the last good step: change a setting, then resume with: {resume_command(run.run_dir)}"


def _keep_trained(run: Run) -> str:
    """A run stopped out of memory after its step trained: that step's checkpoint, and the command that resumes."""
    if run.saved_step != run.step:
        save_clean(run)
    last = ckpt.latest_checkpoint(run.run_dir)
    return f"{last.name} holds step {run.step}, trained: change a setting, then resume with: " \
        f"{resume_command(run.run_dir)}" if last is not None else "no checkpoint saved"


def _report(run: Run, run_log: RunLog, stop: StopRequested, ending: Ending, session_s: float | None) -> None:
    """The end-of-run summary (finished, solved, regressed, stopped or aborted), and for a stop the command that
    resumes or, once every step is done, what the stop cut short and the command that evaluates the
    checkpoint: on the console and in run.log."""
    trained = run.step >= run.cfg.train.max_steps  # a stop after the last step stops nothing of the training
    name = ending.name or ("stopped" if stop.requested and not trained else "finished")
    run_log.end(name, run.step)
    run_log.say(end_of_run_summary(run.run_dir, run.step, run.cfg.train.max_steps, run.wall_seconds, name,
                                   session_s, run.eval_split_missing, run.best, run.cfg.checkpoint.keep_best))
    if name == "stopped":
        run_log.say(stop.resume_line(run.run_dir, distributed.world_size()), sys.stderr)
    elif run.final_eval_stopped:
        run_log.say(stop.final_eval_line(ckpt.latest_checkpoint(run.run_dir)), sys.stderr)


def save_clean(run: Run) -> None:
    """A periodic checkpoint, unless the weights are suspect (train/health.py): then say why none is saved."""
    if run.health.suspect:
        logger.warning("step %d: checkpoint_%d not saved: a non-finite step since step %d, the last that trained",
                       run.step, run.step, run.health.last_trained)
        return
    save(run)


def _stop_agreed(stop: StopRequested) -> bool:
    """A signal reaches the ranks at different moments (or only some of them): all stop at the same
    step boundary, the first one at which any rank has it, with that signal's exit code."""
    signum = int(distributed.all_reduce([stop.signum or 0], op="max")[0])
    if signum and not stop.requested:
        stop.request(signum)
    return stop.requested


def _log(run: Run, metrics_log: MetricsLogger, progress: Progress, metrics: dict) -> None:
    """The step's metrics to the logs and the progress lines; its rollout records (train_step's, none for
    the eval before training) to the progress log and, every logging.rollout_every steps, the trackers."""
    metrics = {**metrics, "num_processes": distributed.world_size()}
    if run.rollouts:
        progress.log_rollouts(run.step, run.rollouts)
        if _due(run.step, run.cfg.logging.rollout_every):
            metrics_log.log_rollouts(run.step, run.rollouts)
    metrics_log.log(run.step, metrics)
    progress.log(run.step, metrics)
