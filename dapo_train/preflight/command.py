"""`dapo-train preflight CONFIG [KEY=VALUE ...]`: the config's own pipeline rehearsed end to end in about
a minute on the machine at hand, before GPU hours are spent on it.

It reads the config's model config and tokenizer (never the weights), its data (every row, under the
chat template) and rehearses a call of rollout.tools at that template (real_run.py), then runs the
training loop on a rehearsal model (rehearsal.py): rollout with the
config's engine and sampling, every configured reward, the old-policy pass, the objective and its
correction, updates with a non-zero gradient, an eval, a checkpoint, a resume from it and an export.
It prints what it saw (report.py: the data, one prompt as the model sees it, the rewards on rehearsal
completions, each phase's time, the real model's estimated peak memory on a CUDA card) and ends with
"ready", or with the first problem in one line (exit 2). Everything is written to a temporary folder, removed
afterwards unless --keep names one. What it proves and what it does not: docs/training.md (Preflight).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.model.threads import set_cpu_threads
from dapo_train.preflight import coverage, real_run, rehearsal
from dapo_train.preflight.export_check import check_export
from dapo_train.preflight.report import CollectedWarnings, Report, on_main, phase
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.run.layout import run_kind
from dapo_train.run.lock import hold_folder
from dapo_train.run.outputs import OutputKind, holds_own, local_inputs, mark, remove_own
from dapo_train.train import distributed
from dapo_train.train.memory import ModelShape
from dapo_train.train.progress import CUT_WARNING

ROLLOUT_PROMPTS = 4  # prompts x G completions of the rollout check, scored by every reward
EOS_ROUNDS = 8  # the rollout check's rounds at most, until every EOS id has ended a completion
# The rehearsal model and a reward model's stand-in: written whole, their marker lists what they hold.
REHEARSAL_MODEL = OutputKind("rehearsal model folder", ".dapo-train-rehearsal-model", listed=True)
EXPORT_DIR = "export"


def kept_kind(cfg: Config) -> OutputKind:
    """What a rehearsal writes in its folder (run/outputs.py), which --keep may replace: its log, the
    rehearsal model and reward models' stand-ins, the run and the export (each holding only their own, and each
    marked: a run/ without its marker is no rehearsal's), and an export's temporary folder that a kill left."""
    from dapo_train.run.export import EXPORTED

    return OutputKind("dapo-train preflight folder", ".dapo-train-preflight", names=("preflight.log",),
                      patterns=(rf"\.{EXPORT_DIR}\.tmp\d+",),
                      nested=(("model", REHEARSAL_MODEL), (rf"{rehearsal.STAND_IN_PREFIX}\d+", REHEARSAL_MODEL),
                              ("run", dataclasses.replace(run_kind(cfg), older=None)), (EXPORT_DIR, EXPORTED)))


def preflight(cfg: Config, config_name: str, keep: str | None = None, shards: int = 1) -> Report:
    """Rehearse `cfg`; -> the report (raises UserError naming the first problem). Under torchrun or
    accelerate launch every rank rehearses its share, and rank 0 alone builds the model, checks the
    rollout, exports and reports."""
    cuda = torch.cuda.is_available()
    _join_ranks(cuda)
    kind, kept = kept_kind(cfg), Path(keep).expanduser() if keep else None
    earlier = kept is not None and holds_own(kept, kind, option="--keep", inputs=local_inputs(cfg), replace=True)
    with hold_folder(kept, "--keep") if kept is not None else contextlib.nullcontext():  # one rehearsal at a time
        if earlier and distributed.is_main():  # an earlier rehearsal kept there: what it wrote goes, nothing else
            remove_own(kept, kind, "--keep: removed what an earlier rehearsal wrote")
        return _run(cfg, config_name, kept, shards, cuda, kind)


def _run(cfg: Config, config_name: str, keep: Path | None, shards: int, cuda: bool, kind: OutputKind) -> Report:
    """The rehearsal in `keep` (kept) or a temporary folder (removed), its warnings collected for the report."""
    report, log, collected = Report(), io.StringIO(), CollectedWarnings()
    report.warnings = collected.messages  # the same list: filled while the phases run
    package = logging.getLogger("dapo_train")
    package.addHandler(collected)
    package.propagate = False  # the report lists them once instead of each phase printing its own
    chosen = (keep or Path(tempfile.mkdtemp(prefix="dapo-preflight-"))) if distributed.is_main() else None
    folder = distributed.broadcast(chosen)
    if distributed.is_main():
        mark(folder, kind)
    try:
        report.add("preflight", f"{config_name} on {'cuda: ' + torch.cuda.get_device_name() if cuda else 'cpu'} "
                   f"(torch {torch.__version__}, {distributed.world_size()} process(es)); rehearsal in {folder}")
        _rehearse(cfg, folder, cuda, report, log, shards, collected)
    finally:
        package.removeHandler(collected)
        package.propagate = True
        if distributed.is_main():
            if folder.is_dir():
                (folder / "preflight.log").write_text(log.getvalue())
            if not keep:
                shutil.rmtree(folder, ignore_errors=True)
    return report


def _join_ranks(cuda: bool) -> None:
    """Launched as several processes (WORLD_SIZE > 1): join their group now, before the trainer's
    accelerator does, so that rank 0 can hand the others the rehearsal folder and its findings."""
    import os

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")


def _rehearse(cfg: Config, folder: Path, cuda: bool, report: Report, log: io.StringIO, shards: int,
              collected: CollectedWarnings) -> None:
    from dapo_train.model.loading import load_model_config, load_tokenizer

    with phase(report, "read", log):
        real_run.check_cheap(cfg)
        model_config, generation = load_model_config(cfg.model)
        tokenizer = load_tokenizer(cfg.model)
    shape = ModelShape.from_config(model_config, cfg.model.lora)
    report.add("model", real_run.describe_model(cfg, shape, model_config, generation, tokenizer))
    with phase(report, "data", log):
        prompts, eval_split = real_run.report_data(cfg, tokenizer, report)
    if cfg.rollout.tools:
        with phase(report, "tool call", log):
            report.add("tool call", real_run.rehearse_tool_call(cfg, tokenizer))
    small, changes = rehearsal.shrink(cfg, folder / "model", folder / "run", cuda, eval_split)
    static = rehearsal.static_cache_check(cfg, cuda)
    collected.ignored += tuple(f"{change.key}=" for change in changes) + (("rollout.compile=",) if static else ())
    if any(change.key.endswith("max_new_tokens") for change in changes):  # the rehearsal's budget cut its answers,
        collected.ignored += (CUT_WARNING,)  # not the real one: no advice to raise it
    set_cpu_threads(small.train.num_threads)  # as the run's setup does, for the rollout check too
    model = None
    with on_main(report, "rehearsal model", log) as main:
        if main:
            r = small.rollout
            sampling = SamplingSettings(r.max_new_tokens, True, r.temperature, r.top_p, r.top_k)
            model = rehearsal.build_model(model_config, generation, tokenizer, folder / "model", sampling,
                                          engine=small.rollout.engine)
            for written in (folder / "model", *rehearsal.reward_stand_ins(cfg, folder)):
                mark(written, REHEARSAL_MODEL)
    width = rehearsal.width_and_heads(small.rollout.engine)[0]
    report.add("rehearsal", f"{rehearsal.LAYERS} layers of width {width}, random weights biased to stop "
               f"at each EOS id; shrunk: " + "; ".join(f"{c.key} {c.old} -> {c.new}" for c in changes))
    with on_main(report, "rollout check", log, every_rank=_engines_start_together(small)) as runs:
        if runs:  # with a card, the configured reward models' own weights, once
            model = model if model is not None else rehearsal.load_built(folder / "model")
            _report_rollout(_rollout_check_config(small, cfg, cuda), model, tokenizer, prompts[:ROLLOUT_PROMPTS],
                            report)
    rows = _train_and_resume(small, report, log)
    with on_main(report, "export", log) as main:
        if main:
            compared = _export_and_check(folder / "run", folder / EXPORT_DIR, small.model.lora.r > 0)
            report.add("export", f"dapo-train export{' --merge' if small.model.lora.r > 0 else ''} of "
                       f"checkpoint_{small.train.max_steps + 1}: {compared} tensors equal to the trained ones; plain "
                       "transformers loads it")
    report.add("memory", real_run.memory_estimate(cfg, shape, prompts, shards))
    report.add("disk", real_run.checkpoint_space(cfg, shape))
    report.add("phases", ", ".join(f"{name} {seconds:.1f}s" for name, seconds in report.seconds.items()))
    if report.warnings:
        report.add("warnings", "\n".join(report.warnings))
    report.add("not run", coverage.not_rehearsed(small, cuda, static))
    report.add("ready", coverage.rehearsed(small, cuda, rows, static))


def _engines_start_together(cfg: Config) -> bool:
    """Whether the rollout check's engine starts on every rank at once: vllm under several processes, whose
    engines join the ranks' process group (rollout/vllm_ranks.py). Then each rank checks the same rollout."""
    return cfg.rollout.engine == "vllm" and distributed.world_size() > 1


def _rollout_check_config(small: Config, cfg: Config, cuda: bool) -> Config:
    """The rollout check's config: the rehearsal's, with the configured reward models on a card, and the
    static-cache engine on a CPU where a card would run it (rehearsal.static_cache_check)."""
    checked = _real_reward_models(small, cfg) if cuda else small
    if rehearsal.static_cache_check(cfg, cuda):
        checked = dataclasses.replace(checked, rollout=dataclasses.replace(checked.rollout, compile="on"))
    return checked


def _real_reward_models(small: Config, cfg: Config) -> Config:
    """The rehearsal's config with each reward model's own path and tokenizer instead of its stand-in."""
    rewards = [dataclasses.replace(spec, args={**spec.args, "path": mine.args["path"],
                                               "tokenizer_path": mine.args.get("tokenizer_path")})
               if spec.name == rehearsal.REWARD_MODEL else spec for spec, mine in zip(small.rewards, cfg.rewards)]
    return dataclasses.replace(small, rewards=rewards + small.rewards[len(cfg.rewards):])


def _report_rollout(cfg: Config, model, tokenizer, prompts: list, report: Report) -> None:
    """The config's engine and sampling on the rehearsal model: how completions end, and every reward's
    mean and spread on them. Rounds of prompts x G repeat (at most EOS_ROUNDS) until every EOS id has
    ended a completion: one round's few completions may miss an id by chance, and an id the rollout does
    not stop at ends none in any round."""
    from dapo_train.rewards.scoring import rewards_from_config, score
    from dapo_train.rollout.completions import eos_token_ids
    from dapo_train.rollout.engines import build_engine, release

    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    r, group = cfg.rollout, cfg.rollout.group_size
    engine = build_engine(r, model, tokenizer, max_length=cfg.data.max_prompt_length + r.max_new_tokens)
    sampling = SamplingSettings(r.max_new_tokens, True, r.temperature, r.top_p, r.top_k)
    torch.manual_seed(cfg.seed)
    ended, first, rounds = dict.fromkeys(eos_token_ids(model, tokenizer), 0), [], 0
    try:
        while rounds < EOS_ROUNDS and not all(ended.values()):
            rounds += 1
            completions = engine.generate([p.input_ids for p in prompts], sampling, group)
            first = first or completions  # the first round's are scored
            for c in completions:
                if not c.truncated and int(c.completion_ids[-1]) in ended:
                    ended[int(c.completion_ids[-1])] += 1
    finally:
        release(engine)  # the rehearsal's run starts its own
    completions = first
    rewards = rewards_from_config(cfg).load(next(model.parameters()).device)  # reward models too, as a run does
    scores = score(rewards, [c.policy_text for c in completions], [p.gold for p in prompts for _ in range(group)],
                   lengths=[c.length for c in completions], prompts=[p.text for p in prompts for _ in range(group)],
                   questions=[p.question for p in prompts for _ in range(group)])
    means = "; ".join(f"{key} mean {statistics.fmean(values):+.3f} sd {statistics.pstdev(values):.3f}"
                      for key, values in scores.per_reward.items())
    stops = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} {n}" for i, n in ended.items())
    report.add("rollout", f"{type(engine).__name__}: {len(completions)} completions ({len(prompts)} prompts x "
               f"G={group}) truncated "
               f"{sum(c.truncated for c in completions)}, lengths {min(c.length for c in completions)}-"
               f"{max(c.length for c in completions)}; ended by {stops} in {rounds} round(s) of "
               f"{len(completions)}\nrewards: {means}")
    if not all(ended.values()):
        missing = [tokenizer.convert_ids_to_tokens(i) for i, n in ended.items() if not n]
        raise UserError(f"no completion of {rounds} x {len(completions)} ended with {', '.join(missing)}: the "
                        "rollout does not stop at every EOS id")


def _train_and_resume(cfg: Config, report: Report, log: io.StringIO) -> list[dict]:
    """Two steps (eval at step 0 and 2, checkpoint_2), then a resume from checkpoint_2 for a third.
    -> the run's metrics rows."""
    from dapo_train.config.load import load_config, read_saved_config
    from dapo_train.run.logs import read_metrics
    from dapo_train.train.loop import train

    with phase(report, "train", log):
        run_dir = train(cfg)
    with phase(report, "resume", log):
        checkpoint = run_dir / f"checkpoint_{cfg.train.max_steps}"
        saved = load_config(None, [f"train.max_steps={cfg.train.max_steps + 1}"],
                            base=read_saved_config(checkpoint / "config.yaml", notify=False))
        train(saved, resume=checkpoint)
        rows = read_metrics(run_dir)
    steps = [row for row in rows if "groups_kept" in row]
    updated = [row for row in steps if row.get("grad_norm", 0) > 0]
    if len(steps) != cfg.train.max_steps + 1:
        raise UserError(f"preflight resume: the run has {len(steps)} steps after the resume, expected "
                        f"{cfg.train.max_steps + 1}")
    if not updated:
        kept = ", ".join(f"step {row['step']}: {row['groups_kept']} groups kept" for row in steps)
        raise UserError(f"preflight train: no update ran with a non-zero gradient ({kept})")
    evals = [row for row in rows if "accuracy" in row]

    def total(key: str) -> float:
        return sum(row.get(key, 0.0) for row in rows)

    report.add("train", f"{len(steps)} steps ({len(updated)} with a non-zero gradient, grad norm "
               f"{max(r['grad_norm'] for r in updated):.3g}), {int(total('optimizer_steps'))} optimizer steps, "
               f"{int(total('groups_kept'))} groups trained, {len(evals)} evals, checkpoint_{cfg.train.max_steps} "
               f"resumed to step {len(steps)}\ngenerate {total('seconds_generate'):.1f}s, rewards "
               f"{total('seconds_score'):.1f}s, old log-probs {total('seconds_old_logprobs'):.1f}s, update "
               f"{total('seconds_update'):.1f}s, eval {total('seconds_eval'):.1f}s")
    return rows


def _export_and_check(run_dir: Path, out: Path, merge: bool) -> int:
    """The last checkpoint exported as a user would (a LoRA run merged), and checked against the
    trained tensors (export_check.py). -> tensors compared."""
    from transformers import AutoTokenizer

    from dapo_train.run.checkpoint import latest_checkpoint
    from dapo_train.run.export import export_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    exported = export_checkpoint(str(checkpoint), str(out), merge=merge)
    AutoTokenizer.from_pretrained(exported)
    return check_export(checkpoint, exported)


