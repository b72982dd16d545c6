"""builtin:tiny-strong, the strong start in the tiny world (issue 53): the tiny model continued by SFT on
correct solutions only (scripts/build/make_tiny_model.py --recipe tiny-strong). Its shipped files are what
the build makes from the shipped tiny model and data, its measured start holds and lies in the band the
issue asks for (strict greedy accuracy 0.6-0.85: a step can lose as well as gain), and its config trains."""

import hashlib
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen2ForCausalLM

from dapo_train.config.load import load_config
from dapo_train.config.schema import DataConfig
from dapo_train.errors import UserError
from dapo_train.evaluation.generate import evaluate_prompts
from dapo_train.run.logs import read_metrics
from dapo_train.task.locations import (
    TINY_DATA_DIR,
    TINY_MODEL_DIR,
    TINY_STRONG_MODEL_DIR,
    resolve_data_path,
    resolve_model_path,
)
from dapo_train.task.prompts import fixed_eval_subset, load_prompts

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-strong-cpu.yaml"
REBUILD = "rebuild: python scripts/build/make_tiny_model.py --recipe tiny-strong --threads 1"


@pytest.fixture(scope="module")
def info() -> dict:
    return json.loads((TINY_STRONG_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))


def test_the_name_resolves_and_the_config_trains_it_on_its_task():
    assert resolve_model_path("builtin:tiny-strong") == str(TINY_STRONG_MODEL_DIR)
    cfg = load_config(str(CONFIG), [])
    assert (cfg.model.name_or_path, cfg.data.path) == ("builtin:tiny-strong", "builtin:tiny-zh-math")
    assert resolve_data_path(cfg.data.path) == str(TINY_DATA_DIR)
    with pytest.raises(UserError, match="no shipped 'builtin:tiny-strng'.*builtin:tiny-strong"):
        resolve_model_path("builtin:tiny-strng")


def test_the_config_is_the_demo_on_the_strong_start_with_the_studys_recipe():
    """Besides the model, only what the strong-start studies found differs from the demo (configs/tiny-cpu.yaml,
    the defaults): a tenth of its learning rate, 500 steps, sampled evals of every test item every 100 steps
    (docs/studies.md); the run's folder and name come from the config's file name."""
    same = ["output_dir=outputs/x", "run_name=x"]
    study = ["train.learning_rate=1e-5", "train.max_steps=500", "eval.every_steps=100", "eval.num_items=0",
             "eval.samples=8"]
    demo = load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["model.name_or_path=builtin:tiny-strong", *same])
    assert load_config(str(CONFIG), same) != demo
    assert load_config(str(CONFIG), same) == load_config(str(ROOT / "configs" / "tiny-cpu.yaml"),
                                                         ["model.name_or_path=builtin:tiny-strong", *study, *same])


def test_the_shipped_files_are_what_the_build_makes_from_the_shipped_tiny_world(build, info):
    defaults = build.parse_args(["--recipe", "tiny-strong"])
    assert (info["sft_steps"], info["lr"]) == (defaults.steps, defaults.lr), REBUILD
    sha = {path: hashlib.sha256(path.read_bytes()).hexdigest()
           for path in (TINY_MODEL_DIR / "model.safetensors", TINY_DATA_DIR / "train.jsonl")}
    assert info["base_weights_sha256"] == sha[TINY_MODEL_DIR / "model.safetensors"], REBUILD
    assert info["train_data_sha256"] == sha[TINY_DATA_DIR / "train.jsonl"], REBUILD
    assert info["weights_bytes"] == (TINY_STRONG_MODEL_DIR / "model.safetensors").stat().st_size < 6_000_000
    for name in build.TOKENIZER_FILES:
        assert (TINY_STRONG_MODEL_DIR / name).read_bytes() == (TINY_MODEL_DIR / name).read_bytes(), name


def test_the_measured_start_is_strong_but_not_perfect(info):
    """The issue's band for the strict greedy accuracy on the 500 test items, and room at T=1 both ways:
    some sampled groups mixed (informative for DAPO), not every item solved."""
    assert 0.6 <= info["greedy_accuracy"] <= 0.85
    assert info["greedy_format_rate"] == 1.0
    assert 0 < info["informative_groups_T1"] and info["mean_accuracy_T1"] < 0.85


def test_the_recorded_step_0_accuracy_holds_on_the_configs_eval_items(info):
    """Greedy decoding is deterministic: the demo's 100 fixed eval items (what the 40-step strong-start study's
    step-0 evals scored; the config now evaluates all 500) give the accuracy build_info records for them, and
    the first items the recorded examples."""
    model = Qwen2ForCausalLM.from_pretrained(TINY_STRONG_MODEL_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_STRONG_MODEL_DIR)
    prompts, _ = load_prompts(DataConfig(path=str(TINY_DATA_DIR)), tokenizer, "test")
    fixed = fixed_eval_subset(prompts, load_config(str(ROOT / "configs" / "tiny-cpu.yaml"), []).eval.num_items)
    records = evaluate_prompts(model, tokenizer, fixed, max_new_tokens=96, batch_size=100).records
    assert sum(r["correct"] for r in records) / len(fixed) == info["greedy_accuracy_on_100_eval_items"]
    first = evaluate_prompts(model, tokenizer, prompts[:3], max_new_tokens=96, batch_size=3).records
    assert [r["completion"] for r in first] == info["example_greedy"]


def test_two_steps_of_the_config_train_from_a_start_that_samples_mostly_right(tmp_path):
    """The model loads and trains under its config; its T=1 samples are mostly right from the first step
    (the build measured 0.586 on the first 100 items; builtin:tiny's demo starts near 0.13)."""
    from dapo_train.train.loop import train

    cfg = load_config(str(CONFIG), ["train.max_steps=2", "eval.every_steps=0", f"output_dir={tmp_path / 'run'}",
                                    "logging.progress_bar=false", "eval.final_full=false"])
    rows = [row for row in read_metrics(train(cfg)) if "train_accuracy" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["train_accuracy"] > 0.4 and all(row["groups_kept"] > 0 for row in rows)
