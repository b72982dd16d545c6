"""`dapo-train eval CHECKPOINT...`: resolve targets, check everything, evaluate, write, compare.

Order matters: every target is resolved and its config, data split and tokenizer are checked
before any model loads, so a typo in the third checkpoint fails in a second, not after the first
two evaluations. Then one model at a time is loaded, evaluated with evaluate.evaluate_prompts and
its results written next to it, and one comparison table is printed at the end.

A checkpoint of a run that kept its step-0 eval records is also compared with them: the change from step 0
on the items both evals hold, with its paired interval, when this eval decodes as the run's did (greedy, no
setting that changes what is evaluated: evaluation/settings.py); else one line says which setting differs.

Where results go: eval_<what>.json (metrics, settings with the engine that generated, resolved config,
checkpoint, time) and completions_<what>.jsonl (one line per completion) inside the checkpoint or local
model folder; for a hub id, a builtin model, a --config-only run or a read-only folder, under
<output_dir>.eval/<model name>/: beside the run folder, never in it, so a run of the config still starts
there. <what> names what was evaluated (settings.result_name): the split, then _limit<N> for a --limit that
left items out, _k<K>_t<T> for sampling, _len<N> for a completion budget other than the checkpoint's own,
_tools, _<engine> for an engine other than the model's own decode loop (vllm), and any other setting that
changes what is evaluated (a system prompt, the data), so evals of different settings never overwrite each
other.

A bare checkpoint_N belongs to the latest run: the run under outputs/ whose training wrote last
(rundir.latest_run), which evaluating never changes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from dapo_train.config.load import CONFIG_FILE, config_to_dict, load_config, read_saved_config
from dapo_train.config.schema import Config
from dapo_train.errors import ConfigError, UserError, folder_listing
from dapo_train.evaluation.generate import eval_max_new_tokens, evaluate_prompts
from dapo_train.evaluation.settings import SettingChanges, result_name, safe_name, say_inert, setting_changes
from dapo_train.evaluation.stats import change_from_start, change_metrics
from dapo_train.evaluation.table import format_table
from dapo_train.model.loading import (
    MODEL_FILES,
    check_model_path,
    check_sequence_budget,
    compute_dtype,
    load_model,
    load_tokenizer,
)
from dapo_train.model.lora import ADAPTER_CONFIG, is_adapter_folder, require_peft
from dapo_train.model.threads import set_cpu_threads
from dapo_train.rollout.decoding import decode_region
from dapo_train.rollout.engines import build_engine, engine_factory, release, rollout_tools
from dapo_train.rollout.hf_engines import cast_as_loaded, rollout_dtype
from dapo_train.rollout.vllm_settings import check_memory
from dapo_train.run.checkpoint import CHECKPOINT_RE, best_checkpoint, checkpoint_dirs
from dapo_train.run.eval_items import PERIODIC, items_path, read_items
from dapo_train.run.files import write_json_atomic, write_jsonl_atomic
from dapo_train.run.folder import RUNS_ROOT, describe_runs, latest_run
from dapo_train.task.answers import answer_check
from dapo_train.task.locations import looks_like_path
from dapo_train.task.prompts import Prompt, fixed_eval_subset, load_prompts
from dapo_train.tools.turns import ToolTurns, tool_turns


@dataclass(frozen=True)
class EvalTarget:
    """One thing to evaluate. model: model.name_or_path to load (None: the config's own model);
    saved_config: a checkpoint's config.yaml; folder: a local folder results may be written into."""

    label: str
    model: str | None
    saved_config: Path | None = None
    folder: Path | None = None


@dataclass(frozen=True)
class EvalPlan:
    """A target with everything resolved and checked; only the model is left to load."""

    target: EvalTarget
    cfg: Config
    split: str
    prompts: list[Prompt]
    tokenizer: object
    batch_size: int
    max_new_tokens: int
    out_dir: Path
    result_name: str  # eval_<result_name>.json, completions_<result_name>.jsonl
    engine: str  # what generates: rollout.engine where it serves evals (vllm), else hf (the model's own loop)
    tools: ToolTurns | None = None  # the config's rollout.tools, listed in the prompts and run as in rollouts
    changes: SettingChanges = SettingChanges()  # against the checkpoint's own config (settings.setting_changes)


# --------------------------------------------------------------------------------------------
# Targets: a checkpoint path, a bare checkpoint_N, a model folder or hub id, or the config's model.


def _bare_checkpoint(name: str, run_dir: str | None) -> Path:
    run = Path(run_dir) if run_dir else latest_run()
    if not run.is_dir():
        raise UserError(f"--run-dir {run}: no such folder; {folder_listing(run)}")
    path = run / name
    if not path.is_dir():
        found = ", ".join(p.name for p in checkpoint_dirs(run)) or "none"
        where = f"run {run}" if run_dir else f"the latest run, {run} (trained last)"
        others = "" if run_dir else f"; runs under {RUNS_ROOT}/, latest first: {describe_runs()}; choose with --run-dir"
        raise UserError(f"{name} not found in {where}; its checkpoints: {found}{others}")
    return path


def _looks_local(target: str) -> bool:
    """A name the user meant as a path even though it does not exist (not a hub id)."""
    first = Path(target).parts[0] if Path(target).parts else target
    return (
        looks_like_path(target)
        or bool(CHECKPOINT_RE.match(Path(target).name))
        or Path(first).is_dir()
    )


def _folder_target(label: str, folder: Path) -> EvalTarget:
    saved = folder / CONFIG_FILE
    if not any((folder / name).is_file() for name in MODEL_FILES):
        found = ", ".join(p.name for p in checkpoint_dirs(folder))
        hint = f"; it looks like a run folder, its checkpoints: {found}" if found else f"; {folder_listing(folder)}"
        raise UserError(f"{label} is not a checkpoint or model folder (no config.json or {ADAPTER_CONFIG}){hint}")
    return EvalTarget(label, str(folder), saved if saved.is_file() else None, folder)


def resolve_target(target: str | None, run_dir: str | None) -> EvalTarget:
    """What `target` names; raises UserError for a path that does not exist."""
    if target is None:
        return EvalTarget("--config", None)  # relabelled with the config's model once it is read
    target = target.rstrip("/") or target
    path = Path(target).expanduser()
    if CHECKPOINT_RE.match(target) and not path.exists():
        found = _bare_checkpoint(target, run_dir)
        return _folder_target(str(found), found)
    if path.is_dir():
        return _folder_target(target, path)
    if target.startswith("builtin:"):
        check_model_path(target)  # a shipped model whose folder is missing fails here
        return EvalTarget(target, target)
    if path.exists():
        raise UserError(f"{target} is a file; give a checkpoint or model folder")
    if _looks_local(target):
        raise UserError(f"checkpoint or model folder not found: {target}; {folder_listing(path)}")
    return EvalTarget(target, target)  # a hub id; load_tokenizer reports it if unreachable


def _best_of(run_dir: str | None) -> EvalTarget:
    """--best: the best checkpoint the run folder records (checkpoint.keep_best), labelled as such."""
    if run_dir is None:
        raise UserError("--best needs the run folder whose best checkpoint to evaluate: dapo-train eval RUN --best")
    path, best = best_checkpoint(run_dir.rstrip("/") or run_dir)
    found = _folder_target(str(path), path)
    return dataclasses.replace(found, label=f"{path} (best: eval accuracy {best.accuracy:.3f} at step {best.step})")


# --------------------------------------------------------------------------------------------
# Config: the checkpoint's saved config <- --config <- KEY=VALUE; the target's model on top.


def target_config(target: EvalTarget, config_path: str | None, overrides: list[str]) -> Config:
    """The config that says how to evaluate `target` (data, split, prompt, budgets), with
    model.name_or_path set to the target itself: a checkpoint is evaluated, not its base model."""
    if target.saved_config is None and config_path is None:
        kind = "checkpoint" if target.folder and CHECKPOINT_RE.match(target.folder.name) else "model"
        raise UserError(
            f"{target.label}: this {kind} has no saved {CONFIG_FILE}; pass --config CONFIG to say which "
            "data, split and prompt to evaluate it on"
        )
    if target.saved_config is None:
        cfg = load_config(config_path, overrides)
        return cfg if target.model is None else _with_model(cfg, target.model)
    try:
        cfg = load_config(config_path, overrides, base=read_saved_config(target.saved_config))
    except ConfigError as exc:
        raise UserError(f"{exc} (config: {target.saved_config}{' + ' + config_path if config_path else ''})") from None
    return _with_model(cfg, target.model)


def _with_model(cfg: Config, model: str) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=model))


def own_config(target: EvalTarget, config_path: str | None) -> Config:
    """The config `target` was evaluated with in its run: its saved config.yaml (without --config or KEY=VALUE),
    or for a target without one the --config file alone; the setting changes of an eval are counted from it."""
    if target.saved_config is None:
        return target_config(target, config_path, [])
    return _with_model(load_config(None, [], base=read_saved_config(target.saved_config, notify=False)),
                       target.model)


def output_folder(target: EvalTarget, cfg: Config) -> Path:
    """The target's own folder when writable; else <output_dir>.eval/<model name>/, beside the run folder: a
    run never writes there, and its folder stays one it may start in (an eval/ inside it was none)."""
    if target.folder is not None and os.access(target.folder, os.W_OK):
        return target.folder
    run_dir = Path(cfg.output_dir)
    beside = Path(f"{run_dir if run_dir.name else run_dir.resolve()}.eval")  # output_dir=. names a folder too
    return beside / safe_name(target.model or cfg.model.name_or_path)


def eval_engine_name(cfg: Config) -> str:
    """The engine an eval of `cfg` generates with: rollout.engine where it serves evals (vllm), else hf: the
    model decodes itself in the hf engine's loop (hf-generate and plugins that do not serve evals alike)."""
    return cfg.rollout.engine if getattr(engine_factory(cfg.rollout.engine), "serves_eval", False) else "hf"


# --------------------------------------------------------------------------------------------
# The command.


@dataclass(frozen=True)
class EvalOptions:
    """The command-line settings of one `dapo-train eval` call (None = from the config)."""

    config_path: str | None = None
    split: str | None = None
    limit: int | None = None
    batch_size: int | None = None
    max_new_tokens: int | None = None
    samples: int = 1
    temperature: float = 1.0
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    best: bool = False  # each target is a run folder: evaluate its best checkpoint (checkpoint.keep_best)

    def check(self) -> None:
        checks = (
            (self.samples >= 1, f"--samples must be >= 1, got {self.samples}"),
            (self.samples == 1 or self.temperature > 0, f"--temperature must be > 0 to sample, got {self.temperature}"),
            (self.limit is None or self.limit >= 0, f"--limit must be >= 0 (0 = whole split), got {self.limit}"),
            (self.batch_size is None or self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (
                self.max_new_tokens is None or self.max_new_tokens >= 1,
                f"--max-new-tokens must be >= 1, got {self.max_new_tokens}",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise UserError(message)


def plan_target(target: str | None, options: EvalOptions) -> EvalPlan:
    """Resolve one target and load its tokenizer and prompts; no model is loaded."""
    resolved = _best_of(target) if options.best else resolve_target(target, options.run_dir)
    cfg = target_config(resolved, options.config_path, list(options.overrides))
    if resolved.model is None:
        resolved = dataclasses.replace(resolved, label=f"{cfg.model.name_or_path} (--config)")
    split = options.split or cfg.data.eval_split
    if resolved.folder is not None and is_adapter_folder(resolved.folder):
        require_peft(f"{resolved.label} is a LoRA adapter checkpoint; evaluating it")
    max_new_tokens = options.max_new_tokens or eval_max_new_tokens(cfg)
    budget = "--max-new-tokens" if options.max_new_tokens else "eval.max_new_tokens" if cfg.eval.max_new_tokens else \
        "rollout.max_new_tokens"
    check_sequence_budget(cfg, max_new_tokens, budget)  # as `run` does
    tools = rollout_tools(cfg.rollout)
    engine = eval_engine_name(cfg)  # an engine that evals through (vllm) and is not installed fails here
    check_memory(cfg.rollout, torch.cuda.is_available())  # or asks for a KV cache the device cannot hold
    tokenizer = load_tokenizer(cfg.model)
    turns = tool_turns(tokenizer, tools, cfg.rollout.max_tool_calls)
    own = own_config(resolved, options.config_path)
    changes = setting_changes(own, cfg, options.overrides, max_new_tokens, engine, eval_engine_name(own),
                              options.samples)
    say_inert(changes, resolved.label)
    prompts, _ = load_prompts(cfg.data, tokenizer, split, turns and turns.schemas)
    chosen = fixed_eval_subset(prompts, options.limit or 0)
    return EvalPlan(
        target=resolved,
        cfg=cfg,
        split=split,
        prompts=chosen,
        tokenizer=tokenizer,
        batch_size=options.batch_size or cfg.eval.batch_size,
        max_new_tokens=max_new_tokens,
        out_dir=output_folder(resolved, cfg),
        result_name=result_name(
            split, len(chosen) if len(chosen) < len(prompts) else None, options.samples, options.temperature,
            changes.budget, tools=bool(tools), engine=engine, changes=changes.named(),
        ),
        engine=engine,
        tools=turns,
        changes=changes,
    )


def _as_the_run_decodes(plan: EvalPlan, model, device: torch.device):
    """The loaded model in the precision the run's own evals decode in (rollout/engines.eval_decoding): the
    rollout's weights, in rollout.dtype (auto: bfloat16 on CUDA), cast in place (an eval keeps no master
    weights), so an eval of a checkpoint gives the run's own eval figures. An engine (vllm) takes the model
    as loaded."""
    if plan.engine != "hf":
        return model
    dtype = rollout_dtype(plan.cfg.rollout.dtype, device)
    return cast_as_loaded(model, dtype) if dtype != next(model.parameters()).dtype else model


def _engine(plan: EvalPlan, model):
    """rollout.engine's engine when evals generate through it (vllm: it loads the model's folder, then takes the
    loaded weights, a LoRA adapter merged), as the run's own evals did; None: the model decodes itself."""
    if plan.engine == "hf":
        return None
    return build_engine(plan.cfg.rollout, model, plan.tokenizer, plan.tools,
                        plan.cfg.data.max_prompt_length + plan.max_new_tokens)


def evaluate_plan(plan: EvalPlan, options: EvalOptions, device: torch.device) -> tuple[dict, list[Path]]:
    """Load the plan's model, evaluate, write both files; returns (metrics, paths written)."""
    started = time.monotonic()
    set_cpu_threads(plan.cfg.train.num_threads)  # as the trainer does; tiny models run fastest on 1
    model = _as_the_run_decodes(plan, load_model(plan.cfg.model, device), device)
    engine = _engine(plan, model)
    try:
        with decode_region(model, compute_dtype(plan.cfg, device.type == "cuda")):
            result = evaluate_prompts(
                model, plan.tokenizer, plan.prompts,
                max_new_tokens=plan.max_new_tokens, batch_size=plan.batch_size,
                samples=options.samples, temperature=options.temperature, seed=plan.cfg.seed,
                check=answer_check(plan.cfg.data.correctness), tools=plan.tools, engine=engine,
                progress="eval" if plan.cfg.logging.progress_bar else None,
            )
    finally:
        release(engine)  # the next target's engine starts on free memory
    del model, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start, why_not = run_start(plan, options)
    if start is not None:
        result.metrics.update(change_metrics(change_from_start(start, result.records)))
    elif why_not is not None:
        print(f"{plan.target.label}: no Δ from step 0: {why_not}", flush=True)
    json_path = plan.out_dir / f"eval_{plan.result_name}.json"
    completions_path = plan.out_dir / f"completions_{plan.result_name}.jsonl"
    summary = {
        "checkpoint": plan.cfg.model.name_or_path,
        "target": plan.target.label,
        "split": plan.split,
        "metrics": result.metrics,
        "settings": {
            "limit": options.limit or 0, "batch_size": plan.batch_size, "max_new_tokens": plan.max_new_tokens,
            "samples": options.samples, "temperature": options.temperature if options.samples > 1 else 0.0,
            "decoding": "sampling" if options.samples > 1 else "greedy", "device": device.type,
            "tools": list(plan.cfg.rollout.tools), "engine": plan.engine, "system_prompt": plan.cfg.data.system_prompt,
            "changed": plan.changes.evaluated,  # against the checkpoint's own config: what the file name spells
        },
        "completions_file": completions_path.name,
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.monotonic() - started, 2),
        "config": config_to_dict(plan.cfg),
    }
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(completions_path, result.records)
    write_json_atomic(json_path, summary)
    return result.metrics, [json_path, completions_path]


def run_start(plan: EvalPlan, options: EvalOptions) -> tuple[list[dict] | None, str | None]:
    """(the step-0 eval records of the run a checkpoint belongs to (its run folder's eval_items/step_0.jsonl), why
    they are not compared): the records when this eval decodes as that run's evals did (greedy, no setting
    that changes what is evaluated: SettingChanges.why_not_step_0), else the reason; (None, None) for a target
    that is no run's checkpoint or whose run kept no step-0 records."""
    folder = plan.target.folder
    path = items_path(folder.parent, PERIODIC, 0) if folder is not None and CHECKPOINT_RE.match(folder.name) else None
    if path is None or not path.is_file():
        return None, None
    why_not = plan.changes.why_not_step_0(options.samples)
    return (None, why_not) if why_not else (read_items(path), None)


def run_eval(targets: list[str], options: EvalOptions) -> list[dict]:
    """The whole `dapo-train eval` command; returns one metrics dict per target, in order."""
    options.check()
    if not targets and options.config_path is None:
        raise UserError("nothing to evaluate: give CHECKPOINT (or a model folder / hub id), or --config CONFIG")
    plans = [plan_target(target, options) for target in (targets or [None])]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, written = [], []
    decoding = "greedy" if options.samples == 1 else f"{options.samples} samples at T={options.temperature}"
    for index, plan in enumerate(plans, start=1):
        print(
            f"[{index}/{len(plans)}] {plan.target.label}: {len(plan.prompts)} items of "
            f"{plan.cfg.data.path} [{plan.split}], {decoding}, "
            f"max_new_tokens={plan.max_new_tokens}, on {device.type}",
            flush=True,
        )
        metrics, paths = evaluate_plan(plan, options, device)
        rows.append((plan.target.label, metrics, plan.cfg.rollout.tools))
        written.append(paths)
    print(format_table(rows, options.samples))
    for json_path, completions_path in written:
        print(f"wrote {json_path} and {completions_path.name}")
    return [metrics for _, metrics, _ in rows]
