"""Data loading and prompt building: every source kind, column errors, prompts that keep their
assistant header, a resumable seeded order and a seed-independent eval subset."""

import json
import random
import subprocess
import sys
import textwrap

import datasets
import huggingface_hub
import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from dapo_train.config.schema import DEFAULT_SYSTEM_PROMPT, DataConfig
from dapo_train.errors import UserError
from dapo_train.task import prompts as prompts_module
from dapo_train.task.locations import TINY_MODEL_DIR
from dapo_train.task.prompts import Prompt, PromptSampler, build_prompts, fixed_eval_subset, load_prompts
from dapo_train.task.sources import load_split, split_of_name

ASSISTANT_HEADER = "<|im_start|>assistant\n"

# swulling/gsm8k_chinese's columns. Row 2's answer cannot be read in either answer column;
# row 1's solution uses a thousands separator, row 3's gold is negative.
ROWS = {
    "question": ["What is 2 plus 3?", "How many?", "Unknown?", "Lost 10?"],
    "answer": ["2+3=5\n#### 5", "2000+125=2125\n#### 2,125", "no idea", "0-10=-10\n#### -10"],
    "question_zh-cn": ["2加3等于多少？", "一共有多少个？", "不知道？", "亏了多少？"],
    "answer_only": [5, 2125, None, -10],
}
TEST_ROWS = {key: values[:2] for key, values in ROWS.items()}


@pytest.fixture(autouse=True)
def private_datasets_cache(tmp_path, monkeypatch):
    """Keep the arrow files `datasets` writes for local files out of the user's cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def write_table(rows: dict, path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows).astype({"answer_only": "Int64"})  # nullable ints survive every format
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True, force_ascii=False)


def source_jsonl_file(root):
    write_table(ROWS, root / "gsm8k_zh.jsonl")
    return root / "gsm8k_zh.jsonl"


def source_parquet_file(root):
    write_table(ROWS, root / "rows.parquet")
    return root / "rows.parquet"


def source_csv_file(root):
    write_table(ROWS, root / "rows.csv")
    return root / "rows.csv"


def source_parquet_folder(root):
    """The layout of a clone of swulling/gsm8k_chinese (plus a README that must be ignored)."""
    write_table(ROWS, root / "gsm8k_chinese" / "data" / "train-00000-of-00001.parquet")
    write_table(TEST_ROWS, root / "gsm8k_chinese" / "data" / "test-00000-of-00001.parquet")
    (root / "gsm8k_chinese" / "README.md").write_text("# not data\n")
    return root / "gsm8k_chinese"


def source_jsonl_folder(root):
    write_table(ROWS, root / "tiny" / "train.jsonl")
    write_table(TEST_ROWS, root / "tiny" / "test.jsonl")
    return root / "tiny"


def source_saved_dict(root):
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(ROWS), "test": datasets.Dataset.from_dict(TEST_ROWS)}
    )
    splits.save_to_disk(str(root / "saved"))
    return root / "saved"


SOURCES = [
    source_jsonl_file,
    source_parquet_file,
    source_csv_file,
    source_parquet_folder,
    source_jsonl_folder,
    source_saved_dict,
]
SPLIT_SOURCES = [source_parquet_folder, source_jsonl_folder, source_saved_dict]


@pytest.mark.parametrize("make_source", SOURCES, ids=lambda f: f.__name__)
def test_each_source_kind_loads_the_train_split(tmp_path, make_source):
    dataset = load_split(DataConfig(path=str(make_source(tmp_path))), "train")
    assert set(dataset.column_names) == set(ROWS)
    assert dataset["question_zh-cn"][:] == ROWS["question_zh-cn"]  # all 4 rows, in file order
    assert dataset["answer_only"][:] == ROWS["answer_only"]


@pytest.mark.parametrize("make_source", SPLIT_SOURCES, ids=lambda f: f.__name__)
def test_folders_keep_their_splits_apart(tmp_path, make_source):
    dataset = load_split(DataConfig(path=str(make_source(tmp_path))), "test")
    assert dataset["question"][:] == TEST_ROWS["question"]
    with pytest.raises(UserError, match=r"split 'validation' not found .*; splits: .*test.*train"):
        load_split(DataConfig(path=str(make_source(tmp_path / "again"))), "validation")


def test_single_file_is_train_unless_its_name_says_test(tmp_path):
    write_table(TEST_ROWS, tmp_path / "gsm8k_test.jsonl")
    cfg = DataConfig(path=str(tmp_path / "gsm8k_test.jsonl"))
    assert len(load_split(cfg, "test")) == 2
    with pytest.raises(UserError, match=r"split 'train' not found .*; splits: test \(set data.train_split"):
        load_split(cfg, "train")


@pytest.mark.parametrize(
    "name, split",
    [
        ("data/train-00000-of-00001.parquet", "train"),
        ("gsm8k_test.jsonl", "test"),
        ("dev.csv", "validation"),
        ("validation/part-0.parquet", "validation"),
        ("train/test_part.jsonl", "test"),  # the file name wins over its folder
        ("latest.jsonl", None),  # "test" inside a longer word is not a split name
        ("trainset.jsonl", None),
        ("data/rows.parquet", None),
    ],
)
def test_split_of_name(name, split):
    assert split_of_name(name) == split


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_DATASETS_CACHE"])
def test_an_unusable_datasets_cache_is_named_not_the_data(tmp_path, monkeypatch, variable):
    """Issue 52, item 14: HF_HOME (or HF_DATASETS_CACHE) below a file: `datasets` cannot make its cache, and
    the error blamed the shipped demo data ("could not read split 'train' of .../assets/tiny/data"). It names
    the setting, its value and the cache folder instead."""
    (tmp_path / "afile").write_text("")
    value = tmp_path / "afile" / "hf"
    cache = value / "datasets" if variable == "HF_HOME" else value
    for name in ("HF_HOME", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))  # as datasets reads it when imported
    with pytest.raises(UserError) as raised:
        load_split(DataConfig(path="builtin:tiny-zh-math"), "train")
    problem = f"NotADirectoryError: Not a directory: {value}"
    assert str(raised.value) == (
        f"HF_HOME={value} cannot hold the datasets cache {cache} ({problem}); point HF_HOME at a writable folder "
        f"(or HF_DATASETS_CACHE at one, for datasets alone); the data was not read" if variable == "HF_HOME" else
        f"HF_DATASETS_CACHE={value}, the datasets cache, cannot be used ({problem}); point it at a writable folder; "
        f"the data was not read")


def test_a_missing_local_path_is_reported_as_such(tmp_path):
    with pytest.raises(UserError, match="no such file or folder"):
        load_split(DataConfig(path=str(tmp_path / "gsm8k_chinese")), "train")


def test_a_data_path_that_is_neither_file_nor_folder_says_what_it_is():
    """Issue 49, point 4: /dev/null exists, so "no such file or folder" was wrong."""
    with pytest.raises(UserError, match="data.path /dev/null is not a file or folder but a character device"):
        load_split(DataConfig(path="/dev/null"), "train")


def test_a_folder_without_split_files_says_what_names_it_expects(tmp_path):
    write_table(ROWS, tmp_path / "rows.jsonl")
    with pytest.raises(UserError, match="no split files found; expected names with train/test/validation"):
        load_split(DataConfig(path=str(tmp_path)), "train")


def test_a_split_file_of_a_type_not_read_is_named(tmp_path):
    """Issue 59 item 15: a folder holding only train.jsonl.gz said "no split files found", as if it were empty."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl.gz").write_bytes(b"\x1f\x8b")
    with pytest.raises(UserError, match=r"no split files found;.*; it holds data/train.jsonl.gz, which is not read: "
                                        r"decompress it \(gunzip\) or convert it to one of .parquet, .jsonl"):
        load_split(DataConfig(path=str(tmp_path)), "train")
    write_table(ROWS, tmp_path / "train.jsonl")  # the train split is there; the test split is only compressed
    (tmp_path / "test.csv.xz").write_bytes(b"\xfd7zXZ")
    with pytest.raises(UserError, match=r"split 'test' not found in .*; splits: train .*; it holds test.csv.xz, "
                                        r"which is not read: decompress it \(unxz\)"):
        load_split(DataConfig(path=str(tmp_path)), "test")


def test_a_truncated_json_lines_row_names_its_file_and_line(tmp_path):
    rows = [{"q": "1+1=?", "a": 2}, {"q": "2+2=?", "a": 4}]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:-6] + "\n")  # cut mid-row, as a kill leaves it
    with pytest.raises(UserError, match=rf"could not read split 'train' of {path}: {path}:2: not valid JSON"):
        load_split(DataConfig(path=str(path)), "train")


def test_a_csv_quote_never_closed_is_found_not_merged(tmp_path):
    """pandas reads the quoted 1+1 up to the next quote, two lines on, as one question: one row where
    the file has three. Python's strict csv reader sees the quote end off a field boundary."""
    path = tmp_path / "train.csv"
    path.write_text('q,a\n"1+1=?,2\n2+2=?,4\n"3+3=?",6\n')
    with pytest.raises(UserError, match=rf"{path}:2: ',' expected after '\"' in the row that starts here; is a quote "
                                        "never closed"):
        load_split(DataConfig(path=str(path)), "train")
    path.write_text("q,a\n1+1=?,2\n2+2=?\n")  # a field short: pandas would fill it with NaN
    with pytest.raises(UserError, match=rf"{path}:3: a row of 1 fields, the header has 2"):
        load_split(DataConfig(path=str(path)), "train")
    # A quoted field that spans lines is legal CSV (GSM8K solutions do): it still loads, row for row.
    write_table(ROWS, path)
    assert load_split(DataConfig(path=str(path)), "train")["answer"][:] == ROWS["answer"]


@pytest.mark.parametrize("key", ["prompt_field", "answer_field"])
def test_a_missing_column_lists_the_columns_that_exist(tmp_path, tokenizer, key):
    path = source_jsonl_file(tmp_path)
    cfg = DataConfig(path=str(path), **{key: "question_zh"})
    with pytest.raises(UserError) as error:
        load_prompts(cfg, tokenizer, "train")
    assert str(error.value) == (
        f"data.{key} 'question_zh' is not a column of {path} [train]; "
        "columns: question, answer, question_zh-cn, answer_only"
    )


@pytest.mark.parametrize("answer_field", ["answer_only", "answer"])
def test_gold_answers_are_canonical_and_unreadable_rows_are_counted(tmp_path, tokenizer, answer_field):
    cfg = DataConfig(path=str(source_parquet_folder(tmp_path)), answer_field=answer_field, max_prompt_length=10_000)
    prompts, stats = load_prompts(cfg, tokenizer, "train")
    # Row 2 ("no idea" / null) is dropped; "#### 2,125" reads as 2125 and the row index stays in the uid.
    assert [(p.uid, p.gold) for p in prompts] == [("train:0", "5"), ("train:1", "2125"), ("train:3", "-10")]
    assert (stats.rows, stats.kept, stats.dropped_unreadable_answer, stats.dropped_too_long) == (4, 3, 1, 0)
    assert [p.question for p in prompts] == ["2加3等于多少？", "一共有多少个？", "亏了多少？"]


def test_golds_that_are_not_one_number_and_questions_that_are_not_text_are_counted_as_such(tokenizer, caplog):
    """Issue 59 items 10 and 15: "1e3" trained as 3, "0x10" as 10 and "5 apples and 3 pears" as 3, with 0
    unreadable in the data line; a question that is a number or an object was counted as an empty question."""
    rows = datasets.Dataset.from_dict({
        "question_zh-cn": ["一？", "二？", "三？", "四？", "", "   ", "七？"],
        "answer_only": ["1e3", "0x10", "5 apples and 3 pears", "#### 1,000", "2", "3", "4"],
    })
    prompts, stats = build_prompts(rows, tokenizer, DataConfig(max_prompt_length=10_000), "train")
    assert [(p.uid, p.gold) for p in prompts] == [("train:3", "1000"), ("train:6", "4")]
    assert (stats.dropped_unreadable_answer, stats.dropped_empty_question, stats.dropped_question_not_text) == (3, 2, 0)
    assert "3 rows have an unreadable answer_only and are dropped (first: row 0, '1e3')" in caplog.text
    assert stats.summary() == ("7 rows, 2 prompts kept; dropped: 3 unreadable answer, 0 too long, 2 empty question, "
                               "0 question not text")
    odd = datasets.Dataset.from_dict({"question_zh-cn": ['{"a": 1}', "六？"], "answer_only": ["1", "2"]})  # text
    assert build_prompts(odd, tokenizer, DataConfig(max_prompt_length=10_000), "train")[1].kept == 2
    for questions in ([7, 8, 9], [{"x": 1}, {"x": 2}, {"x": 3}]):  # one type per column, as arrow stores it
        not_text = datasets.Dataset.from_dict({"question_zh-cn": questions, "answer_only": ["1", "2", "3"]})
        with pytest.raises(UserError, match=r"3 rows, 0 prompts kept; dropped: 0 unreadable answer, 0 too long, "
                                            r"0 empty question, 3 question not text; check that data.prompt_field "
                                            r"'question_zh-cn' holds the questions, as text$"):
            build_prompts(not_text, tokenizer, DataConfig(max_prompt_length=10_000), "train")
        assert f"3 rows have a question_zh-cn that is not text and are dropped (first: row 0, {questions[0]!r})" \
            in caplog.text


def test_prompts_are_chat_templated_and_tokenized_without_extra_special_tokens(tmp_path, tokenizer):
    cfg = DataConfig(path=str(source_jsonl_file(tmp_path)), max_prompt_length=10_000)
    prompts, _ = load_prompts(cfg, tokenizer, "train")
    for prompt in prompts:
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": prompt.question}],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert prompt.text == expected
        assert prompt.text.endswith(ASSISTANT_HEADER)
        # No second BOS or similar: the ids are exactly the template's text, special tokens included.
        assert list(prompt.input_ids) == tokenizer(prompt.text, add_special_tokens=False)["input_ids"]
    without_system, _ = load_prompts(
        DataConfig(path=cfg.path, system_prompt="", max_prompt_length=10_000), tokenizer, "train"
    )
    assert all(DEFAULT_SYSTEM_PROMPT not in p.text and p.question in p.text for p in without_system)


def test_a_long_prompt_is_dropped_and_no_prompt_loses_its_assistant_header(tmp_path, tokenizer):
    rows = {key: list(values) for key, values in ROWS.items()}
    rows["question_zh-cn"][0] = "小明有很多苹果。" * 60  # far past the limit below
    write_table(rows, tmp_path / "rows.jsonl")
    cfg = DataConfig(path=str(tmp_path / "rows.jsonl"), max_prompt_length=10_000)
    lengths = {p.uid: len(p.input_ids) for p in load_prompts(cfg, tokenizer, "train")[0]}
    # A limit between the long prompt and the longest short one keeps exactly the short ones.
    limit = max(length for uid, length in lengths.items() if uid != "train:0")
    assert lengths["train:0"] > limit
    prompts, stats = load_prompts(DataConfig(path=cfg.path, max_prompt_length=limit), tokenizer, "train")
    assert [p.uid for p in prompts] == ["train:1", "train:3"]
    assert (stats.kept, stats.dropped_too_long, stats.dropped_unreadable_answer) == (2, 1, 1)
    assert all(p.text.endswith(ASSISTANT_HEADER) and len(p.input_ids) == lengths[p.uid] for p in prompts)
    assert all(tokenizer.decode(p.input_ids).endswith(ASSISTANT_HEADER) for p in prompts)


def test_nothing_left_is_an_error_that_says_why(tmp_path, tokenizer):
    cfg = DataConfig(path=str(source_jsonl_file(tmp_path)), max_prompt_length=1)
    with pytest.raises(
        UserError,
        match=r"no usable prompts .*3 too long.*raise data.max_prompt_length=1 \(the longest prompt has \d+ tokens\)",
    ):
        load_prompts(cfg, tokenizer, "train")
    unreadable = datasets.Dataset.from_dict({"question_zh-cn": ["几个？", "多少？"], "answer_only": ["?", None]})
    with pytest.raises(
        UserError,
        match=r"2 unreadable answer.*; check that data.answer_field 'answer_only' holds numbers or '#### N' solutions$",
    ):
        build_prompts(unreadable, tokenizer, cfg, "train")
    empty = datasets.Dataset.from_dict({key: [] for key in ROWS})
    with pytest.raises(UserError, match="split 'train' of .* has no rows"):
        build_prompts(empty, tokenizer, cfg, "train")


def test_the_builtin_task_loads_with_the_default_columns(tokenizer):
    prompts, stats = load_prompts(DataConfig(), tokenizer, "train")
    assert stats.kept == len(prompts) > 0
    assert all(p.text.endswith(ASSISTANT_HEADER) for p in prompts)


# --------------------------------------------------------------------------------------------
# Hub ids without a network: a clear error within seconds, never a hang.


def test_hub_id_in_offline_mode_fails_fast_with_a_local_copy_hint(tmp_path):
    # A fresh interpreter: datasets and huggingface_hub read HF_HUB_OFFLINE when imported.
    script = textwrap.dedent(
        """
        import time
        from dapo_train.config.schema import DataConfig
        from dapo_train.task.sources import load_split
        from dapo_train.errors import UserError
        start = time.perf_counter()
        try:
            load_split(DataConfig(path="nobody-dapo/made-up-dataset"), "train")
        except UserError as error:
            print(f"{time.perf_counter() - start:.2f}|{error}")
        """
    )
    env = {"PATH": "", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    seconds, _, message = done.stdout.strip().partition("|")
    assert message, done.stderr[-2000:]
    assert float(seconds) < 10.0
    assert (
        "could not reach dataset 'nobody-dapo/made-up-dataset' on the Hugging Face Hub "
        "(HF_HUB_OFFLINE=1 and no cached copy)" in message
    )
    assert "set data.path to a local folder or file (e.g. ./gsm8k_chinese with data/train-*.parquet)" in message


def test_hub_id_without_network_fails_on_the_probe_before_load_dataset(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_network(repo_id, timeout):
        raise ConnectionError("Name or service not known")

    def must_not_run(*args, **kwargs):
        raise AssertionError("load_dataset retries for ~25 s without a network; the probe must stop first")

    monkeypatch.setattr(huggingface_hub, "dataset_info", no_network)
    monkeypatch.setattr(prompts_module.datasets, "load_dataset", must_not_run)
    with pytest.raises(
        UserError,
        match=r"could not reach dataset 'swulling/gsm8k_chinese' .*Name or service not known.*HF_HUB_OFFLINE=1",
    ):
        load_split(DataConfig(path="swulling/gsm8k_chinese"), "train")


# --------------------------------------------------------------------------------------------
# Order: seeded, resumable, independent of global RNG; the eval subset is fixed.


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(f"train:{i}", f"q{i}", str(i), f"text{i}", (i,)) for i in range(n)]


def uids(prompts: list[Prompt]) -> list[str]:
    return [p.uid for p in prompts]


def test_sampler_order_is_a_function_of_the_seed_only():
    prompts = make_prompts(20)
    first = PromptSampler(prompts, seed=7)
    a = [uids(first.next_batch(6)) for _ in range(7)]  # 42 prompts: two epochs and a bit
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # global RNG state must not matter
    second = PromptSampler(prompts, seed=7)
    np.random.rand(5), torch.rand(5)
    b = [uids(second.next_batch(6)) for _ in range(7)]
    assert a == b
    flat = sum(a, [])
    assert sorted(flat[:20]) == sorted(uids(prompts)) == sorted(flat[20:40])  # each epoch is a permutation
    assert flat[:20] != flat[20:40]  # a new permutation every epoch
    other = PromptSampler(prompts, seed=8)
    assert uids(other.next_batch(20)) != flat[:20]


def test_sampler_resumes_with_exactly_the_same_prompts():
    prompts = make_prompts(9)
    uninterrupted = PromptSampler(prompts, seed=3)
    expected = [uids(uninterrupted.next_batch(4)) for _ in range(6)]
    interrupted = PromptSampler(prompts, seed=3)
    head = [uids(interrupted.next_batch(4)) for _ in range(3)]  # stops mid-epoch 1 (12 of 18 prompts)
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state == {"epoch": 1, "position": 3, "num_prompts": 9}  # 12 prompts = one epoch of 9 + 3
    resumed = PromptSampler(prompts, seed=3)
    resumed.load_state_dict(state)
    assert head + [uids(resumed.next_batch(4)) for _ in range(3)] == expected
    with pytest.raises(UserError, match="checkpoint saw 9 prompts, this run has 8"):
        PromptSampler(make_prompts(8), seed=3).load_state_dict(state)


def test_eval_subset_is_fixed_whatever_the_order_or_size():
    prompts = make_prompts(50)
    subset = fixed_eval_subset(prompts, 10)
    assert len(subset) == 10
    assert uids(subset) == sorted(uids(subset), key=lambda uid: int(uid.split(":")[1]))  # dataset order
    shuffled = random.Random(0).sample(prompts, len(prompts))
    assert set(uids(fixed_eval_subset(shuffled, 10))) == set(uids(subset))
    assert set(uids(subset)) < set(uids(fixed_eval_subset(prompts, 20)))  # smaller n: a subset
    assert uids(subset) != uids(prompts[:10])  # spread over the split, not its head
    assert fixed_eval_subset(prompts, 0) == prompts == fixed_eval_subset(prompts, 50)
