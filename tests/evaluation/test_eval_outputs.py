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


def _random_model(folder: Path) -> Path:
    """The tiny model's architecture and tokenizer with random weights: its logits are near ties, so greedy
    decoding follows any change in how the forward rounds (a trained model's confident choices hide it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    shipped = ROOT / "dapo_train" / "assets" / "tiny" / "model"
    shutil.copytree(shipped, folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shipped)).save_pretrained(folder)
    return folder


def test_an_eval_of_a_checkpoint_decodes_as_the_runs_own_eval_under_the_cards_settings(tmp_path, monkeypatch):
    """Under bf16 autocast with the bf16 rollout copy (what auto gives on CUDA) a run's evals decode through its
    rollout copy; `dapo-train eval` of its checkpoint casts the loaded weights the same way, so it writes the run's
    own completions, token for token, on the same items. (Before, the run's evals decoded the float32 weights under
    autocast and the checkpoint's eval, on a CPU, without autocast: they parted from the first item on.)"""
    monkeypatch.chdir(tmp_path)
    model = _random_model(tmp_path / "random")
    settings = ["train.mixed_precision=bf16", "rollout.dtype=bfloat16", "train.max_steps=1", "eval.every_steps=1",
                "eval.num_items=8", "eval.max_new_tokens=24", "eval.final_full=false", "train.prompts_per_step=2",
                "logging.progress_bar=false", "eval.print_samples=0", "output_dir=run", f"model.name_or_path={model}"]
    loop.train(load_config(None, settings))
    run_eval(["run/checkpoint_1"], EvalOptions(limit=8))
    items = tmp_path / "run" / "eval_items" / "step_1.jsonl"
    periodic = [json.loads(line) for line in items.read_text().splitlines()]
    (written,) = (tmp_path / "run" / "checkpoint_1").glob("completions_*.jsonl")
    checked = [json.loads(line) for line in written.read_text().splitlines()]
    assert [r["uid"] for r in checked] == [r["uid"] for r in periodic] and len(checked) == 8
    assert [r["completion"] for r in checked] == [r["completion"] for r in periodic]
