"""Command line: parses arguments, builds the config, calls one function. No logic lives here.

How each error ends a command (one line on stderr, its exit code, the traceback only under `--debug`) is
errors.py's; the console's log lines, a console that goes away and a result that cannot be printed
(print_result: exit 2, never 0 having written nothing) are run/console.py's.
"""

from __future__ import annotations

import sys

import typer

from dapo_train.config.keys import describe_keys, select_keys
from dapo_train.config.load import dump_config, is_override, load_config, refuse_repeated_keys
from dapo_train.errors import UserError, one_line_exits
from dapo_train.run.console import console_logging, print_result, steady_console

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help: flags show no value type (rich printed `--overwrite <bool>`)
    help="DAPO fine-tuning of causal LMs on math word problems with rule rewards.",
)

def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        print_result(f"dapo-train {version('dapo-train')}")
        raise typer.Exit()


@app.callback()
def _root(
    _debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the installed version and exit."
    ),
) -> None:
    """The options before the command; main reads --debug from the line itself (debug_first puts it here)."""


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [KEY=VALUE ...]` -> (config path or None, overrides; a key given twice is refused)."""
    config, overrides = (args[0], list(args[1:])) if args and not is_override(args[0]) else (None, list(args))
    refuse_repeated_keys(overrides)
    return config, overrides


def split_eval_args(args: list[str]) -> tuple[list[str], list[str]]:
    """`[CHECKPOINT]... [KEY=VALUE]...` -> (targets, overrides; a key given twice is refused)."""
    overrides = [a for a in args if is_override(a)]
    refuse_repeated_keys(overrides)
    return [a for a in args if not is_override(a)], overrides


def flag_override(overrides: list[str], flag: str, key: str, value: str) -> None:
    """A flag that stands for KEY=VALUE, appended to the overrides; with a KEY=... override also given,
    which one wins would be a guess: refused."""
    if any(arg.split("=", 1)[0].strip() == key for arg in overrides):
        raise UserError(f"{flag} and a {key}=... override both given: keep one")
    overrides.append(f"{key}={value}")


@app.command("config")
def config_cmd(
    args: list[str] = typer.Argument(
        None, metavar="[CONFIG] [KEY=VALUE]...", help="YAML config and dotted overrides; with --keys, keys or sections."
    ),
    keys: bool = typer.Option(
        False, "--keys", help="List every config key (or those named: `--keys dapo model.dtype`) with its default, "
        "allowed values and help.",
    ),
) -> None:
    """Print the resolved config (defaults <- CONFIG <- KEY=VALUE) and check its rewards and policy objective;
    loads no model or data."""
    if keys:
        for key, default, text, allowed in select_keys(describe_keys(with_choices=True), args or []):
            print_result(f"{key} = {default}{f'  (allowed: {allowed})' if allowed else ''}\n    {text}")
            if key == "rewards":
                from dapo_train.rewards.catalogue import reward_lines

                print_result("\n".join(f"    {line}" for line in reward_lines()))
        return
    config_path, overrides = split_config_args(args or [])
    cfg = load_config(config_path, overrides)
    from dapo_train.rewards.scoring import rewards_from_config  # the checks `run` does first
    from dapo_train.rollout.engines import rollout_tools
    from dapo_train.train.update.objective import loss_settings

    rewards_from_config(cfg)
    loss_settings(cfg)
    rollout_tools(cfg.rollout)
    print_result(dump_config(cfg).rstrip())


@app.command("run")
def run_cmd(
    args: list[str] = typer.Argument(
        None, metavar="[CONFIG] [KEY=VALUE]...",
        help="YAML config (default: the embedded tiny CPU demo) and dotted overrides, e.g. dapo.eps_high=0.4.",
    ),
    resume: str = typer.Option(
        None, "--resume", metavar="[RUN_DIR|CHECKPOINT]", show_default=False,
        help="Continue a run with its own saved config: bare --resume, its latest checkpoint in output_dir; "
        "RUN_DIR, that run's latest checkpoint (no CONFIG needed); or a checkpoint folder. KEY=VALUE changes "
        "a saved setting (each change is listed, old -> new; not the model or the LoRA shape its weights were "
        "trained as); a CONFIG only says where the run is.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the run in output_dir: removes only the files a run writes; refused for "
        "a folder that is not a run or holds other files.",
    ),
) -> None:
    """Train with DAPO. Writes config.yaml, metrics.jsonl, training_losses.txt, accuracy_losses.txt,
    run.log (what the run said, the summary and the resume command), eval_items/, rollouts/ (what the
    model wrote: `dapo-train show`) and checkpoint_<step>/ folders to output_dir (default
    outputs/<run_name>).

    Sections: model, data, rollout, dapo, rewards, train, eval, checkpoint, logging; list every key
    with `dapo-train config --keys`.
    """
    from dapo_train.run.folder import resume_config
    from dapo_train.run.signals import StopRequested
    from dapo_train.train.loop import train

    console_logging()
    config_path, overrides = split_config_args(args or [])
    if resume is None:
        cfg, checkpoint = load_config(config_path, overrides), None
    else:
        cfg, checkpoint = resume_config(resume, config_path, overrides)
    stop = StopRequested().install()
    train(cfg, resume=checkpoint, overwrite=overwrite, stop=stop)
    if stop.requested:
        raise typer.Exit(stop.exit_code)


@app.command("preflight")
def preflight_cmd(
    args: list[str] = typer.Argument(
        None, metavar="CONFIG [KEY=VALUE]...", help="The config to check (the one `run` would train) and overrides."
    ),
    keep: str = typer.Option(
        None, "--keep", metavar="DIR", help="Write the rehearsal (model, run, export, preflight.log) to DIR and "
        "keep it: a new or empty folder, or an earlier --keep folder (replaced)."
    ),
    shards: int = typer.Option(
        1, "--shards", metavar="N", help="Estimate memory per card for FSDP/ZeRO over N cards (default: one card)."
    ),
) -> None:
    """Check a config in about a minute before training: its model config and tokenizer (no weights), every
    row of its data, then a few steps of its own pipeline on a small random model of the same
    architecture and vocabulary (rollout, rewards, updates, eval, checkpoint, resume, export), and the
    real model's estimated peak memory on a CUDA card. Ends with "ready", or the first problem (exit 2)."""
    from dapo_train.preflight.command import preflight
    from dapo_train.train import distributed

    console_logging(level="WARNING")
    config_path, overrides = split_config_args(args or [])
    cfg = load_config(config_path, overrides)
    if shards < 1:
        raise UserError(f"--shards must be at least 1, got {shards}")
    report = preflight(cfg, config_path or "the embedded demo", keep, shards)
    if distributed.is_main():
        print_result(report.render())


@app.command("eval")
def eval_cmd(
    args: list[str] = typer.Argument(
        None, metavar="[CHECKPOINT]... [KEY=VALUE]...",
        help="Checkpoint folders (or a bare checkpoint_N of --run-dir / the latest run), model folders or hub ids; "
        "KEY=VALUE overrides the evaluated config.",
    ),
    config: str = typer.Option(None, "--config", help="Config to use; alone, evaluates that config's own model."),
    split: str = typer.Option(None, "--split", help="Split to evaluate (default: data.eval_split)."),
    limit: int = typer.Option(None, "--limit", help="Evaluate only the first N items of the fixed subset order."),
    batch_size: int = typer.Option(None, "--batch-size", help="Sequences per generate call."),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Completion budget."),
    samples: int = typer.Option(
        1, "--samples", help="K sampled completions per item: accuracy is then sampled pass@1; adds pass@K and maj@K."
    ),
    temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature with --samples > 1."),
    run_dir: str = typer.Option(
        None, "--run-dir", help="Run folder for bare checkpoint_N names (default: the run that trained last)."
    ),
    no_tools: bool = typer.Option(
        False, "--no-tools", help="Evaluate without the config's rollout.tools (the same as rollout.tools=[]): the "
        "prompts list no tools, and the result files keep the plain name.",
    ),
    best: bool = typer.Option(
        False, "--best", help="Each target is a run folder: evaluate its best checkpoint (the best periodic eval "
        "accuracy, kept by checkpoint.keep_best).",
    ),
    engine: str = typer.Option(
        None, "--engine", help="Generate with this rollout engine (the same as rollout.engine=ENGINE; default: the "
        "config's): vllm decodes through vLLM (pip install 'dapo-train[vllm]'), hf with the model itself.",
    ),
) -> None:
    """Evaluate checkpoints: greedy accuracy with its standard error and 95% interval, format rate,
    lengths, truncation; writes eval_<what>.json and completions_<what>.jsonl next to each (the config's own
    model: in <output_dir>.eval/), <what> naming the split, limit, sampling, engine and any setting that changes
    what is evaluated (test, test_limit100, test_k8_t0.9, test_vllm, test_system_prompt=1a2b3c)."""
    from dapo_train.evaluation.command import EvalOptions, run_eval

    console_logging()
    targets, overrides = split_eval_args(args or [])
    if no_tools:
        flag_override(overrides, "--no-tools", "rollout.tools", "[]")
    if engine:
        flag_override(overrides, "--engine", "rollout.engine", engine)
    options = EvalOptions(
        config_path=config, split=split, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
        samples=samples, temperature=temperature, overrides=tuple(overrides), run_dir=run_dir, best=best,
    )
    run_eval(targets, options)


@app.command("export")
def export_cmd(
    checkpoint: str = typer.Argument(..., metavar="CHECKPOINT", help="A checkpoint_<step> folder."),
    out: str = typer.Option(..., "-o", "--output", help="Folder to write (must not exist, or be empty)."),
    merge: bool = typer.Option(
        False, "--merge", help="Fold a LoRA checkpoint's adapter into its base: a plain transformers folder."
    ),
    dtype: str = typer.Option(
        "float32", "--dtype", help="Dtype of the weights written: float32 (exact), bfloat16 or float16 (half the size)."
    ),
) -> None:
    """Write a checkpoint as a folder other tools load: with --merge a LoRA checkpoint becomes a plain
    transformers folder (weights, config, generation_config, tokenizer) that from_pretrained and vLLM
    load without peft; without it, the adapter alone; a full checkpoint, its model without the
    trainer state."""
    from dapo_train.run.export import export_checkpoint

    console_logging()
    export_checkpoint(checkpoint, out, merge=merge, dtype=dtype)


_PATHS_HELP = "Run folders, sweep folders, or folders holding them."


@app.command("sweep")
def sweep_cmd(
    config: str = typer.Argument(..., metavar="CONFIG", help="YAML config every run starts from."),
    args: list[str] = typer.Argument(
        None, metavar="KEY=V1,V2[,...] [KEY=VALUE]...",
        help="Comma lists make the grid (split outside brackets and quotes); single values apply to every run.",
    ),
    seeds: str = typer.Option(
        None, "--seeds", help="Run each point once per seed, e.g. 1,2,3 (default: the config's seed); with no comma "
        "list, two or more seeds are the sweep."
    ),
    sweep_dir: str = typer.Option(
        None, "--dir", help="Sweep folder (default outputs/sweep_<config>_<varied keys>).", show_default=False
    ),
) -> None:
    """Train every point of a grid, one run after another, into SWEEP_DIR/<point>_seed<N>/. Run the
    same command again to skip finished points and resume an interrupted one; SWEEP_DIR/sweep.json
    holds each point's status."""
    from dapo_train.run.signals import StopRequested
    from dapo_train.study.sweep import plan_sweep, run_sweep

    console_logging()
    plan = plan_sweep(config, args or [], seeds, sweep_dir)
    code = run_sweep(plan, StopRequested().install())
    if code:
        raise typer.Exit(code)


@app.command("compare")
def compare_cmd(
    paths: list[str] = typer.Argument(..., metavar="RUN_OR_SWEEP_DIR...", help=_PATHS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as a JSON list instead of a table."),
    baseline: str = typer.Option(
        None, "--baseline", metavar="POINT",
        help="Pair every other point against this one, item by item: a run folder (its point) or its settings "
        "as KEY=VALUE, e.g. eps_high=0.28 (short or dotted keys of the settings that differ).",
    ),
) -> None:
    """One row per point (runs differing only in seed are one point: mean ± std): the varied keys,
    final (whole split), last and best eval accuracy, clip fractions, entropy, completion length, steps
    and wall time. With --baseline, every point's accuracy difference to it on the same items with a
    95% paired-bootstrap interval (McNemar's test for single runs), and seed by seed its differences in
    the last step's entropy, generated tokens per trained token and wall time."""
    if baseline is not None:
        from dapo_train.study.compare import compare_with_baseline

        print_result(compare_with_baseline(paths, baseline, as_json))
        return
    from dapo_train.study.compare import compare

    print_result(compare(paths, as_json))


@app.command("show")
def show_cmd(
    run: str = typer.Argument(..., metavar="RUN", help="A run folder (its rollouts/step_<N>.jsonl)."),
    step: str = typer.Option(None, "--step", help="A step, or 'all' (default: the last step with records)."),
    where: str = typer.Option(
        None, "--where", metavar="EXPR",
        help="Terms joined by commas or 'and' that must all hold: a flag (truncated, correct, dropped, trained, "
        "carried, a fate; called, tool_error, over_calls), !FLAG, or FIELD OP VALUE (OP < <= > >= = !=; a field, "
        "rewards.<key>, tool_calls or tool_errors), e.g. 'reward<0.5,!truncated' or 'rewards.overlong<0 and correct'.",
    ),
    limit: int = typer.Option(
        None, "--limit", help="Completions shown (0 = all; default 20, and all with --json).", show_default=False
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the matching records as JSON Lines (all of them)."),
) -> None:
    """What the policy wrote in a run's rollouts and why each completion got its reward: the sampled
    groups of a step (logging.rollout_groups), dropped ones too, each completion with its answer, every
    reward's value, advantage, ratios and its group's fate."""
    from dapo_train.study.show import show

    print_result(show(run, step, where, limit, as_json))


@app.command("plot")
def plot_cmd(
    paths: list[str] = typer.Argument(..., metavar="RUN_OR_SWEEP_DIR...", help=_PATHS_HELP),
    out: str = typer.Option(..., "-o", "--output", help="Image file to write, e.g. sweep.png (a new file: one "
                            "already there is never replaced)."),
) -> None:
    """Eval accuracy, reward, entropy, clip fractions, completion length and kept/carried groups over
    steps, one colour per point (seeds as a mean line with a min-max band). Needs matplotlib."""
    from dapo_train.study.plot import plot

    print_result(f"wrote {plot(paths, out)}")


def bare_resume_to_latest(argv: list[str]) -> list[str]:
    """`--resume` without a path means the latest checkpoint in output_dir: give it the value `latest`
    (the option needs one)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or nxt.startswith("-") or is_override(nxt) or nxt.endswith((".yaml", ".yml")):
                out.append("latest")
    return out


def debug_first(argv: list[str]) -> list[str]:
    """`--debug` anywhere (`dapo-train run ... --debug`) is the root option it is."""
    return ["--debug", *(arg for arg in argv if arg != "--debug")] if "--debug" in argv else list(argv)


def main() -> None:
    """Console-script entry point: the command line's shorthands, then the app; an error the user can act
    on ends it with one line and its exit code (errors.one_line_exits)."""
    steady_console()  # a console piped into `| tee`, which the run's own Ctrl-C ends, must not stop the save
    argv = bare_resume_to_latest(debug_first(sys.argv[1:]))
    with one_line_exits(debug="--debug" in argv):
        app(args=argv)
