"""The long embedded task (builtin:tiny-zh-math-long) and its warm start (builtin:tiny-long): the
generated problems are right, their written-out solutions are cut by the config's budget while
their concise forms fit, the shipped files are what the build makes, and the config truncates."""

import hashlib
import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dapo_train.config.load import load_config
from dapo_train.errors import UserError
from dapo_train.model.loading import load_tokenizer
from dapo_train.run.logs import read_metrics
from dapo_train.task.locations import (
    TINY_LONG_DATA_DIR,
    TINY_LONG_MODEL_DIR,
    TINY_MODEL_DIR,
    resolve_data_path,
    resolve_model_path,
)
from dapo_train.task.prompts import load_prompts

from conftest import assert_shipped_data, assert_worked_solutions
from tiny_task import concise
from tiny_task_long import MAX_RESULT, make_long_splits

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny-long-cpu.yaml"
LINE_RE = re.compile(r"^[^：，]+：(?:[^\n]+，)?(\d+) ([-+×÷]) (\d+) = (\d+)$")


@pytest.fixture(scope="module")
def splits():
    return make_long_splits(0)


# ----------------------------------------------------------------------------- the task
def test_shipped_long_data_is_what_the_generator_makes(splits):
    assert (len(splits["train"]), len(splits["test"])) == (4000, 500)
    assert not {r["question_zh-cn"] for r in splits["train"]} & {r["question_zh-cn"] for r in splits["test"]}
    assert_shipped_data(splits, TINY_LONG_DATA_DIR, "python scripts/build/make_tiny_model.py --recipe tiny-long")


def test_every_worked_step_is_exact_and_the_last_is_the_answer(splits):
    assert_worked_solutions(splits["train"] + splits["test"], LINE_RE, range(3, 7), MAX_RESULT)


def _solve(question: str) -> int:
    """The answer read from the question text alone, clause by clause, not from the worked steps.

    Amounts by person (the first one's moves with gains and losses); a bill of price x count per
    item; the question asks for one amount, the total, a share, a box count or the change.
    """
    body, ask = question.split("。")
    have: dict[str, int] = {}
    first = price = count = paid = None
    bill = 0
    clauses = body.split("，")
    for before, clause in zip(["", *clauses], clauses):
        n = int(re.search(r"\d+", clause)[0])
        if m := re.fullmatch(r"一\D+ \d+ 元", clause):  # the first item's price; its count follows
            price = n
        elif re.fullmatch(r"一\D+ \d+ 元", before):
            bill += price * n
        elif m := re.fullmatch(r"每\D+ \d+ 元", clause):  # a later item's price; its count came before
            bill += count * n
        elif re.fullmatch(r"又买了 \d+ \D+", clause) and price is not None:
            count = n
        elif m := re.fullmatch(r"(\D+?)付了 \d+ 元", clause):
            paid = n
        elif re.fullmatch(r"(?:然后)?(?:又买了|又捡到了|\D+?又送来) \d+ \D+", clause):
            have[first] += n
        elif re.fullmatch(r"(?:然后)?(?:送给\D+?|用掉了|卖掉了|弄丢了) \d+ \D+", clause):
            have[first] -= n
        elif re.fullmatch(r"每\D有 \d+ \D+", clause):  # ... each box holding n
            have[first] *= n
        elif m := re.fullmatch(r"(\D+?)(?:有|买了) \d+ \D+", clause):  # a start: an amount, or boxes
            have[m[1]] = n
            first = first or m[1]
        elif m := re.fullmatch(r"(\D+?)比(\D+?)(多|少) \d+ \D+", clause):
            have[m[1]] = have[m[2]] + (n if m[3] == "多" else -n)
        elif m := re.fullmatch(r"(\D+?)的\D+是(\D+?)的 \d+ 倍", clause):
            if m[1] in have:  # A has n times as many as B, and A is known: B = A / n
                have[m[2]] = have[m[1]] // n
            else:
                have[m[1]] = have[m[2]] * n
        else:
            raise AssertionError(f"unread clause {clause!r} of {question}")
    if paid is not None:
        return paid - bill
    if price is not None:
        return bill
    if m := re.search(r"(?:平均分给|每) (\d+) ", ask):
        return have[first] // int(m[1])
    if "一共有多少" in ask:
        return sum(have.values())
    return have[re.match(r"(\D+?)(?:现在)?有多少", ask)[1]]


def test_gold_answers_agree_with_the_question_read_independently(splits):
    # The reader itself, on problems worked by hand:
    story = "小东买了 4 盒蜡笔，每盒有 6 支，用掉了 7 支，然后又捡到了 1 支。小东现在有多少支蜡笔？"
    assert _solve(story) == 18  # 4 x 6 - 7 + 1
    shop = "一颗弹珠 5 元，爸爸买了 3 颗，又买了 5 支蜡笔，每支 2 元，爸爸付了 50 元。应找回多少元？"
    assert _solve(shop) == 25  # 50 - (5 x 3 + 5 x 2)
    chain = "小东有 15 本书，小东的书是小丽的 3 倍，小兰比小丽多 3 本。小东、小丽和小兰一共有多少本书？"
    assert _solve(chain) == 28  # 15 + 15 / 3 + (5 + 3)
    for row in splits["train"] + splits["test"]:
        assert _solve(row["question_zh-cn"]) == row["answer_only"], row


def test_concise_keeps_the_label_and_the_sum_of_each_line():
    answer = "买后：小明有 15 个，又买了 4 个，15 + 4 = 19\n每人：把 19 个平均分给 1 个同学，19 ÷ 1 = 19\n#### 19"
    assert concise(answer) == "买后：15 + 4 = 19\n每人：19 ÷ 1 = 19\n#### 19"
    assert concise("买后：15 + 4 = 19\n#### 19") == "买后：15 + 4 = 19\n#### 19"  # already concise: unchanged


def test_the_budget_cuts_long_written_out_solutions_and_every_concise_one_fits(splits, build):
    """The point of the task: at the config's rollout.max_new_tokens, written-out solutions of five
    and six steps never fit (and most of four), their concise forms always do; prompt + budget fit
    the model's 512 positions and data.max_prompt_length."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_LONG_MODEL_DIR)
    cfg = load_config(str(CONFIG), [])
    budget = cfg.rollout.max_new_tokens
    assert budget == build.LONG_MAX_NEW_TOKENS

    def tokens(answer: str) -> int:  # the SFT target with its <|im_end|>: what a completion holds
        return len(tokenizer.encode(build.target_text(answer))) + 1

    cut = {n: [] for n in range(3, 7)}
    for row in splits["test"]:
        cut[row["answer"].count("\n")].append(tokens(row["answer"]) > budget)
        assert tokens(concise(row["answer"])) <= budget, row
        prompt = len(tokenizer.encode(build.prompt_text(tokenizer, row["question_zh-cn"])))
        assert prompt <= cfg.data.max_prompt_length and prompt + budget <= 512
    assert all(cut[5]) and all(cut[6]) and sum(cut[4]) > len(cut[4]) / 2 and not any(cut[3])


# ----------------------------------------------------------------------------- the shipped model
def test_builtin_names_resolve_load_and_unknown_ones_fail_in_one_line():
    assert resolve_model_path("builtin:tiny-long") == str(TINY_LONG_MODEL_DIR)
    assert resolve_data_path("builtin:tiny-zh-math-long") == str(TINY_LONG_DATA_DIR)
    cfg = load_config(str(CONFIG), [])
    assert (cfg.model.name_or_path, cfg.data.path) == ("builtin:tiny-long", "builtin:tiny-zh-math-long")
    tokenizer = load_tokenizer(cfg.model)
    prompts, stats = load_prompts(cfg.data, tokenizer, "test")
    assert len(prompts) == stats.rows == 500
    with pytest.raises(UserError, match="model.name_or_path: no shipped 'builtin:tiny-lng'.*builtin:tiny-long"):
        resolve_model_path("builtin:tiny-lng")
    with pytest.raises(UserError, match="data.path: no shipped"):
        resolve_data_path("builtin:tiny-zh-math-lng")


def test_the_long_model_keeps_the_tiny_tokenizer_which_has_every_character_of_the_task(splits):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (TINY_LONG_MODEL_DIR / name).read_bytes() == (TINY_MODEL_DIR / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(TINY_LONG_MODEL_DIR)
    text = "".join(r["question_zh-cn"] + r["answer"] for r in splits["train"] + splits["test"])
    assert len(tokenizer.encode(text)) == len(text)  # one token per character


def test_the_shipped_long_model_is_what_its_build_makes(build):
    info = json.loads((TINY_LONG_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    defaults = build.parse_args(["--recipe", "tiny-long"])
    assert (info["sft_steps"], info["lr"], info["written_out_rate"]) == (
        defaults.steps, defaults.lr, defaults.written_out_rate)
    sha = {path: hashlib.sha256(path.read_bytes()).hexdigest()
           for path in (TINY_MODEL_DIR / "model.safetensors", TINY_LONG_DATA_DIR / "train.jsonl")}
    assert info["base_weights_sha256"] == sha[TINY_MODEL_DIR / "model.safetensors"], "rebuild: --recipe tiny-long"
    assert info["train_data_sha256"] == sha[TINY_LONG_DATA_DIR / "train.jsonl"], "rebuild: --recipe tiny-long"
    assert info["weights_bytes"] == (TINY_LONG_MODEL_DIR / "model.safetensors").stat().st_size < 8_000_000


def test_the_long_measurement_adds_the_truncated_shares_and_gives_the_shipped_greedy_examples(build, tmp_path):
    """measure() at the long budget with truncation=True: the keys of the long build_info.json, and
    (greedy being deterministic) its example completions, one of which the budget cuts."""
    from transformers import Qwen2ForCausalLM

    info = json.loads((TINY_LONG_MODEL_DIR / "build_info.json").read_text(encoding="utf-8"))
    lines = (TINY_LONG_DATA_DIR / "test.jsonl").read_text(encoding="utf-8").splitlines()[:3]
    (tmp_path / "test.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    model = Qwen2ForCausalLM.from_pretrained(TINY_LONG_MODEL_DIR).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_LONG_MODEL_DIR)
    measured = build.measure(model, tokenizer, tmp_path, n_sampled=2, k=8, **build.RECIPES["tiny-long"].measure)
    assert {"greedy_truncated_rate", "truncated_T1", "greedy_accuracy"} <= set(measured) <= set(info)
    assert measured["example_greedy"] == info["example_greedy"]
    assert measured["greedy_truncated_rate"] == 1 / 3  # the second example stops mid-line at 128 tokens
    assert "</answer>" not in info["example_greedy"][1]


def test_the_written_out_rate_sets_the_mix_of_styles(build, splits):
    rows = splits["train"]
    assert build.with_concise(rows, 1.0) == rows
    assert build.with_concise(rows, 0.0) == [dict(r, answer=concise(r["answer"])) for r in rows]
    kept = sum(a == b for a, b in zip(build.with_concise(rows, 0.65), rows))
    assert 0.6 * len(rows) < kept < 0.7 * len(rows)  # binomial(4000, 0.65): sd 30 rows, the bounds 6.6 sd away


def test_an_option_the_recipe_does_not_read_is_an_error(build, capsys):
    with pytest.raises(SystemExit) as stop:
        build.parse_args(["--recipe", "tiny-long", "--slip-rate", "0.3"])
    assert stop.value.code == 2 and "--slip-rate does not apply to --recipe tiny-long" in capsys.readouterr().err


def test_two_steps_of_the_long_config_truncate_a_tenth_of_the_completions(tmp_path):
    """The acceptance check: `dapo-train run configs/tiny-long-cpu.yaml train.max_steps=2
    eval.every_steps=0` logs truncated_ratio >= 0.1 in its first steps, and the overlong penalty acts. The
    end-of-run eval of the whole split comes after those steps and is left out (most of the time)."""
    from dapo_train.train.loop import train

    cfg = load_config(str(CONFIG), ["train.max_steps=2", "eval.every_steps=0", f"output_dir={tmp_path / 'run'}",
                                    "logging.progress_bar=false", "eval.final_full=false"])
    rows = [row for row in read_metrics(train(cfg)) if "truncated_ratio" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["truncated_ratio"] >= 0.1 and rows[0]["completion_length_max"] == cfg.rollout.max_new_tokens
    assert all(row["rewards/overlong/mean"] < 0 for row in rows)
