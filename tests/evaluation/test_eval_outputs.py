"""Issue 52 items 11-12: what `dapo-train eval` records and where it writes. The engine that generated an eval
is in its settings and, where it is not the model's own decode loop (hf), in its file name, so evals of two
engines coexist (vllm is not in the main environment: the name is unit-tested for it, and a plugin engine that
serves evals, as vllm does, stands in for it end to end). An eval of the config's own model (`eval --config`)
writes beside the run folder, never in it, so the quick start's `run` starts after it."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from dapo_train.config.load import load_config
from dapo_train.evaluation import command as eval_command
from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.evaluation.settings import result_name
from dapo_train.train import loop

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = EvalOptions(config_path="tiny.yaml", limit=4, max_new_tokens=4, split="train")
NAME = "train_limit4_len4"


@pytest.mark.parametrize("args, engine, name", [
    (("test", None, 1, 1.0, None), "hf", "test"),  # the model's own decode loop: the name evals always had
    (("test", None, 1, 1.0, None), "vllm", "test_vllm"),
    (("test", 100, 8, 0.9, None, True), "vllm", "test_limit100_k8_t0.9_tools_vllm"),
    (("test", None, 1, 1.0, None), "pkg.engines:Fast", "test_pkg.engines-Fast"),  # a plugin, as a file name part
])
def test_result_names_say_which_engine_generated(args, engine, name):
    assert result_name(*args, engine=engine) == name


def test_evals_of_two_engines_coexist_and_say_which(tmp_path, monkeypatch):
    """Reproduced with vllm: `--engine vllm` and `--engine hf` wrote one eval_test.json, each replacing the
    other, and neither said which engine it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text("output_dir: out\n")
    folder = tmp_path / "model"  # a model folder of its own: the results go into it
    shutil.copytree(ROOT / "dapo_train" / "assets" / "tiny" / "model", folder)
    run_eval([str(folder)], OPTIONS)
    first = (folder / f"eval_{NAME}.json").read_text()
    run_eval([str(folder)], dataclasses.replace(OPTIONS, overrides=("rollout.engine=engine_plugin:EvalServingEngine",)))
    served = json.loads((folder / f"eval_{NAME}_engine_plugin-EvalServingEngine.json").read_text())
    assert (folder / f"completions_{NAME}_engine_plugin-EvalServingEngine.jsonl").is_file()
    assert (folder / f"eval_{NAME}.json").read_text() == first  # the hf eval stays as it was
    assert json.loads(first)["settings"]["engine"] == "hf"
    assert served["settings"]["engine"] == "engine_plugin:EvalServingEngine"
    # hf-generate does not serve evals: the model decodes itself, as under hf, so it is the same evaluation
    run_eval([str(folder)], dataclasses.replace(OPTIONS, overrides=("rollout.engine=hf-generate",)))
    assert json.loads((folder / f"eval_{NAME}.json").read_text())["settings"]["engine"] == "hf"
    assert sorted(p.name for p in folder.glob("eval_*")) == [f"eval_{NAME}.json",
                                                             f"eval_{NAME}_engine_plugin-EvalServingEngine.json"]


class Started(Exception):
    """The run got past every check of its folder: setup (the data and the model) was reached."""


def test_eval_of_the_configs_model_leaves_the_quick_starts_run_its_folder(tmp_path, monkeypatch, capsys):
    """Reproduced: `eval --config configs/tiny-cpu.yaml` wrote outputs/tiny-cpu/eval/, and the quick start's
    `run configs/tiny-cpu.yaml` then refused outputs/tiny-cpu as not a dapo-train run folder."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "configs" / "tiny-cpu.yaml", tmp_path / "tiny-cpu.yaml")
    run_eval([], dataclasses.replace(OPTIONS, config_path="tiny-cpu.yaml"))

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(loop, "setup", started)
    cfg = load_config("tiny-cpu.yaml", [])
    assert Path(cfg.output_dir) == Path("outputs") / "tiny-cpu"
    with pytest.raises(Started):
        loop.train(cfg)
    written = Path("outputs") / "tiny-cpu.eval" / "builtin-tiny" / f"eval_{NAME}.json"  # where the docs say
    assert written.is_file() and f"wrote {written}" in capsys.readouterr().out
    assert not Path("outputs", "tiny-cpu").exists()  # the run's folder: the run had not made it yet


@pytest.mark.parametrize("output_dir", ["run", "run/", "."])
def test_the_folder_beside_the_run_has_a_name_whatever_output_dir_is(tmp_path, monkeypatch, output_dir):
    """output_dir=. has no name of its own: its results go beside the current folder, named after it."""
    monkeypatch.chdir(tmp_path / output_dir if output_dir == "." else tmp_path)
    cfg = load_config(None, [f"output_dir={output_dir}"])
    folder = eval_command.output_folder(eval_command.EvalTarget("--config", None), cfg)
    expected = "run.eval" if output_dir != "." else f"{tmp_path.name}.eval"
    assert folder.resolve() == (tmp_path if output_dir != "." else tmp_path.parent) / expected / "builtin-tiny"
