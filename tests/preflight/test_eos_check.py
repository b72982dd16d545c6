"""The rollout check's EOS verdict on the Qwen-shaped rehearsals of configs/qwen1.5b-seed.yaml (Qwen2.5's
tokenizer rebuilt offline, its two EOS ids, top-k 50 of 151,936 rows) and configs/qwen1.5b.yaml (the
untruncated distribution at temperature 1.0, G=8) over 20 seeds: one round of the seed's 4 prompts x G=4
missed an EOS id on 12 of 100 seeds (seed 16 among them), so preflight said "not ready" to a good config
by chance. The whole preflight on every Qwen config and 20 seeds is scripts/bench/preflight_table.py's
(docs/benchmarks.md)."""

import dataclasses
from pathlib import Path

import datasets
import pytest

from dapo_train.config.load import load_config
from dapo_train.model.loading import load_model_config, load_tokenizer
from dapo_train.preflight import command, rehearsal
from dapo_train.preflight.report import Report
from dapo_train.task.prompts import build_prompts

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["小明有3个苹果，又买了5个，他现在有多少个苹果？", "一本书12元，买4本要多少元？",
             "班上有28个学生，平均分成4组，每组几人？", "妈妈买了2千克梨，每千克6元，一共花了多少元？"]


@pytest.fixture(scope="module", params=["qwen1.5b-seed", "qwen1.5b"])
def qwen(request, tmp_path_factory, qwen_folder):
    """(the config on the offline Qwen2.5-1.5B-Instruct folder, its tokenizer, its rehearsal model, prompts)."""
    root = tmp_path_factory.mktemp("qwen")
    folder = qwen_folder
    cfg = load_config(str(ROOT / "configs" / f"{request.param}.yaml"), [f"model.name_or_path={folder}"])
    model_config, generation = load_model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    rows = datasets.Dataset.from_dict({cfg.data.prompt_field: QUESTIONS, cfg.data.answer_field: ["8", "48", "7", "12"]})
    prompts, _ = build_prompts(rows, tokenizer, cfg.data, "test")
    small, _ = rehearsal.shrink(cfg, root / "model", root / "run", cuda=False)  # a bf16 rollout copy among others
    # The decode loop samples as the static-cache engine does (tests/rollout), 20x faster on a CPU at
    # 151,936 rows (generate's multinomial): the seeds here test the calibration and the rounds.
    small = dataclasses.replace(small, rollout=dataclasses.replace(small.rollout, compile="off"))
    r = small.rollout
    sampling = command.SamplingSettings(r.max_new_tokens, True, r.temperature, r.top_p, r.top_k)
    model = rehearsal.build_model(model_config, generation, tokenizer, root / "model", sampling)
    return small, tokenizer, model, prompts


@pytest.mark.parametrize("seed", range(20))
def test_every_eos_id_ends_a_completion_whatever_the_seed(qwen, seed):
    small, tokenizer, model, prompts = qwen
    report = Report()
    command._report_rollout(dataclasses.replace(small, seed=seed), model, tokenizer, prompts, report)
    text = " ".join(report.rows[-1][1].split())
    assert "ended by <|im_end|>" in text and "<|endoftext|>" in text, text
