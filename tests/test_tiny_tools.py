"""builtin:tiny-tools, the tiny model continued on solutions that call the calculator (issue 42): it loads
offline from the package, its chat template renders tools in Qwen2.5-Instruct's layout, its tokenizer
keeps the tiny one's ids and encodings, and greedily it writes calls that parse and the calculator
accepts. The call parser here is written from the format, independently of the build script's."""

import hashlib
import json
import re

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT
from dapo_train.task.locations import TINY_DATA_DIR, TINY_MODEL_DIR, TINY_TOOLS_MODEL_DIR, resolve_model_path
from dapo_train.tools import require_tool_template, resolve_tools, tool_schemas

import qwen_offline
from make_tiny_tools_model import tool_example

CALL = re.compile(r'<tool_call>\n(\{.*\})\n</tool_call>$', re.S)


def rows(split: str, n: int) -> list[dict]:
    lines = (TINY_DATA_DIR / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny-tools"))


def prompt(tokenizer, question: str, tools: bool = True) -> str:
    chat = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tools=tool_schemas(resolve_tools(["calculator"])) if tools else None,
                                         tokenize=False, add_generation_prompt=True)


def test_the_template_is_qwen25s_tool_layout(tokenizer):
    require_tool_template(tokenizer, resolve_tools(["calculator"]))
    assert tokenizer.chat_template == qwen_offline.chat_template(None)
    text = prompt(tokenizer, "问题")
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}\n\n# Tools\n\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "calculator", ' in text
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\n问题<|im_end|>\n<|im_start|>assistant\n")
    assert len(tokenizer(text).input_ids) < 400 <= len(text)  # the format's words are single tokens


def test_the_tokenizer_keeps_the_tiny_ids_and_encodings(tokenizer):
    tiny = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    assert all(tokenizer.convert_tokens_to_ids(token) == index for token, index in tiny.get_vocab().items())
    for row in rows("test", 20):
        text = prompt(tiny, row["question_zh-cn"], tools=False) + row["answer"]
        assert tokenizer(text).input_ids == tiny(text).input_ids
    ids = tokenizer("<tool_call></tool_call><tool_response></tool_response>", add_special_tokens=False).input_ids
    assert len(ids) == 4 and tokenizer.decode(ids, skip_special_tokens=True) == \
        "<tool_call></tool_call><tool_response></tool_response>"


def test_the_shipped_files_name_their_sources():
    info = json.loads((TINY_TOOLS_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    sha = {name: hashlib.sha256(path.read_bytes()).hexdigest()
           for name, path in [("base", TINY_MODEL_DIR / "model.safetensors"), ("data", TINY_DATA_DIR / "train.jsonl")]}
    assert (info["base_weights_sha256"], info["train_data_sha256"]) == (sha["base"], sha["data"]), \
        "builtin:tiny or its data changed: rebuild with python scripts/build/make_tiny_tools_model.py"
    assert (TINY_TOOLS_MODEL_DIR / "model.safetensors").stat().st_size < 6_000_000


def test_training_targets_mask_the_tool_turns(tokenizer):
    row = {"question_zh-cn": "问题", "answer": "一共：12 × 3 = 36\n每人：36 ÷ 4 = 9\n#### 9"}
    prompt_ids, completion, labels = tool_example(tokenizer, row)
    assert tokenizer.decode(prompt_ids) == prompt(tokenizer, "问题")
    trained = tokenizer.decode([t for t, label in zip(completion, labels) if label != -100])
    context = tokenizer.decode([t for t, label in zip(completion, labels) if label == -100])
    call = '\n<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'
    assert trained == ("<think>\n一共：" + call.format("12 × 3") + "每人：" + call.format("36 ÷ 4")
                       + "答案：9\n</think>\n<answer>\n9\n</answer><|im_end|>")
    reply = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert context == reply.format(36) + reply.format(9)


@torch.no_grad()
def test_greedy_calls_parse_and_the_calculator_accepts_them(tokenizer):
    model = Qwen2ForCausalLM.from_pretrained(resolve_model_path("builtin:tiny-tools")).eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    accepted = []
    for row in rows("test", 6):
        ids = tokenizer(prompt(tokenizer, row["question_zh-cn"]), return_tensors="pt").input_ids
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False,
                             eos_token_id=end, pad_token_id=tokenizer.pad_token_id, repetition_penalty=None,
                             top_k=None, top_p=None, temperature=None)
        turn = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        match = CALL.search(turn)
        if match is None:
            continue
        call = json.loads(match.group(1))
        assert call["name"] == "calculator" and set(call["arguments"]) == {"expression"}, turn
        result = resolve_tools(["calculator"])[0].call(call["arguments"])
        accepted.append(not result.startswith("error"))
    assert sum(accepted) >= 4, f"{sum(accepted)} of 6 greedy first turns made an accepted calculator call"
