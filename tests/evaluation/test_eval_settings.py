"""Issue 59 items 11 and 16: `dapo-train eval` with settings of its own. Evals whose settings differ (a budget
given as rollout.max_new_tokens, a system prompt) coexist instead of overwriting the plain eval's files, and
record the system prompt; a setting an evaluation cannot act on (model.lora.r on a checkpoint) says so; the
change from step 0 stays for settings that do not change what is evaluated (the progress bar), and where it
cannot be given one line says which setting differs."""

import dataclasses
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from dapo_train.config.load import load_config, save_config
from dapo_train.evaluation.command import EvalOptions, run_eval
from dapo_train.evaluation.settings import result_name
from dapo_train.run.eval_items import PERIODIC, write_items
from dapo_train.run.files import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "dapo_train" / "assets" / "tiny" / "model"


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """run/checkpoint_1: the tiny model with the config its run saved (a 4-token budget), cwd tmp_path."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "run" / "checkpoint_1"
    shutil.copytree(TINY_MODEL, folder)
    save_config(load_config(None, [f"output_dir={tmp_path / 'run'}", "rollout.max_new_tokens=4"]),
                folder / "config.yaml")
    return folder


OPTIONS = EvalOptions(limit=3, split="train")


def _eval(folder: Path, *overrides: str) -> dict:
    run_eval([str(folder)], dataclasses.replace(OPTIONS, overrides=overrides))
    return {path.name: json.loads(path.read_text()) for path in folder.glob("eval_*.json")}


def test_evals_with_other_settings_coexist_and_record_their_system_prompt(checkpoint):
    """Reproduced: `eval CK --limit 3 rollout.max_new_tokens=8` and `eval CK --limit 3 data.system_prompt=...` each
    wrote eval_train_limit3.json over the plain eval's."""
    plain = _eval(checkpoint)["eval_train_limit3.json"]
    assert plain["settings"]["system_prompt"] == load_config(None, []).data.system_prompt
    assert plain["settings"]["changed"] == {}
    longer = _eval(checkpoint, "rollout.max_new_tokens=8")
    assert longer["eval_train_limit3.json"] == plain  # the plain eval stays as it was
    assert longer["eval_train_limit3_len8.json"]["settings"]["max_new_tokens"] == 8
    prompted = _eval(checkpoint, "data.system_prompt=Be brief.")
    assert prompted["eval_train_limit3.json"] == plain
    brief = prompted["eval_train_limit3_system_prompt=Be-brief..json"]
    assert brief["settings"]["system_prompt"] == "Be brief."
    assert brief["settings"]["changed"] == {"data.system_prompt": "Be brief."}
    assert sorted(_eval(checkpoint, "logging.progress_bar=false", "eval.batch_size=2")) == sorted(prompted)  # the same


def test_settings_past_the_name_length_are_named_by_a_hash():
    # system_prompt=<6-digit hash> (20 characters), max_prompt_length=200 (21), correctness=pkg.mod-check (25):
    # 68 with their underscores, past 60.
    changes = {"data.system_prompt": "x" * 100, "data.max_prompt_length": 200, "data.correctness": "pkg.mod:check"}
    name = result_name("test", None, 1, 1.0, None, changes=changes)
    assert re.fullmatch(r"test_settings[0-9a-f]{8}", name), name
    assert name != result_name("test", None, 1, 1.0, None, changes={**changes, "seed": 3})
    assert result_name("test", 5, 1, 1.0, None, changes={"data.max_prompt_length": 200}) == \
        "test_limit5_max_prompt_length=200"


def test_a_training_setting_says_it_cannot_act_on_an_evaluation(checkpoint, caplog):
    """Reproduced: `model.lora.r=8` on a checkpoint was ignored without a word."""
    with caplog.at_level(logging.WARNING):
        evals = _eval(checkpoint, "model.lora.r=8", "train.learning_rate=0.5")
    assert (f"model.lora.r=8, train.learning_rate=0.5 cannot act on an evaluation of {checkpoint}: training "
            "settings; a checkpoint loads with the weights (and a LoRA checkpoint the adapter) it saved") in caplog.text
    assert list(evals) == ["eval_train_limit3.json"]  # what is evaluated is the plain eval
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _eval(checkpoint, "seed=3")  # greedy: nothing is drawn
    assert "seed=3 cannot act on an evaluation" in caplog.text
    assert "seed draws only for --samples above 1" in caplog.text


def test_the_change_from_step_0_stays_for_settings_that_do_not_change_the_eval(checkpoint, capsys):
    """Reproduced: any KEY=VALUE, even logging.progress_bar=false, dropped the Δ from step 0 columns without a
    word. The step-0 records here are this checkpoint's own eval: a change of exactly 0 on its 3 items."""
    _eval(checkpoint)
    records = read_jsonl(checkpoint / "completions_train_limit3.jsonl")
    write_items(checkpoint.parent, PERIODIC, 0, records)
    capsys.readouterr()
    quiet = _eval(checkpoint, "logging.progress_bar=false")["eval_train_limit3.json"]["metrics"]
    assert (quiet["change"], quiet["change_items"]) == (0.0, 3)
    assert "Δ from step 0" in capsys.readouterr().out
    longer = _eval(checkpoint, "rollout.max_new_tokens=8")["eval_train_limit3_len8.json"]["metrics"]
    printed = capsys.readouterr().out
    assert "change" not in longer and "Δ from step 0  " not in printed
    assert (f"{checkpoint}: no Δ from step 0: a completion budget of 8 differs from how the run evaluated step 0 "
            "(greedy, its own config)") in printed
    _eval(checkpoint, "data.system_prompt=Be brief.")
    assert "no Δ from step 0: data.system_prompt=Be brief. differs from how the run" in capsys.readouterr().out
