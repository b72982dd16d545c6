"""`data.path` -> one datasets.Dataset per split: a Hugging Face dataset id, a local folder (a
`save_to_disk` output, or parquet/jsonl/json/csv files whose names say their split), a single such
file, or `builtin:tiny-zh-math`. Everything goes through `datasets`.

A file `datasets` cannot read is one UserError naming the file and, where it can be found, the line
(a JSON line that does not parse, a CSV quote never closed). A CSV is also read again with Python's
strict csv reader, because an unterminated quote makes pandas merge the rows up to the next quote
without a word: a quote that ends off a field boundary, a row with too many or too few fields, or a
row count that differs is an error. A quoted field that spans lines and closes exactly at a field
boundary is legal CSV, so rows swallowed that way cannot be told apart (docs/rewards-and-tasks.md: Data files).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import datasets
import pyarrow

from dapo_train.config.schema import DataConfig
from dapo_train.errors import UserError, special_file
from dapo_train.task import locations
from dapo_train.task.locations import looks_like_path, resolve_data_path

# File suffix -> the `datasets` builder that reads it.
FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# Canonical split name -> words that name it inside a file or folder name.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "test": ("test", "testing"),
    "validation": ("validation", "valid", "val", "dev"),
}
LOCAL_COPY_HINT = "set data.path to a local folder or file (e.g. ./gsm8k_chinese with data/train-*.parquet)"
DATASET_REPO = locations.RepoKind("dataset", "data.path", local="path", existing="file or folder", hint=LOCAL_COPY_HINT)
# What `datasets` raises for a file it cannot read (pyarrow's parse errors, pandas' ValueError, an
# empty file's StopIteration, a damaged save_to_disk folder).
READ_ERRORS = (datasets.exceptions.DatasetsError, pyarrow.ArrowException, ValueError, OSError, StopIteration, KeyError)

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


def _available(splits: list[str], where: str, split: str, note: str = "") -> UserError:
    return UserError(
        f"split '{split}' not found in {where}; splits: {', '.join(splits) or 'none'} "
        "(set data.train_split / data.eval_split to one of them; the eval split is read when eval.every_steps > 0 "
        f"or eval.final_full is on){note}"
    )


# A compressed file's suffix -> the command that decompresses it.
DECOMPRESS = {".gz": "gunzip", ".bz2": "bunzip2", ".xz": "unxz", ".zst": "unzstd", ".zip": "unzip"}


def _unread_note(paths: list[Path], folder: Path) -> str:
    """'; it holds <file>, which is not read: ...' for split files of a type no builder reads (train.jsonl.gz):
    the folder is not empty of data, it holds data in a form to change."""
    if not paths:
        return ""
    shown = ", ".join(str(path.relative_to(folder)) for path in paths[:3]) + (" ..." if len(paths) > 3 else "")
    tool = DECOMPRESS.get(paths[0].suffix.lower())
    fix = f"decompress it ({tool}) or convert it" if tool else "convert it"
    return f"; it holds {shown}, which is not read: {fix} to one of {', '.join(FILE_BUILDERS)}"


def _load_files(files: dict[str, list[Path]], split: str, where: str, note: str = "") -> datasets.Dataset:
    """Read one split's files with the builder their suffix names (all must share one); note: what the error
    of a missing split adds (_unread_note)."""
    if split not in files:
        raise _available(sorted(files), where, split, note)
    builders = {FILE_BUILDERS[f.suffix.lower()] for f in files[split]}
    if len(builders) > 1:
        raise UserError(f"split '{split}' of {where} mixes file formats ({', '.join(sorted(builders))}); keep one")
    paths, builder = files[split], builders.pop()
    for path in paths:
        problem = _empty_or_not_text(path, text=builder in LINE_CHECKS)
        if problem:
            raise UserError(f"could not read split '{split}' of {where}: {problem}")
    try:
        with _quiet_builders(), _datasets_cache():
            dataset = datasets.load_dataset(builder, data_files=[str(f) for f in paths], split="train")
    except READ_ERRORS as exc:
        raise UserError(f"could not read split '{split}' of {where}: {_diagnose(paths, builder, exc)}") from exc
    if builder == "csv":
        _check_csv(paths, len(dataset), f"split '{split}' of {where}")
    return dataset


def _load_file(path: Path, split: str) -> datasets.Dataset:
    """A single file is the split its name states (see split_of_name), otherwise "train"."""
    if path.suffix.lower() not in FILE_BUILDERS:
        raise UserError(f"data.path {path}: unsupported file type; use one of {', '.join(FILE_BUILDERS)}")
    return _load_files({split_of_name(path.name) or "train": [path]}, split, str(path))


def _load_folder(folder: Path, split: str) -> datasets.Dataset:
    """Split files anywhere below `folder`, grouped by the split their path states; split files of a type no
    builder reads (train.jsonl.gz) are named in the error of a split that is missing."""
    files: dict[str, list[Path]] = {}
    unread: dict[str, list[Path]] = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        name_split = split_of_name(str(relative))
        if name_split is not None:
            found = files if path.suffix.lower() in FILE_BUILDERS else unread
            found.setdefault(name_split, []).append(path)
    if not files:
        raise UserError(
            f"data.path {folder}: no split files found; expected names with train/test/validation "
            f"(e.g. data/train-00000-of-00001.parquet, test.jsonl) of type {', '.join(FILE_BUILDERS)}"
            + _unread_note([path for paths in unread.values() for path in paths], folder)
        )
    return _load_files(files, split, str(folder), _unread_note(unread.get(split, []), folder))


def _is_saved(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in ("dataset_dict.json", "state.json"))


def _load_saved(folder: Path, split: str) -> datasets.Dataset:
    """A save_to_disk folder: a DatasetDict, or one Dataset named like a single file."""
    try:
        saved = datasets.load_from_disk(str(folder))
    except READ_ERRORS as exc:
        raise UserError(f"data.path {folder}: could not read this save_to_disk folder: {_first_line(exc)}") from exc
    if isinstance(saved, datasets.Dataset):
        saved = datasets.DatasetDict({split_of_name(folder.name) or "train": saved})
    if split not in saved:
        raise _available(list(saved), str(folder), split)
    return saved[split]


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE, as `datasets` read it when imported, or as huggingface_hub reads it."""
    flag = getattr(datasets.config, "HF_HUB_OFFLINE", getattr(datasets.config, "HF_DATASETS_OFFLINE", False))
    return bool(flag) or locations.offline()


def _unreachable(repo_id: str, reason: object) -> UserError:
    cache_hint = "" if _hub_offline() else ", or set HF_HUB_OFFLINE=1 to use a copy already in the datasets cache"
    return UserError(
        f"could not reach dataset '{repo_id}' on the Hugging Face Hub ({reason}); {LOCAL_COPY_HINT}{cache_hint}"
    )


def _load_hub(repo_id: str, split: str) -> datasets.Dataset:
    """A Hub dataset id; all its splits are fetched (GSM8K-zh is a few MB) to list them on error."""
    # locations.probe first: without a network, load_dataset retries for ~25 s before it fails.
    unreachable = None if _hub_offline() else locations.probe(repo_id, DATASET_REPO)
    if unreachable is not None:
        raise _unreachable(repo_id, locations.reason(unreachable)) from unreachable
    try:
        with _datasets_cache():
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
    if (kind := special_file(path)) is not None:
        raise UserError(f"data.path {resolved} is not a file or folder but {kind}; give a data file or folder")
    if _looks_local(resolved):
        raise UserError(f"data.path {resolved}: no such file or folder")
    return _load_hub(resolved, split)


# --------------------------------------------------------------------------------------------
# Reading files: one line for what datasets cannot read, and the checks of what it read.


@contextlib.contextmanager
def _quiet_builders():
    """The file builders log their parse error before raising it; the UserError made of it says it once."""
    builders = logging.getLogger("datasets.packaged_modules")
    level = builders.level
    builders.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        builders.setLevel(level)


@contextlib.contextmanager
def _datasets_cache():
    """An OSError on the folder `datasets` caches in (HF_HOME's datasets/, or HF_DATASETS_CACHE) is the
    cache's: one UserError naming the setting and the folder, not the data it was reading."""
    try:
        yield
    except OSError as exc:
        problem = _cache_problem(exc)
        if problem is None:
            raise
        raise UserError(problem) from exc


def _cache_problem(exc: BaseException) -> str | None:
    """What is wrong with the datasets cache when `exc` (or an error it was raised from) failed on the cache
    folder, a folder above it or a path inside it; None when the failure is not the cache's."""
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    while exc is not None:
        failed = Path(exc.filename) if isinstance(exc, OSError) and exc.filename else None
        if failed is not None and (failed == cache or failed in cache.parents or cache in failed.parents):
            problem = f"{type(exc).__name__}: {exc.strerror}: {failed}"
            fix = "the data was not read"
            if os.environ.get("HF_DATASETS_CACHE"):
                return (f"HF_DATASETS_CACHE={os.environ['HF_DATASETS_CACHE']}, the datasets cache, cannot be used "
                        f"({problem}); point it at a writable folder; {fix}")
            home = f"HF_HOME={os.environ['HF_HOME']}" if os.environ.get("HF_HOME") else "the Hugging Face cache home"
            return (f"{home} cannot hold the datasets cache {cache} ({problem}); point HF_HOME at a writable folder "
                    f"(or HF_DATASETS_CACHE at one, for datasets alone); {fix}")
        exc = exc.__cause__ or exc.__context__
    return None


def _first_line(exc: BaseException) -> str:
    """What the library said, in one line: the cause datasets wraps, else the error itself."""
    cause = exc.__cause__ or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0][:300]}" if text else type(cause).__name__


def _empty_or_not_text(path: Path, text: bool) -> str | None:
    """'<path> is empty', or for a text format the first bytes that are not UTF-8 with their line:
    pyarrow keeps such bytes in the column, and reading the row fails much later."""
    size = path.stat().st_size
    if size == 0 or (size < 4096 and not path.read_bytes().strip()):
        return f"{path} is empty"
    if not text:
        return None
    decoder, line, offset = codecs.getincrementaldecoder("utf-8")(), 1, 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line += chunk.count(b"\n", 0, max(exc.start, 0))
                return f"{path}:{line}: not UTF-8 text (byte {offset + max(exc.start, 0)}: {exc.reason})"
            line, offset = line + chunk.count(b"\n"), offset + len(chunk)
    return None


def _json_lines(path: Path) -> tuple[str | None, int]:
    """(the first problem of a .jsonl / .json file with its line, or None; rows read): every non-blank
    line one JSON object, or the whole file one JSON array of objects."""
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})", 0
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        return (None if bad is None else f"{path}: item {bad} of its JSON array is not an object (a row)"), len(rows)
    count = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"{path}:{number}: not valid JSON ({exc.msg}); JSON Lines hold one object per line", count
        if not isinstance(row, dict):
            return f"{path}:{number}: a JSON {type(row).__name__}, where each line must be one object (a row)", count
        count += 1
    return None, count


def _csv_records(path: Path) -> tuple[str | None, int]:
    """(the first problem of a CSV file with its line, or None; data rows read), read with Python's
    strict csv reader: a quote that ends off a field boundary, or a row whose field count is not the
    header's, is a problem (pandas would merge the rows, or fill the missing fields with NaN)."""
    rows = 0
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, [])
            start = reader.line_num + 1
            for record in reader:
                if record and len(record) != len(header):
                    return f"{path}:{start}: a row of {len(record)} fields, the header has {len(header)}", rows
                rows += bool(record)
                start = reader.line_num + 1
    except csv.Error as exc:
        return f"{path}:{start}: {exc} in the row that starts here; is a quote never closed?", rows
    return None, rows


def _parquet_rows(path: Path) -> tuple[str | None, int]:
    """(None, rows in the parquet file's footer); a footer that cannot be read counts as one row, so
    that the library's own message about the file stands."""
    import pyarrow.parquet

    try:
        return None, pyarrow.parquet.ParquetFile(path).metadata.num_rows
    except (pyarrow.ArrowException, OSError):
        return None, 1


LINE_CHECKS: dict[str, Callable[[Path], tuple[str | None, int]]] = {"json": _json_lines, "csv": _csv_records}
# What _diagnose asks of a file datasets could not read: its first bad line, or its row count.
ROW_CHECKS = {**LINE_CHECKS, "parquet": _parquet_rows}


def _diagnose(paths: list[Path], builder: str, exc: BaseException) -> str:
    """Why `datasets` could not read these files: the first bad line where a line check finds one, a
    file without rows (pyarrow says "BatchSize must be greater than 0" of a 0-row parquet), else what
    the library said."""
    check = ROW_CHECKS.get(builder)
    for path in paths if check else ():
        problem, rows = check(path)
        if problem or not rows:
            return problem or f"{path} holds no rows"
    return _first_line(exc)


def _check_csv(paths: list[Path], loaded: int, where: str) -> None:
    """A CSV datasets read without complaint must also read cleanly, with as many rows, line by line."""
    total = 0
    for path in paths:
        problem, rows = _csv_records(path)
        if problem:
            raise UserError(f"could not read {where}: {problem}")
        total += rows
    if total != loaded:
        raise UserError(
            f"could not read {where}: Python's csv reader finds {total} rows, datasets {loaded}; check its quotes"
        )
