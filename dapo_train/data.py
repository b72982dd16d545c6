"""Dataset -> Prompt records: load a split, apply the chat template, read the gold answer.

Sources (`data.path`): a Hugging Face dataset id, a local folder (a `save_to_disk` output, or
parquet/jsonl/json/csv files whose names say their split), a single such file, or
`builtin:tiny-zh-math`. Everything goes through `datasets`.

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
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from dapo_train import hub
from dapo_train.answers import answer_check
from dapo_train.config import DataConfig, looks_like_path, resolve_data_path
from dapo_train.errors import UserError

logger = logging.getLogger(__name__)

# File suffix -> the `datasets` builder that reads it.
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Canonical split name -> words that name it inside a file or folder name.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "test": ("test", "testing"),
    "validation": ("validation", "valid", "val", "dev"),
}
LOCAL_COPY_HINT = "set data.path to a local folder or file (e.g. ./gsm8k_chinese with data/train-*.parquet)"
DATASET_REPO = hub.RepoKind("dataset", "data.path", local="path", existing="file or folder", hint=LOCAL_COPY_HINT)
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

    def summary(self) -> str:
        return (
            f"{self.rows} rows, {self.kept} prompts kept; dropped: {self.dropped_unreadable_answer} "
            f"unreadable answer, {self.dropped_too_long} too long, {self.dropped_empty_question} empty question"
        )


# --------------------------------------------------------------------------------------------
# Sources: each kind of data.path -> one datasets.Dataset for the requested split.


def split_of_name(name: str) -> str | None:
    """The split a file or folder name states as a word ("data/train-00000-of-00001" -> train).

    Words are runs of letters, so "train-0001", "gsm8k_test" and "dev.jsonl" name splits while
    "latest" and "trainset" do not (as in the Hub's own split patterns). The file name wins over
    its folders, nearest folder first.
    """
    for part in reversed(Path(name).parts):
        words = set(re.findall(r"[a-z]+", part.lower()))
        for split, names in SPLIT_WORDS.items():
            if words.intersection(names):
                return split
    return None


def _available(splits: list[str], where: str, split: str) -> UserError:
    return UserError(
        f"split '{split}' not found in {where}; splits: {', '.join(splits) or 'none'} "
        "(set data.train_split / data.eval_split to one of them)"
    )


def _load_files(files: dict[str, list[Path]], split: str, where: str) -> datasets.Dataset:
    """Read one split's files with the builder their suffix names (all must share one)."""
    if split not in files:
        raise _available(sorted(files), where, split)
    builders = {FILE_BUILDERS[f.suffix.lower()] for f in files[split]}
    if len(builders) > 1:
        raise UserError(f"split '{split}' of {where} mixes file formats ({', '.join(sorted(builders))}); keep one")
    try:
        return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files[split]], split="train")
    except datasets.exceptions.DatasetGenerationError as exc:
        raise UserError(f"could not read split '{split}' of {where}: {exc.__cause__ or exc}") from exc


def _load_file(path: Path, split: str) -> datasets.Dataset:
    """A single file is the split its name states (see split_of_name), otherwise "train"."""
    if path.suffix.lower() not in FILE_BUILDERS:
        raise UserError(f"data.path {path}: unsupported file type; use one of {', '.join(FILE_BUILDERS)}")
    return _load_files({split_of_name(path.name) or "train": [path]}, split, str(path))


def _load_folder(folder: Path, split: str) -> datasets.Dataset:
    """Split files anywhere below `folder`, grouped by the split their path states."""
    files: dict[str, list[Path]] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or path.suffix.lower() not in FILE_BUILDERS:
            continue
        if any(part.startswith(".") for part in relative.parts):
            continue
        name_split = split_of_name(str(relative))
        if name_split is not None:
            files.setdefault(name_split, []).append(path)
    if not files:
        raise UserError(
            f"data.path {folder}: no split files found; expected names with train/test/validation "
            f"(e.g. data/train-00000-of-00001.parquet, test.jsonl) of type {', '.join(FILE_BUILDERS)}"
        )
    return _load_files(files, split, str(folder))


def _is_saved(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json"))


def _load_saved(folder: Path, split: str) -> datasets.Dataset:
    """A save_to_disk folder: a DatasetDict, or one Dataset named like a single file."""
    saved = datasets.load_from_disk(str(folder))
    if isinstance(saved, datasets.Dataset):
        saved = datasets.DatasetDict({split_of_name(folder.name) or "train": saved})
    if split not in saved:
        raise _available(list(saved), str(folder), split)
    return saved[split]


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE, as `datasets` read it when imported, or as huggingface_hub reads it."""
    flag = getattr(datasets.config, "HF_HUB_OFFLINE", getattr(datasets.config, "HF_DATASETS_OFFLINE", False))
    return bool(flag) or hub.offline()


def _unreachable(repo_id: str, reason: object) -> UserError:
    cache_hint = "" if _hub_offline() else ", or set HF_HUB_OFFLINE=1 to use a copy already in the datasets cache"
    return UserError(
        f"could not reach dataset '{repo_id}' on the Hugging Face Hub ({reason}); {LOCAL_COPY_HINT}{cache_hint}"
    )


def _load_hub(repo_id: str, split: str) -> datasets.Dataset:
    """A Hub dataset id; all its splits are fetched (GSM8K-zh is a few MB) to list them on error."""
    # hub.probe first: without a network, load_dataset retries for ~25 s before it fails.
    unreachable = None if _hub_offline() else hub.probe(repo_id, DATASET_REPO)
    if unreachable is not None:
        raise _unreachable(repo_id, hub.reason(unreachable)) from unreachable
    try:
        splits = datasets.load_dataset(repo_id)
    except ConnectionError as exc:
        raise _unreachable(repo_id, "HF_HUB_OFFLINE=1 and no cached copy" if _hub_offline() else exc) from exc
    except datasets.exceptions.DatasetNotFoundError as exc:
        raise UserError(f"data.path '{repo_id}': no such local path or Hub dataset; {LOCAL_COPY_HINT}") from exc
    if split not in splits:
        raise _available(list(splits), repo_id, split)
    return splits[split]


def _looks_local(path: str) -> bool:
    """A path the user meant as a file or folder, even though it does not exist."""
    return looks_like_path(path) or Path(path).suffix.lower() in FILE_BUILDERS


# Local source kinds, tried in order; the first whose test accepts the path loads it.
_LOCAL_SOURCES: tuple[tuple[Callable[[Path], bool], Callable[[Path, str], datasets.Dataset]], ...] = (
    (_is_saved, _load_saved),
    (Path.is_dir, _load_folder),
    (Path.is_file, _load_file),
)


def load_split(data_cfg: DataConfig, split: str) -> datasets.Dataset:
    """One split of `data.path`, whatever kind of source it is (see the module docstring)."""
    resolved = resolve_data_path(data_cfg.path)
    path = Path(resolved).expanduser()
    for accepts, load in _LOCAL_SOURCES:
        if accepts(path):
            return load(path, split)
    if _looks_local(resolved):
        raise UserError(f"data.path {resolved}: no such file or folder")
    return _load_hub(resolved, split)


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


def chat_prompt(tokenizer: Any, question: str, system_prompt: str) -> str:
    """The question as the model sees it: system + user turns, then the assistant header."""
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _readable_rows(dataset: datasets.Dataset, data_cfg: DataConfig, stats: PromptStats) -> list[tuple[int, str, str]]:
    """(row index, question, gold) of rows with a question and a readable answer; counts the rest."""
    normalize_gold = answer_check(data_cfg.correctness).normalize_gold
    rows = []
    first_unreadable: tuple[int, Any] | None = None
    for index, (question, answer) in enumerate(zip(dataset[data_cfg.prompt_field], dataset[data_cfg.answer_field])):
        gold = normalize_gold(answer)
        if gold is None:
            stats.dropped_unreadable_answer += 1
            first_unreadable = first_unreadable or (index, answer)
        elif not isinstance(question, str) or not question.strip():
            stats.dropped_empty_question += 1
        else:
            rows.append((index, question, gold))
    if first_unreadable is not None:
        logger.warning(
            "%d rows have an unreadable %s and are dropped (first: row %d, %r)",
            stats.dropped_unreadable_answer, data_cfg.answer_field, *first_unreadable,
        )
    return rows


def build_prompts(
    dataset: datasets.Dataset, tokenizer: Any, data_cfg: DataConfig, split: str
) -> tuple[list[Prompt], PromptStats]:
    """Prompt records for every usable row of `dataset`, in dataset order, and what was dropped."""
    _check_columns(dataset, data_cfg, split)
    where = f"{data_cfg.path} [{split}]"
    if len(dataset) == 0:
        raise UserError(f"split '{split}' of {data_cfg.path} has no rows")
    stats = PromptStats(rows=len(dataset))
    rows = _readable_rows(dataset, data_cfg, stats)
    texts = [chat_prompt(tokenizer, question, data_cfg.system_prompt) for _, question, _ in rows]
    token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prompts = []
    for (index, question, gold), text, ids in zip(rows, texts, token_ids):
        if len(ids) > data_cfg.max_prompt_length:
            stats.dropped_too_long += 1
            continue
        prompts.append(Prompt(f"{split}:{index}", question, gold, text, tuple(ids)))
    stats.kept = len(prompts)
    longest = max(map(len, token_ids), default=0)
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
    if stats.dropped_empty_question:
        hints.append(f"check that data.prompt_field '{data_cfg.prompt_field}' holds the questions")
    if stats.dropped_too_long:
        hints.append(
            f"raise data.max_prompt_length={data_cfg.max_prompt_length} (the longest prompt has {longest} tokens)"
        )
    return UserError(f"no usable prompts in {where}: {stats.summary()}; {'; '.join(hints)}")


def load_prompts(data_cfg: DataConfig, tokenizer: Any, split: str) -> tuple[list[Prompt], PromptStats]:
    """load_split + build_prompts, with the counts logged."""
    prompts, stats = build_prompts(load_split(data_cfg, split), tokenizer, data_cfg, split)
    logger.info("data %s [%s]: %s", data_cfg.path, split, stats.summary())
    return prompts, stats


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
