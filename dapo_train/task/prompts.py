"""Dataset -> Prompt records: load a split, apply the chat template, read the gold answer.

Sources (`data.path`: a Hub dataset id, a local folder or file, `builtin:tiny-zh-math`) are read by
sources.py (load_split).

The task also says what "correct" means (`data.correctness`, an answers.AnswerCheck): how a gold
answer is read (here, for every row) and how a completion is graded against it (the rewards,
dynamic sampling and evaluation); the default is numeric equivalence.

- Prompts longer than `data.max_prompt_length` are dropped and counted, never truncated: cutting
  from the right loses the "<|im_start|>assistant\n" header, and the policy then continues the
  question instead of answering it.
- Rows whose gold answer cannot be read are dropped and counted instead of becoming prompts that
  can never be rewarded.
- Data order comes from a sampler seeded by (seed, epoch) alone, so a resumed run sees exactly the
  prompts the uninterrupted run would have seen; the eval subset never depends on the seed.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np

from dapo_train.config.schema import DataConfig
from dapo_train.errors import UserError
from dapo_train.task.answers import answer_check
from dapo_train.task.sources import load_split

logger = logging.getLogger(__name__)

EVAL_SUBSET_SALT = "dapo-train-eval"


@dataclass(frozen=True)
class Prompt:
    """One training or eval question, ready for generation.

    uid: "<split>:<row index in the split>"; gold: the AnswerCheck's gold string (numeric: canonical,
    "2125", "-10");
    text: the chat-templated prompt ending with the assistant header;
    input_ids: (prompt_len,) token ids of `text`, no special tokens added beyond the template's.
    """

    uid: str
    question: str
    gold: str
    text: str
    input_ids: tuple[int, ...]


@dataclass
class PromptStats:
    """What happened to the rows of one split (logged once, checked by tests)."""

    rows: int = 0
    kept: int = 0
    dropped_unreadable_answer: int = 0
    dropped_too_long: int = 0
    dropped_empty_question: int = 0
    dropped_question_not_text: int = 0  # a number, an object, a list: not a question to template
    lengths: list[int] = field(default_factory=list)  # prompt tokens of every readable row, dropped ones included

    def summary(self) -> str:
        return (
            f"{self.rows} rows, {self.kept} prompts kept; dropped: {self.dropped_unreadable_answer} "
            f"unreadable answer, {self.dropped_too_long} too long, {self.dropped_empty_question} empty question, "
            f"{self.dropped_question_not_text} question not text"
        )


# --------------------------------------------------------------------------------------------
# Prompts: columns checked, gold answers read, chat template applied, overlong prompts dropped.


def _check_columns(dataset: datasets.Dataset, data_cfg: DataConfig, split: str) -> None:
    for key in ("prompt_field", "answer_field"):
        column = getattr(data_cfg, key)
        if column not in dataset.column_names:
            raise UserError(
                f"data.{key} '{column}' is not a column of {data_cfg.path} [{split}]; "
                f"columns: {', '.join(dataset.column_names)}"
            )


def chat_prompt(tokenizer: Any, question: str, system_prompt: str, tools: list[dict] | None = None) -> str:
    """The question as the model sees it: system + user turns, then the assistant header; tools: the
    JSON schemas of rollout.tools, which the chat template lists (tools.tool_schemas)."""
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    listed = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **listed)


def _readable_rows(dataset: datasets.Dataset, data_cfg: DataConfig, stats: PromptStats) -> list[tuple[int, str, str]]:
    """(row index, question, gold) of rows with a question and a readable answer; counts the rest, and says
    which row was the first of each kind that names a cell (an unreadable answer, a question that is not text)."""
    normalize_gold = answer_check(data_cfg.correctness).normalize_gold
    rows = []
    first: dict[str, tuple[int, Any]] = {}
    for index, (question, answer) in enumerate(zip(dataset[data_cfg.prompt_field], dataset[data_cfg.answer_field])):
        gold = normalize_gold(answer)
        if gold is None:
            stats.dropped_unreadable_answer += 1
            first.setdefault("answer", (index, answer))
        elif not isinstance(question, str):
            stats.dropped_question_not_text += 1
            first.setdefault("question", (index, question))
        elif not question.strip():
            stats.dropped_empty_question += 1
        else:
            rows.append((index, question, gold))
    if "answer" in first:
        logger.warning("%d rows have an unreadable %s and are dropped (first: row %d, %r)",
                       stats.dropped_unreadable_answer, data_cfg.answer_field, *first["answer"])
    if "question" in first:
        logger.warning("%d rows have a %s that is not text and are dropped (first: row %d, %r)",
                       stats.dropped_question_not_text, data_cfg.prompt_field, *first["question"])
    return rows


def build_prompts(
    dataset: datasets.Dataset, tokenizer: Any, data_cfg: DataConfig, split: str, tools: list[dict] | None = None
) -> tuple[list[Prompt], PromptStats]:
    """Prompt records for every usable row of `dataset` (its columns checked: load_prompt_splits), in
    dataset order, and what was dropped; tools: listed in each prompt (chat_prompt)."""
    where = f"{data_cfg.path} [{split}]"
    if len(dataset) == 0:
        raise UserError(f"split '{split}' of {data_cfg.path} has no rows")
    stats = PromptStats(rows=len(dataset))
    rows = _readable_rows(dataset, data_cfg, stats)
    texts = [chat_prompt(tokenizer, question, data_cfg.system_prompt, tools) for _, question, _ in rows]
    # verbose=False: the prompts longer than the model are counted and dropped below, not announced by
    # transformers' "indexing errors" warning.
    token_ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
    prompts = []
    for (index, question, gold), text, ids in zip(rows, texts, token_ids):
        if len(ids) > data_cfg.max_prompt_length:
            stats.dropped_too_long += 1
            continue
        prompts.append(Prompt(f"{split}:{index}", question, gold, text, tuple(ids)))
    stats.kept = len(prompts)
    stats.lengths = [len(ids) for ids in token_ids]
    longest = max(stats.lengths, default=0)
    if stats.dropped_too_long:
        logger.warning(
            "%d prompts of %s are longer than data.max_prompt_length=%d tokens and are dropped (longest: %d)",
            stats.dropped_too_long, where, data_cfg.max_prompt_length, longest,
        )
    if not prompts:
        raise _nothing_left(stats, data_cfg, where, longest)
    return prompts, stats


def _nothing_left(stats: PromptStats, data_cfg: DataConfig, where: str, longest: int) -> UserError:
    """Every row was dropped: say which drops happened and what setting each points at."""
    hints = []
    if stats.dropped_unreadable_answer:
        hints.append(f"check that data.answer_field '{data_cfg.answer_field}' holds numbers or '#### N' solutions")
    if stats.dropped_empty_question or stats.dropped_question_not_text:
        hints.append(f"check that data.prompt_field '{data_cfg.prompt_field}' holds the questions, as text")
    if stats.dropped_too_long:
        hints.append(
            f"raise data.max_prompt_length={data_cfg.max_prompt_length} (the longest prompt has {longest} tokens)"
        )
    return UserError(f"no usable prompts in {where}: {stats.summary()}; {'; '.join(hints)}")


def load_prompts(data_cfg: DataConfig, tokenizer: Any, split: str, tools: list[dict] | None = None
                 ) -> tuple[list[Prompt], PromptStats]:
    """load_split + build_prompts, with the counts logged; tools: listed in each prompt (chat_prompt)."""
    return load_prompt_splits(data_cfg, tokenizer, [split], tools)[split]


def load_prompt_splits(
    data_cfg: DataConfig, tokenizer: Any, splits: list[str], tools: list[dict] | None = None
) -> dict[str, tuple[list[Prompt], PromptStats]]:
    """Several splits' prompts, each split's counts logged. Every split is read and its columns checked
    before any is turned into prompts, so a missing eval split or column fails before the train split's
    tokenizing (and before its log line). tools: the tool schemas each prompt lists (rollout.tools)."""
    loaded = {split: load_split(data_cfg, split) for split in dict.fromkeys(splits)}
    for split, dataset in loaded.items():
        _check_columns(dataset, data_cfg, split)
    built = {}
    for split, dataset in loaded.items():
        built[split] = build_prompts(dataset, tokenizer, data_cfg, split, tools)
        logger.info("data %s [%s]: %s", data_cfg.path, split, built[split][1].summary())
    return built


# --------------------------------------------------------------------------------------------
# Order: a seeded sampler for training, a seed-independent subset for evaluation.


class PromptSampler:
    """Endless prompts in a shuffled order: one permutation per epoch, drawn from (seed, epoch).

    The permutation does not touch global RNG state, so generation or dropout randomness cannot
    shift the data order, and (epoch, position) is all a checkpoint needs to resume it exactly.
    """

    def __init__(self, prompts: list[Prompt], seed: int):
        if not prompts:
            raise ValueError("PromptSampler needs at least one prompt")
        self.prompts = list(prompts)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        rng = np.random.default_rng([self.seed % 2**32, epoch])
        return rng.permutation(len(self.prompts)).tolist()

    def next_batch(self, n: int) -> list[Prompt]:
        """The next n prompts; an epoch boundary inside the batch starts the next permutation."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        batch = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        """Continue where the saved sampler stopped; the prompt set must be the same size."""
        saved = state.get("num_prompts", len(self.prompts))
        if saved != len(self.prompts):
            raise UserError(
                f"cannot resume the data order: the checkpoint saw {saved} prompts, this run has "
                f"{len(self.prompts)} (data.path or data.max_prompt_length changed?)"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def fixed_eval_subset(prompts: list[Prompt], n: int) -> list[Prompt]:
    """n prompts chosen by a hash of their uid, in dataset order; n <= 0 or n >= len: all.

    The choice depends on nothing but the uids: not the training seed, not the list order, and
    it barely moves when a few prompts are dropped (a smaller n picks a subset of a larger n's).
    """
    if n <= 0 or n >= len(prompts):
        return list(prompts)

    def rank(item: tuple[int, Prompt]) -> bytes:
        return hashlib.sha256(f"{EVAL_SUBSET_SALT}:{item[1].uid}".encode()).digest()

    chosen = sorted(sorted(enumerate(prompts), key=rank)[:n], key=lambda item: item[0])
    return [prompt for _, prompt in chosen]
