"""Every bad input is one clean line (issue 25): the table of tests/bad_inputs.py (every schema key with
invalid values; damaged configs, data files, model and checkpoint folders, plugins) run through the
command line, and the defects the issue names, one test each."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_train.config import validate
from dapo_train.config.keys import schema_keys
from dapo_train.config.load import load_config
from dapo_train.errors import ConfigError, UserError
from dapo_train.model import loading
from dapo_train.run import folder as rundir

from bad_inputs import IMPOSSIBLE, IMPOSSIBLE_TOGETHER, schema_cases, wrong_type_values

HERE = Path(__file__).resolve().parent


def _tally(group: str, tmp_path: Path) -> list[dict]:
    """One subprocess runs the whole group in-process (cli.main per case): the import cost is paid once."""
    done = subprocess.run(
        [sys.executable, str(HERE / "bad_inputs.py"), "--group", group, "--json"], capture_output=True, text=True,
        timeout=900, cwd=tmp_path, env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("group", ["schema", "files"])
def test_every_bad_input_of_the_table_is_one_clean_line(group, tmp_path):
    records = _tally(group, tmp_path)
    unclean = [f"{r['id']}: {'; '.join(r['problems'])}\n{r['stderr'][-800:]}" for r in records if not r["clean"]]
    assert not unclean, "\n".join(unclean)
    assert len(records) > (200 if group == "schema" else 80)  # the table did run


def test_every_schema_key_gets_invalid_values_and_every_range_check_is_tried():
    """A key added to the schema is covered by its type; a range check added to validation.validate needs an
    IMPOSSIBLE entry, or this fails naming the key."""
    keys = [info.key for info in schema_keys()]
    covered = {case.names[0] for case in schema_cases() if len(case.names) == 1}
    assert covered == set(keys)
    source = inspect.getsource(validate)
    checked = set(re.findall(r'"([a-z_]+(?:\.[a-z_]+)*)"', source)) & set(keys)
    together = {item.split("=")[0] for items in IMPOSSIBLE_TOGETHER for item in items}
    untried = checked - set(IMPOSSIBLE) - together - set(validate.NON_EMPTY)
    assert not untried, f"validation.validate checks {sorted(untried)}: give each an impossible value in IMPOSSIBLE"


def test_a_type_the_table_has_no_rule_for_fails_loudly():
    with pytest.raises(TypeError, match="no invalid values known"):
        wrong_type_values(tuple[int, int], None)


# --------------------------------------------------------------------------------------------
# Defect 2: model.attn_implementation.


def test_the_text_none_and_an_unknown_kernel_are_config_errors():
    with pytest.raises(ConfigError, match=r"got the text 'None'; write null for no value \(model.attn_i\w+=null"):
        load_config(None, ["model.attn_implementation=None"])
    with pytest.raises(ConfigError, match=r"got 'flashy'; allowed: null, sdpa, eager, flash_attention_2"):
        load_config(None, ["model.attn_implementation=flashy"])
    with pytest.raises(ConfigError, match=r"dapo.clip_ratio_c.*write null"):  # defect 9: the same for every null key
        load_config(None, ["dapo.clip_ratio_c=None"])
    assert load_config(None, ["model.attn_implementation=null"]).model.attn_implementation is None


def test_a_flash_kernel_needs_its_package_and_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="flash_attention_2 needs the flash-attn package.*pip install flash-attn"):
        loading.check_attention_kernel("flash_attention_2", torch.device("cpu"))
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: object())  # installed, but no CUDA
    with pytest.raises(ConfigError, match="flash_attention_3 runs on CUDA only, not on cpu"):
        loading.check_attention_kernel("flash_attention_3", torch.device("cpu"))
    loading.check_attention_kernel("sdpa", torch.device("cpu"))  # built into torch: nothing to check


# --------------------------------------------------------------------------------------------
# Defects 4 and 6: model folders, and the prompt plus completion against the model's positions.


def test_an_empty_or_non_model_folder_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x\n")
    with pytest.raises(UserError, match=r"empty is not a model folder \(no config.json or adapter_config.json\)"):
        loading.load_tokenizer(load_config(None, [f"model.name_or_path={tmp_path / 'empty'}"]).model)
    with pytest.raises(UserError, match="notes.txt is a file; give the folder that holds config.json"):
        loading.check_model_path(str(tmp_path / "notes.txt"))  # defect 9: not "folder not found"


def test_the_prompt_and_completion_budget_must_fit_the_models_positions():
    # The tiny model has 512 positions (its config.json); 256 + 96 fits, 4000 + 96 does not, 416 + 96 just does.
    assert loading.context_length(load_config(None, []).model) == 512
    loading.check_sequence_budget(load_config(None, []), 96)
    loading.check_sequence_budget(load_config(None, ["data.max_prompt_length=416"]), 96)
    with pytest.raises(ConfigError, match=r"data.max_prompt_length.*4000 prompt \+ 96 completion tokens need 4096 "
                                          r"positions, but builtin:tiny has 512.*at most 416"):
        loading.check_sequence_budget(load_config(None, ["data.max_prompt_length=4000"]), 96)


# --------------------------------------------------------------------------------------------
# Defect 5: plot's output path.


def test_plot_into_an_unwritable_place_is_one_line_before_reading_runs(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from dapo_train.study import plot

    def must_not_run(paths):
        raise AssertionError("the runs were read before the output path was checked")

    monkeypatch.setattr(plot, "load_runs", must_not_run)
    with pytest.raises(UserError, match=r"-o /proc/x.png: cannot write in /proc"):
        plot.plot([str(tmp_path)], "/proc/x.png")
    (tmp_path / "figs").mkdir()
    with pytest.raises(UserError, match=r"figs is a folder; choose another file"):
        plot.plot([str(tmp_path)], str(tmp_path / "figs"))


# --------------------------------------------------------------------------------------------
# Defect 7: a plugin engine that is not an engine.


def test_a_plugin_engine_that_is_not_an_engine_is_a_config_error(random_model, id_tokenizer):
    from dapo_train.rollout import build_engine, engine_factory

    with pytest.raises(ConfigError, match=r"dapo_train.rollout:Completion is a class without generate\(\) and "
                                          r"sync_weights\(\)"):
        engine_factory("dapo_train.rollout:Completion")
    with pytest.raises(ConfigError, match="os:getcwd cannot be called with one EngineSetup"):
        engine_factory("os:getcwd")
    with pytest.raises(ConfigError, match="os.path:join takes any number of arguments, not one EngineSetup"):
        engine_factory("os.path:join")  # join(a, *p) binds one argument: its *p gives it away before the data
    rollout = load_config(None, ["rollout.engine=builtins:len"]).rollout  # binds one argument, fails on it
    with pytest.raises(ConfigError, match=r"builtins:len\(EngineSetup\) failed: TypeError"):
        build_engine(rollout, random_model, id_tokenizer)
    rollout = load_config(None, ["rollout.engine=builtins:repr"]).rollout  # a factory whose answer is no engine
    with pytest.raises(ConfigError, match=r"builtins:repr returned .* \(str\), which has no generate\(\) and"):
        build_engine(rollout, random_model, id_tokenizer)


# --------------------------------------------------------------------------------------------
# Defect 8: config --keys filters; --resume with --overwrite.


def test_config_keys_lists_the_keys_named_and_refuses_an_unknown_one(tmp_path):
    from test_cli import assert_one_line_error, dapo

    one = dapo("config", "--keys", "dapo.eps_high", cwd=tmp_path)
    assert one.returncode == 0 and one.stdout.splitlines()[0] == "dapo.eps_high = 0.28", one.stderr
    assert len(one.stdout.splitlines()) == 2  # the key and its help
    section = dapo("config", "--keys", "model.lora", "seed", cwd=tmp_path).stdout
    assert [line.split(" = ")[0] for line in section.splitlines() if not line.startswith(" ")] == [
        "seed", "model.lora.r", "model.lora.alpha", "model.lora.dropout", "model.lora.target_modules",
    ]
    assert "dapo.clip_ratio_c = null" in dapo("config", "--keys", "dapo", cwd=tmp_path).stdout  # what to type
    assert_one_line_error(dapo("config", "--keys", "dapo.nonsense", cwd=tmp_path), "dapo.nonsense", "unknown key")
    assert_one_line_error(dapo("config", "--keys", "dapo.eps_hihg", cwd=tmp_path), "did you mean 'dapo.eps_high'")


def test_resume_with_overwrite_is_refused_before_anything(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="--resume continues the run in output_dir and --overwrite replaces it"):
        rundir.prepare_run_dir(cfg, True, overwrite=True)
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------
# Defect 9, the smaller ones.


def test_compare_a_file_says_it_is_a_file(tmp_path):
    from dapo_train.study.runs import expand

    (tmp_path / "afile").write_text("x\n")
    with pytest.raises(UserError, match="afile is a file; give a run folder"):
        expand(tmp_path / "afile")


def test_under_a_launcher_only_rank_0_says_a_signal_was_received(monkeypatch, capsys):
    import signal

    from dapo_train.run.signals import StopRequested

    for rank, says in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        stop = StopRequested()
        stop._handle(signal.SIGINT, None)
        assert stop.requested  # every rank stops
        assert ("SIGINT received" in capsys.readouterr().err) is says


def test_default_sweep_folders_differ_per_grid_and_fixed_overrides(tmp_path, monkeypatch):
    from dapo_train.study.sweep import plan_sweep

    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml")
    full = plan_sweep(config, ["dapo.eps_high=0.1,0.28,0.5"], "1,2,3").sweep_dir
    short = plan_sweep(config, ["dapo.eps_high=0.1,0.28,0.5", "train.max_steps=4"], "1").sweep_dir
    fewer = plan_sweep(config, ["dapo.eps_high=0.1,0.5"], "1,2,3").sweep_dir
    assert full == Path("outputs/sweep_tiny-cpu_eps_high=0.1-0.28-0.5")  # the README's sweep
    assert short == Path("outputs/sweep_tiny-cpu_eps_high=0.1-0.28-0.5_max_steps=4")
    assert len({full, short, fewer}) == 3
    assert plan_sweep(config, ["dapo.eps_high=0.1,0.28,0.5"], "4").sweep_dir == full  # more seeds of one grid
    long = plan_sweep(config, ["dapo.eps_high=0.1,0.5", "data.system_prompt=" + "x" * 200], None).sweep_dir
    assert len(long.name) <= 100 and re.fullmatch(r".*_[0-9a-f]{8}", long.name)



# --------------------------------------------------------------------------------------------
# Issue 35's rough edges: a key given twice, more eval items than the split, checks before the data, long listings.


def test_a_key_given_twice_on_the_command_line_is_one_line(tmp_path):
    """The last value used to win silently (and both went into the run name, ..._max_steps=1_max_steps=2)."""
    from test_cli import assert_one_line_error, dapo

    for command in (["run"], ["config"]):
        done = dapo(*command, "train.max_steps=1", "dapo.eps_high=0.3", "train.max_steps=2", cwd=tmp_path)
        assert_one_line_error(done, "train.max_steps", "given twice", "train.max_steps=1", "train.max_steps=2")
    assert not (tmp_path / "outputs").exists()


def test_more_eval_items_than_the_split_holds_is_said_at_start(caplog):
    from dapo_train.task.prompts import Prompt
    from dapo_train.train.session import eval_subset

    split = [Prompt(f"test:{row}", "q", "1", "p", (3, 4)) for row in range(500)]
    cfg = load_config(None, ["eval.num_items=100000"])
    assert eval_subset(cfg, split) == split
    assert "eval.num_items=100000 is more than the 500 items of 'test': every periodic eval covers all 500" \
        in caplog.text
    caplog.clear()
    assert len(eval_subset(load_config(None, []), split)) == 100 and not caplog.text  # 100 of 500: nothing to say


@pytest.mark.parametrize("overrides,needles", [
    (["model.lora.r=4", "model.lora.target_modules=[nothing_here]"], ("model.lora.target_modules", "nothing_here")),
    (["rollout.engine=os.path:join"], ("rollout.engine", "os.path:join")),
])
def test_lora_targets_and_the_engine_signature_fail_before_the_data_is_read(tmp_path, overrides, needles):
    """Both were found only once the model was there, after the data had been read and logged."""
    from test_cli import dapo

    done = dapo("run", "train.max_steps=1", *overrides, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and all(needle in lines[-1] for needle in needles), done.stderr
    assert "task.prompts" not in done.stderr, done.stderr  # no data line: the data was not read
    assert not (tmp_path / "outputs").exists()


def test_the_listing_of_a_large_folder_is_capped(tmp_path):
    """A missing path's error lists its nearest folder: a few entries, not a temporary folder's thousands."""
    from dapo_train.errors import folder_listing

    for i in range(3000):
        (tmp_path / f"session_{i:05d}_{'x' * 40}").mkdir()
    listing = folder_listing(tmp_path / "no-such-run" / "checkpoint_3")
    assert listing.startswith(f"{tmp_path} holds: session_00000_") and listing.endswith(" more (3000 entries)")
    assert len(listing) - len(str(tmp_path)) < 300, listing
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.json").write_text("{}")
    (small / "runs").mkdir()
    assert folder_listing(small / "nope") == f"{small} holds: a.json, runs/"
