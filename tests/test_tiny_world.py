"""The embedded world: the generated task, the shipped tokenizer and the shipped tiny model."""

import hashlib
import json
import os
import re
import subprocess
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT
from dapo_train.task.locations import TINY_DATA_DIR, TINY_MODEL_DIR

from conftest import assert_shipped_data, assert_worked_solutions
from tiny_task import MAX_AMOUNT, MAX_FACTOR, MAX_RESULT, NOTES, Problem, Rejected, generate_problems, make_splits

STEP_RE = re.compile(r"^[^：]+：(\d+) ([-+×÷]) (\d+) = (\d+)$")


@pytest.fixture(scope="module")
def splits():
    return make_splits(0)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


# ----------------------------------------------------------------------------- the task
def test_generator_is_a_pure_function_of_the_seed():
    assert generate_problems(40, seed=3) == generate_problems(40, seed=3)
    assert generate_problems(40, seed=3) != generate_problems(40, seed=4)
    # A longer list from the same seed starts with the shorter one (one rng, drawn in order).
    assert generate_problems(60, seed=3)[:40] == generate_problems(40, seed=3)


def test_splits_have_the_documented_sizes_and_share_no_question(splits):
    assert (len(splits["train"]), len(splits["test"])) == (4000, 500)
    train_questions = {r["question_zh-cn"] for r in splits["train"]}
    assert len(train_questions) == 4000
    assert not train_questions & {r["question_zh-cn"] for r in splits["test"]}


def test_shipped_data_is_what_the_generator_makes(splits):
    assert_shipped_data(splits, TINY_DATA_DIR, "python scripts/build/make_tiny_model.py")


def test_every_worked_step_is_exact_arithmetic_and_ends_in_answer_only(splits):
    assert_worked_solutions(splits["train"] + splits["test"], STEP_RE, range(1, 4), MAX_RESULT)


def test_numbers_in_questions_stay_small(splits):
    """Amounts below MAX_AMOUNT + 1; above it only a "k times as many" start (k x amount) and a
    note paid in a shop."""
    for row in splits["train"] + splits["test"]:
        question = row["question_zh-cn"]
        for number in map(int, re.findall(r"\d+", question)):
            if number <= MAX_AMOUNT:
                continue
            note = f"付了 {number} 元" in question and number in NOTES
            times = "倍" in question and f"有 {number} " in question and number <= MAX_FACTOR * MAX_AMOUNT
            assert note or times, (number, question)


def test_the_mix_runs_from_easy_to_hard(splits):
    counts = [0, 0, 0]
    for row in splits["train"]:
        counts[row["answer"].count("\n") - 1] += 1
    # STEP_WEIGHTS = 0.5 / 0.3 / 0.2 over 4000 rows: about 2000 / 1200 / 800 before rejections, which
    # fall more on longer problems (a result above MAX_RESULT).
    assert counts[0] > counts[1] > counts[2] > 600


def test_step_records_the_line_and_rejects_inexact_division():
    problem = Problem()
    assert problem.step("每人", 84, "÷", 2) == 42  # 84 / 2 = 42 exactly
    assert problem.steps == ["每人：84 ÷ 2 = 42"]
    with pytest.raises(Rejected):
        problem.step("每人", 7, "÷", 2)  # 3.5 is not an integer result
    with pytest.raises(Rejected):
        problem.step("还剩", 5, "-", 5)  # results must stay positive
    with pytest.raises(Rejected):
        problem.step("一共", 50, "+", MAX_RESULT - 49)  # and at most MAX_RESULT
    assert problem.step("一共", 50, "+", MAX_RESULT - 50) == MAX_RESULT
    # Rejected steps leave no line.
    assert problem.steps == ["每人：84 ÷ 2 = 42", f"一共：50 + {MAX_RESULT - 50} = {MAX_RESULT}"]


# ----------------------------------------------------------------------------- the tokenizer
def test_round_trip_of_chinese_tags_newlines_spaces_and_a_rare_character(tokenizer):
    text = "小明有 12 个苹果。\n<think>\n一共：12 + 5 = 17\n</think>\n<answer>\n17\n</answer>  龘\t!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode("龘")) == 3  # unseen: U+9F98 is 3 UTF-8 bytes, one byte token each
    assert len(tokenizer.encode("苹果 17")) == 5  # seen characters, digits and space: one token each


@settings(max_examples=200, deadline=None)
@given(st.text().filter(lambda s: unicodedata.normalize("NFC", s) == s and "<|" not in s))
def test_any_nfc_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tags_are_single_tokens_and_every_known_character_is_one_token(tokenizer, splits):
    for tag in ("<think>", "</think>", "<answer>", "</answer>"):
        assert len(tokenizer.encode(tag)) == 1
    text = DEFAULT_SYSTEM_PROMPT + "".join(r["question_zh-cn"] + r["answer"] for r in splits["test"])
    tag_chars = sum(len(tag) - 1 for tag in re.findall(r"</?(?:think|answer)>", text))
    assert len(tokenizer.encode(text)) == len(text) - tag_chars


def test_special_tokens_are_qwen_style(tokenizer):
    vocab_size = len(tokenizer)
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [vocab_size - 3, vocab_size - 2, vocab_size - 1]  # added last, in this order
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tokenizer.encode("<|im_start|>") == [ids[1]]
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    assert config.eos_token_id == ids[2] and config.vocab_size == vocab_size
    generation = GenerationConfig.from_pretrained(TINY_MODEL_DIR)
    assert generation.eos_token_id == [ids[2], ids[0]] and generation.pad_token_id == ids[0]
    assert (generation.do_sample, generation.temperature, generation.top_p, generation.top_k) == (True, 0.7, 0.8, 20)
    assert generation.repetition_penalty == 1.05


def test_chat_template_is_qwen_style(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    turns = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == turns
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == turns + "<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- the model
LOAD_AND_GENERATE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from dapo_train.task.locations import TINY_MODEL_DIR
from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT
tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
tokenizer.padding_side = "left"
questions = json.loads(sys.stdin.read())
prompts = [tokenizer.apply_chat_template([{"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
           {"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in questions]
batch = tokenizer(prompts, return_tensors="pt", padding=True)
with torch.no_grad():
    out = model.generate(**batch, max_new_tokens=96, do_sample=False, repetition_penalty=1.0,
                         eos_token_id=model.generation_config.eos_token_id, pad_token_id=tokenizer.pad_token_id)
texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
print(json.dumps({"texts": texts, "params": sum(p.numel() for p in model.parameters()),
                  "dtype": str(model.dtype), "arch": type(model).__name__}))
"""


def test_shipped_model_loads_offline_and_answers_in_format(splits):
    questions = [r["question_zh-cn"] for r in splits["test"][:8]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_GENERATE], input=json.dumps(questions), env=env,
        capture_output=True, text=True, timeout=120, check=True,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["arch"] == "Qwen2ForCausalLM" and result["dtype"] == "torch.float32"
    assert result["params"] < 5_000_000
    for text in result["texts"]:
        assert re.fullmatch(r"<think>\n.+\n</think>\n<answer>\n\d+\n</answer>", text, re.DOTALL), text


def test_shipped_model_was_trained_on_the_shipped_data():
    info = json.loads((TINY_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    shipped = hashlib.sha256((TINY_DATA_DIR / "train.jsonl").read_bytes()).hexdigest()
    assert info["train_data_sha256"] == shipped, "weights and data differ: python scripts/build/make_tiny_model.py"


def test_shipped_files_are_small():
    weights = (TINY_MODEL_DIR / "model.safetensors").stat().st_size
    assert weights < 8_000_000  # ~1M float32 parameters = ~4 MB
