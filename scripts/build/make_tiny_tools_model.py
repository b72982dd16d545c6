"""Build builtin:tiny-tools: the tiny model continued on solutions that call the calculator, in
Qwen2.5-Instruct's tool-call format, so tool-integrated rollouts run and are tested offline (issue 42).
Writes dapo_train/assets/tiny-tools/ (the short task's data stays in dapo_train/assets/tiny/data).

    python scripts/build/make_tiny_tools_model.py --threads 1            # tokenizer + SFT + measurement
    python scripts/build/make_tiny_tools_model.py --out /tmp/tt --steps 100 --no-eval
    python scripts/build/make_tiny_tools_model.py --measure-only         # re-measure the shipped model

What it builds (measurements and timings: make_tiny_tools_model.md next to this script):
1. The tokenizer: the tiny model's, with the tool format made cheap to read and write. The chat
   template is qwen_offline.chat_template(None): Qwen2.5-Instruct's layout for tools (a "# Tools"
   section listing each tool's JSON schema between <tools> and </tools>, calls as
   `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` ending the assistant turn, replies
   as a user turn of <tool_response> blocks) without a default system message, like the tiny one.
   The byte-level vocabulary already spells every character of that format; on top of it
   <tool_call>, </tool_call> (added tokens in Qwen2.5 too), <tool_response>, </tool_response>,
   <tools> and </tools> become single added tokens, and BPE merges make each pre-tokenizer piece of
   the calculator's schema, the instructions and the call wrapper that holds an ASCII letter, a brace
   or a quote one token (the prompt is ~370 tokens instead of ~1,000). Every old token keeps its id,
   and the task's prompts and solutions encode exactly as before (checked at build time), so the
   tiny model's weights carry over; the new embedding rows start at the mean of the old ones.
   Positions go from 512 to 1024 (RoPE: no weight depends on it).
2. The weights: builtin:tiny's, trained by SFT (the loss on the assistant's tokens only, the tool
   turns masked as the trainer masks them) on the short task's train split in two formats, step by
   step in turn: three of four steps on tool solutions under the tools prompt, one on the plain
   solutions under the plain prompt (correct ones, no slip), so the same warm start serves runs with
   and without tools. A tool solution calls the calculator once per worked step, with the step's
   own expression ("7 × 8"; the calculator reads × and ÷), and copies each result from the reply:

       <think>\\n乒乓球：\\n<tool_call>\\n{"name": "calculator", "arguments": {"expression": "7 × 8"}}
       \\n</tool_call><|im_end|>
       \\n<|im_start|>user\\n<tool_response>\\n56\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
       一共：\\n<tool_call>...<|im_end|>  ...  答案：91\\n</think>\\n<answer>\\n91\\n</answer><|im_end|>

   The whole transcript then has the hard format (<think> ... </think><answer> ... </answer>).
3. A measurement on the first --eval-items test items (greedy): with tools, a multi-turn loop that
   does what the engines do (generate to <|im_end|>, parse the call, run the calculator, append the
   tool turn as the template renders it, continue), the share of items with a well-formed call the
   calculator accepts, and accuracy; without tools, accuracy and format rate by the code of
   `dapo-train eval` on the plain prompts. Written to build_info.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT
from dapo_train.task.answers import answers_match, extract_answer
from dapo_train.task.locations import TINY_DATA_DIR, TINY_MODEL_DIR, TINY_TOOLS_MODEL_DIR
from dapo_train.tools import resolve_tools, tool_schemas

import qwen_offline
from make_tiny_model import SEED, target_text
from tiny_measure import measure, write_info
from tiny_sft import train_mixed

TOOLS = resolve_tools(["calculator"])
SCHEMAS = tool_schemas(TOOLS)
NEW_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>")
MAX_POSITIONS = 1024
TOOL_MAX_NEW_TOKENS = 256  # the measurement's budget per item, model and tool tokens together
MAX_CALLS = 4
STEP_LINE = re.compile(r"^(?P<label>[^：]+)：(?P<a>\d+) (?P<op>[-+×÷]) (?P<b>\d+) = (?P<c>\d+)$")
CALL_RE = re.compile(r"<tool_call>\n(?P<body>.*?)\n</tool_call>\s*$", re.S)


# ----------------------------------------------------------------------------- conversations
def calculator_call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def tool_conversation(answer: str) -> list[dict]:
    """The assistant and tool messages of a worked answer ("label：a op b = c" lines, "#### N"): one call
    per step, the first turn opening <think>, the last answering in the task's format."""
    steps, final = answer.rsplit("\n#### ", 1)
    messages: list[dict] = []
    for index, line in enumerate(steps.split("\n")):
        step = STEP_LINE.fullmatch(line)
        if step is None:
            raise ValueError(f"not a worked step: {line!r}")
        head = "<think>\n" if index == 0 else ""
        expression = f"{step['a']} {step['op']} {step['b']}"
        messages.append({"role": "assistant", "content": f"{head}{step['label']}：",
                         "tool_calls": [calculator_call(expression)]})
        messages.append({"role": "tool", "name": "calculator", "content": step["c"]})
    messages.append({"role": "assistant", "content": f"答案：{final}\n</think>\n<answer>\n{final}\n</answer>"})
    return messages


def question_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": question}]


def render(tokenizer, messages: list[dict], tools: bool, generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=SCHEMAS if tools else None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def tool_turn_text(tokenizer, result: str) -> str:
    """What the template renders between an assistant's calling turn's <|im_end|> and the next assistant
    turn's first token, for one reply `result`: the tokens a rollout appends."""
    call = [{"role": "assistant", "content": "", "tool_calls": [calculator_call("1 + 1")]}]
    before = render(tokenizer, call, tools=False)
    after = render(tokenizer, call + [{"role": "tool", "content": result}], tools=False, generation_prompt=True)
    end = before.rindex("<|im_end|>") + len("<|im_end|>")
    return after[end:]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_example(tokenizer, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, completion ids, labels): the completion is the whole transcript after the prompt,
    labels -100 on the tool turns (what the rollout appended, not what the policy wrote)."""
    question = question_messages(row["question_zh-cn"])
    messages = question + tool_conversation(row["answer"])
    prompt = render(tokenizer, question, tools=True, generation_prompt=True)
    full = render(tokenizer, messages, tools=True)
    completion, labels, at = [], [], len(prompt)
    for index, message in enumerate(messages[2:], 2):
        if message["role"] != "assistant":
            continue
        # The assistant's turn runs from the previous render's generation prompt to its <|im_end|>.
        start = len(render(tokenizer, messages[:index], tools=True, generation_prompt=True))
        end = full.index("<|im_end|>", start) + len("<|im_end|>")
        context, turn = encode(tokenizer, full[at:start]), encode(tokenizer, full[start:end])
        completion += context + turn
        labels += [-100] * len(context) + turn
        at = end
    prompt_ids = encode(tokenizer, prompt)
    if prompt_ids + completion != encode(tokenizer, full[:at]):
        raise RuntimeError("the turns tokenize differently apart than together: the masks would be off")
    return prompt_ids, completion, labels


def plain_example(tokenizer, row: dict) -> tuple[list[int], list[int], list[int]]:
    """The tiny model's own format, as make_tiny_model.encode_examples (correct solutions)."""
    prompt = render(tokenizer, question_messages(row["question_zh-cn"]), tools=False, generation_prompt=True)
    completion = encode(tokenizer, target_text(row["answer"]) + "<|im_end|>")
    return encode(tokenizer, prompt), completion, completion


# ----------------------------------------------------------------------------- tokenizer
def _bpe(piece: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """`piece` (byte-level characters) as BPE splits it under `ranks`: merge the best-ranked pair, leftmost
    first, until none applies."""
    symbols = list(piece)
    while len(symbols) > 1:
        pairs = [(ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == math.inf:
            break
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def _pieces(backend, texts: list[str], specials: list[str]) -> list[str]:
    """The pre-tokenizer's pieces (byte-level characters) of `texts`, added tokens cut out, in order."""
    split = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    pieces = []
    for text in texts:
        for part in split.split(text):
            pieces += [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(part)]
    return list(dict.fromkeys(pieces))


def build_tokenizer(out: Path, rows: list[dict]) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with the tool format's added tokens and merges, the tools chat template and
    1024 positions, written to `out`; refuses to write one under which a prompt or solution of `rows`
    encodes differently from the tiny tokenizer."""
    base = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    base.chat_template = qwen_offline.chat_template(None)
    specials = list(base.get_vocab().keys() - base.backend_tokenizer.get_vocab(with_added_tokens=False).keys())
    specials += list(NEW_ADDED_TOKENS)
    sample = {"question_zh-cn": "问题", "answer": "一共：12 × 3 = 36\n每人：36 ÷ 4 = 9\n#### 9"}
    tool_texts = [render(base, question_messages(sample["question_zh-cn"]) + tool_conversation(sample["answer"]),
                         tools=True)]
    old_texts = [render(base, question_messages(r["question_zh-cn"]), tools=False, generation_prompt=True)
                 + target_text(r["answer"]) for r in rows]
    old_pieces = set(_pieces(base.backend_tokenizer, old_texts, specials))
    wanted = [piece for piece in _pieces(base.backend_tokenizer, tool_texts, specials)
              if piece not in old_pieces and re.search(r'[A-Za-z{}"]', piece)]

    data = json.loads((TINY_MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    # The added tokens enter the BPE vocabulary at their ids too: transformers 5 rebuilds a Qwen2Tokenizer
    # from vocab and merges and would renumber added tokens missing there after the last vocabulary id.
    vocab.update({token["content"]: token["id"] for token in data["added_tokens"]})
    ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
    # Old pieces that share a character with the tool texts: the only ones a new merge could change.
    tool_chars = set("".join(wanted))
    exposed = {piece: _bpe(piece, ranks) for piece in old_pieces if set(piece) & tool_chars}
    next_id = len(base)
    for piece in wanted:
        symbols = _bpe(piece, ranks)
        added = [("".join(symbols[:k]), symbols[k]) for k in range(1, len(symbols))]
        added = [pair for pair in added if pair not in ranks]
        trial = {**ranks, **{pair: len(ranks) + i for i, pair in enumerate(added)}}
        if any(_bpe(old, trial) != split for old, split in exposed.items()):
            continue  # its merges would change how a task text encodes: the piece stays split
        ranks = trial
        for left, right in added:
            merges.append([left, right])
            if left + right not in vocab:
                vocab[left + right] = next_id
                next_id += 1
    for token in NEW_ADDED_TOKENS:
        vocab[token] = next_id
        data["added_tokens"].append({"id": next_id, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": False})
        next_id += 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = json.loads((TINY_MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["model_max_length"] = MAX_POSITIONS
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                               encoding="utf-8")
    (out / "chat_template.jinja").write_text(qwen_offline.chat_template(None), encoding="utf-8")

    tokenizer = AutoTokenizer.from_pretrained(out)
    if len(tokenizer) != next_id or any(tokenizer.convert_tokens_to_ids(t) != i for t, i in base.get_vocab().items()):
        raise RuntimeError("the tools tokenizer moved an old token's id")
    changed = [t for t in old_texts if encode(tokenizer, t) != encode(base, t)]
    if changed:
        raise RuntimeError(f"{len(changed)} task texts encode differently, e.g. {changed[0]!r}")
    return tokenizer


# ----------------------------------------------------------------------------- measurement
def parse_call(turn: str) -> tuple[str, dict] | None:
    """(name, arguments) of the <tool_call> block that ends an assistant turn, or None."""
    match = CALL_RE.search(turn)
    if match is None:
        return None
    try:
        call = json.loads(match["body"])
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return call["name"], call.get("arguments")


@torch.no_grad()
def tool_rollout(model, tokenizer, question: str) -> dict:
    """One greedy transcript with the calculator in the loop, as a rollout would run it."""
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    prompt = encode(tokenizer, render(tokenizer, question_messages(question), tools=True, generation_prompt=True))
    ids, new, calls, transcript = list(prompt), 0, [], ""
    while new < TOOL_MAX_NEW_TOKENS:
        output = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=TOOL_MAX_NEW_TOKENS - new, do_sample=False, eos_token_id=end_ids,
                                pad_token_id=tokenizer.pad_token_id, repetition_penalty=None, top_k=None,
                                top_p=None, temperature=None)
        turn_ids = output[0, len(ids):].tolist()
        ids += turn_ids
        new += len(turn_ids)
        turn = tokenizer.decode(turn_ids, skip_special_tokens=True)
        transcript += turn
        call = parse_call(turn)
        if call is None or not turn_ids or turn_ids[-1] not in end_ids or len(calls) == MAX_CALLS:
            break
        name, arguments = call
        tool = next((t for t in TOOLS if t.name == name), None)
        result = tool.call(arguments) if tool else f"error: no tool {name!r}"
        calls.append({"name": name, "arguments": arguments, "result": result})
        appended = tool_turn_text(tokenizer, result)
        ids += encode(tokenizer, appended)
        new += len(encode(tokenizer, appended))
        transcript += appended
    return {"transcript": transcript, "calls": calls}


def measure_tools(model, tokenizer, rows: list[dict]) -> dict:
    """Greedy, with the calculator: shares of items that made a call, whose every call parsed and the
    calculator accepted, and accuracy (the task's answer check on the text after the last call)."""
    records = []
    for row in rows:
        result = tool_rollout(model, tokenizer, row["question_zh-cn"])
        calls = result["calls"]
        final = result["transcript"].rsplit("<|im_start|>assistant\n", 1)[-1]
        records.append({
            "called": bool(calls),
            "calls_ok": bool(calls) and all(not c["result"].startswith("error") for c in calls),
            "n_calls": len(calls),
            "correct": answers_match(extract_answer(final), row["answer_only"]),
            "transcript": result["transcript"],
        })
    n = len(records)
    return {
        "items": n,
        "call_rate": sum(r["called"] for r in records) / n,
        "calls_accepted_rate": sum(r["calls_ok"] for r in records) / n,
        "mean_calls": sum(r["n_calls"] for r in records) / n,
        "accuracy": sum(r["correct"] for r in records) / n,
        "example": records[0]["transcript"],
    }


def measure_all(model, tokenizer, data_dir: Path, items: int) -> dict:
    test = [json.loads(line) for line in (data_dir / "test.jsonl").read_text(encoding="utf-8").splitlines()]
    with tempfile.TemporaryDirectory() as tmp:  # the plain measurement reads a data folder: the first items
        (Path(tmp) / "test.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in test[:items]),
                                              encoding="utf-8")
        plain = measure(model, tokenizer, Path(tmp), n_sampled=min(items, 100))
    return {"with_tools_greedy": measure_tools(model, tokenizer, test[:items]),
            "without_tools_greedy": {"items": items, "accuracy": plain["greedy_accuracy"],
                                     "format_rate": plain["greedy_format_rate"], "pass@8_T1": plain["pass@8_T1"]}}


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="Write the model folder here (default: the asset).")
    parser.add_argument("--steps", type=int, default=400, help="SFT steps (3 of 4 on tool solutions).")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--eval-items", type=int, default=100, help="Test items measured with and without tools.")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads.")
    parser.add_argument("--no-eval", action="store_true", help="Skip the measurement.")
    parser.add_argument("--measure-only", action="store_true", help="Re-measure the model there, no build.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or TINY_TOOLS_MODEL_DIR
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    start = time.time()
    if args.measure_only:
        tokenizer = AutoTokenizer.from_pretrained(out)
        model = Qwen2ForCausalLM.from_pretrained(out).eval()
        info = json.loads((out / "build_info.json").read_text(encoding="utf-8"))
        info.update(measure_all(model, tokenizer, TINY_DATA_DIR, args.eval_items))
        write_info(info, out / "build_info.json")
        return 0

    train = [json.loads(line) for line in (TINY_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    tokenizer = build_tokenizer(out, train)
    tools_prompt = encode(tokenizer, render(tokenizer, question_messages("问题"), tools=True, generation_prompt=True))
    print(f"tokenizer: {len(tokenizer)} tokens, a tools prompt {len(tools_prompt)} tokens", flush=True)
    model = Qwen2ForCausalLM.from_pretrained(TINY_MODEL_DIR)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():  # the new rows: the mean of the old ones (deterministic)
        weight = model.get_input_embeddings().weight
        old = len(AutoTokenizer.from_pretrained(TINY_MODEL_DIR))
        weight[old:] = weight[:old].mean(0)
    model.config.max_position_embeddings = MAX_POSITIONS
    sources = [[tool_example(tokenizer, r) for r in train], [plain_example(tokenizer, r) for r in train]]
    losses = train_mixed(model, sources, [0, 0, 0, 1], tokenizer.pad_token_id, args.steps, args.batch_size, args.lr)
    model.save_pretrained(out)
    info = {
        "base_model": "builtin:tiny",
        "base_weights_sha256": hashlib.sha256((TINY_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest(),
        "train_data_sha256": hashlib.sha256((TINY_DATA_DIR / "train.jsonl").read_bytes()).hexdigest(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary": len(tokenizer),
        "tools_prompt_tokens": len(tools_prompt),
        "sft_steps": args.steps,
        "lr": args.lr,
        "batch_size": args.batch_size,
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "build_seconds": round(time.time() - start, 1),
    }
    if not args.no_eval:
        info.update(measure_all(model, tokenizer, TINY_DATA_DIR, args.eval_items))
        info["build_and_eval_seconds"] = round(time.time() - start, 1)
    write_info(info, out / "build_info.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
