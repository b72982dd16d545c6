"""Bad input: one line on stderr, exit code 2, before any model loads; --debug shows the traceback."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dapo(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "dapo_train", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_invalid_yaml_names_file_line_and_column(tmp_path):
    (tmp_path / "bad.yaml").write_text("dapo:\n  eps_low: 0.2\n eps_high: 0.3\n")
    assert_one_line_error(dapo("run", "bad.yaml", cwd=tmp_path), "bad.yaml:3:")


def test_unknown_key_suggests_the_closest(tmp_path):
    assert_one_line_error(
        dapo("run", "train.max_step=3", cwd=tmp_path), "train.max_step", "did you mean 'train.max_steps'"
    )


def test_impossible_value_names_the_key_and_range(tmp_path):
    assert_one_line_error(dapo("run", "rollout.group_size=1", cwd=tmp_path), "rollout.group_size", ">= 2")


def test_missing_model_folder(tmp_path):
    assert_one_line_error(
        dapo("run", "model.name_or_path=./no-such-model", cwd=tmp_path), "folder not found", "no-such-model"
    )
    assert not (tmp_path / "outputs").exists()  # nothing written for a run that never started


def test_missing_dataset_column_lists_the_columns(tmp_path):
    rows = [{"q": "1+1=?", "answer_only": 2}, {"q": "2+2=?", "answer_only": 4}]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    result = dapo("run", "data.path=train.jsonl", "eval.every_steps=0", "eval.final_full=false", cwd=tmp_path)
    assert_one_line_error(result, "question_zh-cn", "q, answer_only")


def test_a_file_without_the_eval_split_names_what_reads_it(tmp_path):
    """One file is one split; the end-of-run eval (on by default) reads the eval split too."""
    (tmp_path / "train.jsonl").write_text(json.dumps({"question_zh-cn": "1+1=?", "answer_only": 2}) + "\n")
    result = dapo("run", "data.path=train.jsonl", "eval.every_steps=0", cwd=tmp_path)
    assert_one_line_error(result, "split 'test' not found", "eval.final_full")


def test_reward_plugin_that_does_not_import(tmp_path):
    result = dapo("run", "rewards=[{name: 'no_such_pkg.mod:reward'}]", cwd=tmp_path)
    assert_one_line_error(result, "rewards.0.name", "no_such_pkg")


def test_existing_run_is_not_clobbered(tmp_path):
    run_dir = tmp_path / "outputs" / "mine"
    (run_dir / "checkpoint_3").mkdir(parents=True)
    (run_dir / ".dapo-train-run").write_text("{}\n")  # the marker a run writes first: the folder is a run's
    (run_dir / "config.yaml").write_text("seed: 1\n")
    result = dapo("run", "output_dir=outputs/mine", cwd=tmp_path)
    assert_one_line_error(result, "already holds a run", "dapo-train run --resume outputs/mine", "--overwrite")
    assert (run_dir / "config.yaml").read_text() == "seed: 1\n"


def test_show_of_a_folder_without_rollout_records_is_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    assert_one_line_error(dapo("show", "run", cwd=tmp_path), "run is not a run folder (no config.yaml)")
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")  # a run that wrote no records
    assert_one_line_error(dapo("show", "run", cwd=tmp_path), "holds no rollout records", "logging.rollout_groups")
    assert_one_line_error(dapo("show", "nope", cwd=tmp_path), "no such run folder")


def test_resume_without_checkpoint(tmp_path):
    assert_one_line_error(dapo("run", "output_dir=outputs/none", "--resume", cwd=tmp_path), "no checkpoint_<step>/")


@pytest.mark.parametrize("where", ["before the command", "after it"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["--debug", "run", "rollout.group_size=1"] if where == "before the command" else [
        "run", "rollout.group_size=1", "--debug"
    ]
    result = dapo(*args, cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" in result.stderr, result.stderr


def readme_commands() -> dict[str, set[str]]:
    """Command -> the options the README's command list (## Commands) gives it."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Commands\n", 1)[1].split("\n#", 1)[0]
    commands: dict[str, set[str]] = {}
    for line in section.splitlines():
        usage = line.strip().partition("  #")[0]  # what follows two spaces and # is a comment
        if usage.startswith("dapo-train "):
            command, _, rest = usage.removeprefix("dapo-train ").partition(" ")
            commands.setdefault(command, set()).update(OPTION.findall(rest))
    return commands


def help_sections(text: str) -> dict[str, set[str]]:
    """A --help text's Commands and Options sections -> the names they list (`-o, --output <str>`
    -> -o, --output); the descriptions beside the names are left out."""
    found: dict[str, set[str]] = {"Commands": set(), "Options": set()}
    section = None
    for line in text.splitlines():
        if line.rstrip(":") in found:
            section = line.rstrip(":")
        elif not line.startswith(" "):
            section = None
        elif section and re.match(r"  \S", line):  # a name starts two spaces in; descriptions further
            names = re.split(r"\s{2,}", line.strip())[0]
            found[section] |= {names} if section == "Commands" else set(OPTION.findall(names))
    return found


OPTION = re.compile(r"(?<![\w-])--?[a-z][a-z-]*")
README_COMMANDS = readme_commands()


def test_the_readme_documents_every_command_and_the_help_lists_them(tmp_path):
    assert set(README_COMMANDS) == {"run", "preflight", "eval", "export", "config", "sweep", "compare", "plot",
                                    "show"}
    assert {"--resume", "--overwrite"} <= README_COMMANDS["run"] and "--keys" in README_COMMANDS["config"]
    result = dapo("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = help_sections(result.stdout)
    assert listed["Commands"] == set(README_COMMANDS)
    assert "--debug" in listed["Options"]  # the README: `--debug` (anywhere on the line) shows the traceback


@pytest.mark.parametrize("command", sorted(README_COMMANDS))
def test_each_commands_help_shows_the_options_the_readme_gives_it(tmp_path, command):
    result = dapo(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    options = help_sections(result.stdout)["Options"]
    assert README_COMMANDS[command] <= options, (README_COMMANDS[command] - options)
    # Flags take no value, so help shows none (no `--overwrite <bool>`).
    flag = re.compile(r"(?<![\w-])--(overwrite|keys|merge|json|help)\b")
    flags = [line for line in result.stdout.splitlines() if flag.search(line)]
    assert flags and not any("bool" in line.lower() for line in flags), flags


def test_run_help_and_readme_describe_resume_alike(tmp_path):
    """Bare --resume is the documented form; the help does not show the `--resume latest` it maps to."""
    from dapo_train.cli import bare_resume_to_latest

    result = dapo("run", "--help", cwd=tmp_path)
    assert "--resume [RUN_DIR|CHECKPOINT]" in result.stdout and "bare --resume" in " ".join(result.stdout.split())
    assert "--resume latest" not in result.stdout
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "dapo-train run [CONFIG] [KEY=VALUE ...] [--resume [RUN_DIR|CHECKPOINT]] [--overwrite]" in readme
    assert bare_resume_to_latest(["run", "--resume"]) == ["run", "--resume", "latest"]


def test_config_keys_lists_allowed_values(tmp_path):
    result = dapo("config", "--keys", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "train.lr_scheduler = 'constant'  (allowed: constant, cosine)" in lines
    assert "logging.trackers = []  (allowed: tensorboard, wandb, mlflow, comet_ml, aim, clearml, trackio)" in lines
    assert "model.lora.r = 0" in lines  # a nested section's keys are listed with their dotted names
    assert "dapo.dynamic_sampling = True  (allowed: true, false)" in lines


def test_config_keys_rewards_lists_every_registered_reward_and_its_args(tmp_path):
    from dapo_train.rewards import REWARDS
    from dapo_train.rewards.catalogue import reward_docs

    result = dapo("config", "--keys", "rewards", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = {line.split(":", 1)[0].strip(): line for line in result.stdout.splitlines() if line.startswith("      ")}
    assert set(listed) == set(REWARDS)
    for doc in reward_docs():
        for arg in doc.args:
            assert f"{arg.name} = {arg.default}" in listed[doc.name], (doc.name, arg)
    assert "max_length = rollout.max_new_tokens, cache_length = required" in listed["overlong"]
    assert "args: none" in listed["digit"]
    assert "name (default 'accuracy')" in result.stdout  # each list item's fields, from RewardSpec


def test_config_keys_rewards_follows_the_registry(monkeypatch):
    """A reward registered in code is listed with its arguments and defaults: the list is read from
    the registry, not kept by hand."""
    from typer.testing import CliRunner

    from dapo_train.cli import app
    from dapo_train.rewards import scoring

    def bonus(completions, answers, *, lengths=None, prompts=None, amount=0.5, max_length):
        """0.5 per completion, as a test reward."""
        return [amount] * len(completions)

    monkeypatch.setitem(scoring.REWARDS, "bonus_test", scoring.RewardEntry(bonus))
    result = CliRunner().invoke(app, ["config", "--keys", "rewards"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.strip().startswith("bonus_test:"))
    assert "0.5 per completion, as a test reward." in line
    assert line.endswith("args: amount = 0.5, max_length = rollout.max_new_tokens"), line


def test_overwrite_with_bad_input_keeps_the_old_run(tmp_path):
    run_dir = tmp_path / "outputs" / "mine"
    run_dir.mkdir(parents=True)
    (run_dir / ".dapo-train-run").write_text("{}\n")  # a run's folder, which --overwrite may replace
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "metrics.jsonl").write_text("")
    result = dapo("run", "output_dir=outputs/mine", "data.prompt_field=nope", "--overwrite", cwd=tmp_path)
    assert_one_line_error(result, "nope")
    assert (run_dir / "config.yaml").read_text() == "seed: 1\n"  # nothing lost to a run that never started


def test_output_dir_that_cannot_be_a_folder_fails_before_loading(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder\n")
    result = dapo("run", "output_dir=taken/run", cwd=tmp_path)
    assert_one_line_error(result, "taken", "not a folder")
    assert (tmp_path / "taken").read_text() == "a file, not a folder\n"


def test_unwritable_output_dir_is_one_clear_error(tmp_path, monkeypatch):
    # Tests may run as root, which chmod cannot lock out, so the file system's answer is stubbed.
    from dapo_train.config.load import load_config
    from dapo_train.errors import UserError
    from dapo_train.run import folder as rundir

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(rundir.tempfile, "mkdtemp", refuse)
    cfg = load_config(None, [f"output_dir={tmp_path / 'locked' / 'run'}"])
    with pytest.raises(UserError, match=r"cannot write in .* \(Permission denied\); set output_dir=\.\.\. to a"):
        rundir.prepare_run_dir(cfg, None, False)
    assert not (tmp_path / "locked").exists()


def _unwritable(path: Path) -> bool:
    try:
        path.mkdir()
    except OSError:
        return True
    path.rmdir()
    return False


@pytest.mark.skipif(not Path("/sys").is_dir() or not _unwritable(Path("/sys/dapo_run")), reason="needs Linux /sys")
def test_output_dir_in_sys_is_one_line_before_anything_loads(tmp_path):
    """Root may write anywhere by permission bits, yet not in /sys: the check tries, not asks."""
    result = dapo("run", "output_dir=/sys/dapo_run", cwd=tmp_path)
    assert_one_line_error(result, "output_dir /sys/dapo_run", "cannot write in /sys", "writable folder")
    assert "rows" not in result.stderr  # one line: no data (and so no model) was loaded


def test_config_command_checks_rewards_like_run(tmp_path):
    # cache_length = L_max (rollout.max_new_tokens = 96) would punish every completion.
    for command in ("config", "run"):
        result = dapo(command, "rewards.1.args.cache_length=96", cwd=tmp_path)
        assert_one_line_error(result, "rewards.1.args", "cache_length < max_length")


def test_an_unregistered_policy_objective_is_one_line_before_anything_loads(tmp_path):
    for command in ("config", "run"):
        result = dapo(command, "dapo.policy_loss=ppo", f"output_dir={tmp_path / 'run'}", cwd=tmp_path)
        assert_one_line_error(result, "dapo.policy_loss", "unknown objective 'ppo'", "clip")
        assert "rows" not in result.stderr and not (tmp_path / "run").exists()  # no data, no run folder


# --------------------------------------------------------------------------------------------
# An existing path is a path even with '=' in it: every sweep run's folder name has one.


def test_an_existing_path_with_equals_is_not_an_override(tmp_path):
    from dapo_train.cli import is_override

    run = tmp_path / "tiny-cpu_eps_high=0.1"
    run.mkdir()
    assert not is_override(str(run))
    assert is_override(str(tmp_path / "tiny-cpu_eps_high=0.5"))  # no such path: a KEY=VALUE
    assert is_override("dapo.eps_high=0.4")
    assert not is_override(str(tmp_path))


def test_a_value_longer_than_a_file_name_is_a_value(tmp_path):
    """Issue 47, point 5: a KEY=VALUE past the file-name limit is read as a value, not looked up as a path
    (which raised "File name too long" in every command): 90 Chinese characters are 270 bytes."""
    from dapo_train.cli import is_override, split_config_args

    item = "data.system_prompt=" + "你是一个擅长数学的助手" * 9
    assert is_override(item) and is_override("seed=1" + "\0")
    assert split_config_args([item]) == (None, [item])
    result = dapo("config", item, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "你是一个擅长数学的助手" * 9 in result.stdout


@pytest.mark.parametrize("args", [["run", "x" * 300 + ".yaml"], ["eval", "x" * 300 + "/checkpoint_1"],
                                  ["show", "x" * 300]])
def test_a_path_longer_than_a_file_name_is_one_line(tmp_path, args):
    assert_one_line_error(dapo(*args, cwd=tmp_path), "x" * 20, "longer than the file system allows")


def test_a_config_path_with_equals_is_the_config(tmp_path):
    from dapo_train.cli import split_config_args

    config = tmp_path / "sweep_max_steps=12" / "run.yaml"
    config.parent.mkdir()
    config.write_text("seed: 7\n")
    assert split_config_args([str(config), "seed=8"]) == (str(config), ["seed=8"])
    assert split_config_args(["seed=8"]) == (None, ["seed=8"])
    result = dapo("config", str(config), cwd=tmp_path)  # `run` reads its arguments the same way
    assert result.returncode == 0, result.stderr
    assert "seed: 7\n" in result.stdout


def test_eval_targets_may_hold_equals(tmp_path):
    from dapo_train.cli import split_eval_args

    checkpoint = tmp_path / "outputs" / "tiny-cpu_eps_high=0.1" / "checkpoint_10"
    checkpoint.mkdir(parents=True)
    assert split_eval_args([str(checkpoint), "eval.num_items=5"]) == ([str(checkpoint)], ["eval.num_items=5"])
    # Through the command: the folder is a target (it holds no model), not "nothing to evaluate".
    result = dapo("eval", str(checkpoint), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "nothing to evaluate" not in result.stderr and "checkpoint_10" in result.stderr


def test_resume_path_with_equals_is_kept(tmp_path):
    from dapo_train.cli import bare_resume_to_latest

    checkpoint = tmp_path / "x_max_steps=12" / "checkpoint_4"
    checkpoint.mkdir(parents=True)
    argv = ["run", "--resume", str(checkpoint), "train.max_steps=12"]
    assert bare_resume_to_latest(argv) == argv
    # A bare --resume before an override still means the latest checkpoint.
    assert bare_resume_to_latest(["run", "--resume", "train.max_steps=12"]) == [
        "run", "--resume", "latest", "train.max_steps=12"
    ]
