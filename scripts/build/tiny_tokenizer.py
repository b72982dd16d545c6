"""The tiny world's tokenizer: Qwen's byte-level BPE pipeline, character-level on the corpus.

Build-time code for make_tiny_model.py (next to this file); the package only reads the saved files.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
CHINESE_PUNCTUATION = "，。、；：？！“”‘’（）《》【】—…·￥"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2's pre-tokenizer split (as in its tokenizer.json): letters runs, single digits, punctuation.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def byte_alphabet() -> list[str]:
    """GPT-2 / Qwen byte-level alphabet: byte b is written as the printable character [b].

    Printable Latin-1 bytes stand for themselves; the other 68 are moved to U+0100 upwards, so
    every byte has a visible one-character token (space is 'Ġ', newline 'Ċ').
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


def build_tokenizer(corpus: list[str], max_length: int) -> PreTrainedTokenizerFast:
    """Qwen's byte-level BPE pipeline with merges that make every known character one token.

    Why byte-level rather than a character vocabulary with <0xNN> byte fallback: transformers 5
    loads any model_type=qwen2 folder through Qwen2Tokenizer, which rebuilds Qwen's pipeline (NFC,
    Qwen's split regex, byte-level BPE) from the saved vocab and merges and ignores a custom
    pipeline. So the tiny tokenizer is built with that same pipeline: the 256 byte tokens (ids
    0..255) make any text encode and decode losslessly, and for each multi-byte character of the
    corpus, the system prompt and common Chinese punctuation, merges join its UTF-8 bytes (lead
    byte + continuation bytes) into one token. A merge always starts with a lead byte, so merges
    never join bytes of two different characters: the result is character-level.
    """
    alphabet = byte_alphabet()
    chars = set("".join(corpus)) | set(DEFAULT_SYSTEM_PROMPT) | set(CHINESE_PUNCTUATION)
    vocab = {token: index for index, token in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    for char in sorted(c for c in chars if ord(c) > 127):
        pieces = [alphabet[b] for b in char.encode("utf-8")]
        for end in range(2, len(pieces) + 1):
            left, right = "".join(pieces[: end - 1]), pieces[end - 1]
            if left + right not in vocab:
                vocab[left + right] = len(vocab)
                merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TAG_TOKENS])
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=list(SPECIAL_TOKENS), clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE, model_max_length=max_length,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, model_dir: Path) -> None:
    """save_pretrained, then name the class AutoTokenizer will use anyway (Qwen2Tokenizer)."""
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="Qwen2Tokenizer", unk_token=None, bos_token=None)
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
