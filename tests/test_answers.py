"""Answer extraction and numeric equivalence: tables, Chinese outputs, adversarial input, real GSM8K."""

import json
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.answers import answers_match, canonical, extract_answer, is_correct, normalize_gold

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"  # ../shared beside the repo
needs_gsm8k = pytest.mark.skipif(not GSM8K.is_dir(), reason="GSM8K test data not available")
SOLVERS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def block(content: str) -> str:
    """A completion in the taught format with `content` as its answer."""
    return f"<think>\n推理过程 1+1=2\n</think>\n<answer>\n{content}\n</answer>"


# (answer block content, expected canonical answer)
EXTRACTION = [
    ("72", "72"),
    ("-10", "-10"),
    ("−10", "-10"),  # U+2212 minus sign
    ("－10", "-10"),  # full-width hyphen-minus
    ("2,125", "2125"),
    ("2，125", "2125"),  # full-width comma as a thousands separator
    ("1,234,567.50", "1234567.5"),
    ("72.0", "72"),
    ("72.00", "72"),
    ("3.5", "3.5"),
    (".5", "0.5"),
    ("3/4", "0.75"),  # 3/4 has a finite decimal
    ("3 / 4", "0.75"),
    ("1/3", "1/3"),  # no finite decimal: kept as a fraction
    ("-1/8", "-0.125"),
    ("25%", "25"),  # percent sign is a unit; GSM8K golds for percent questions are the bare number
    ("$18", "18"),
    ("-$5", "-5"),
    ("18元", "18"),
    ("共18个", "18"),
    ("18 dollars", "18"),
    ("答案是72元", "72"),
    ("答案是７２元。", "72"),  # full-width digits, Chinese full stop
    ("答案：１，０００", "1000"),
    ("是-10", "-10"),  # a minus after a CJK character is a sign
    ("16-3", "3"),  # a minus after a digit is a subtraction: the final number is 3
    ("16 - 3 = 13", "13"),
    ("x=-4", "-4"),
    ("(-4)", "-4"),
    ("\\boxed{42}", "42"),
    ("\\boxed{\\frac{3}{4}} (from 6 of 8)", "0.75"),  # a \boxed{} wins over later numbers
    ("\\dfrac{1}{2}", "0.5"),
    ("2{,}125", "2125"),  # LaTeX thousands separator
    ("首先 5 个，然后 7 个", "7"),
    ("1, 2, 3", "3"),
]


@pytest.mark.parametrize("content, expected", EXTRACTION)
def test_extract_from_answer_block(content, expected):
    assert extract_answer(block(content)) == expected


@pytest.mark.parametrize(
    "text, strict, expected",
    [
        ("答案是72元", True, None),  # strict needs an answer block
        ("答案是72元", False, "72"),
        ("so the answer is \\boxed{12}. Check: 3*4", False, "12"),  # non-strict prefers \boxed
        ("<answer>5</answer><answer>6</answer>", True, "6"),  # the last block counts
        ("<answer>5</answer> 9 more", True, "5"),  # text after the block is ignored
        ("< answer >\n 5 \n< /answer >", True, "5"),  # spaces inside tags
        ("<ANSWER>5</ANSWER>", True, "5"),
        ("<answer>\n7\n", True, None),  # unclosed block: strict refuses
        ("<answer>\n7\n", False, "7"),
        ("<answer>no number</answer> 8", True, None),
        ("<answer>no number</answer> 8", False, "8"),  # non-strict falls back to the whole text
        ("<answer><answer>5</answer></answer>", True, "5"),  # nested
        ("</answer>5<answer>", True, None),  # tags in the wrong order
        ("<answer>1/0</answer>", True, None),  # zero denominator is not a number
        ("<answer>" + "3" * 200 + "</answer>", True, None),  # degenerate digit run is not an answer
    ],
)
def test_extract_strict_and_fallback(text, strict, expected):
    assert extract_answer(text, strict=strict) == expected


@pytest.mark.parametrize(
    "value, expected",
    [
        (72, "72"),
        (np.int64(-10), "-10"),  # answer_only is int64
        (np.float32(0.5), "0.5"),
        (72.0, "72"),
        (0.1, "0.1"),  # read by repr, not as the binary double 0.1000000000000000055...
        (Decimal("2.50"), "2.5"),
        (Fraction(3, 4), "0.75"),
        ("72", "72"),
        ("2,125", "2125"),
        ("He makes $18.\n#### 18", "18"),
        ("Total 1,000 items\n#### 2,125", "2125"),  # the number after ####, not before
        ("#### -10", "-10"),
        ("＃＃＃＃ 5", "5"),  # no ASCII marker: the last number of the string
        (True, None),  # a bool is not an answer
        (float("nan"), None),
        (float("inf"), None),
        (None, None),
        ([72], None),
        ("", None),
        ("#### ", None),
    ],
)
def test_normalize_gold(value, expected):
    assert normalize_gold(value) == expected


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("72", 72, True),
        ("72.0", 72, True),
        ("72.00", "72", True),
        ("0.5", "1/2", True),
        ("1/2", 0.5, True),
        ("2125", "#### 2,125", True),
        ("-10", np.int64(-10), True),
        ("10", -10, False),  # the seed checker dropped minus signs and called this correct
        ("8.294400000000001", "8.2944", True),  # float printing noise (relative 1.2e-16)
        ("1000000.5", 1000000, False),  # a real difference of 0.5 is not noise
        ("0.33", "1/3", False),
        ("1/3", "1/3", True),
        (None, 72, False),
        ("72", None, False),
        ("", "", False),
        ("abc", "abc", False),  # two unreadable answers are not equal
        (object(), 72, False),
    ],
)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


@pytest.mark.parametrize(
    "value, expected",
    [(Fraction(72), "72"), (Fraction(-5, 2), "-2.5"), (Fraction(1, 40), "0.025"), (Fraction(-2, 3), "-2/3")],
)
def test_canonical(value, expected):
    assert canonical(value) == expected


def test_is_correct_uses_strict_extraction():
    assert is_correct(block("答案是72元"), 72)
    assert not is_correct(block("答案是73元"), 72)
    assert not is_correct("答案是72元", 72)  # no answer block
    assert is_correct("答案是72元", 72, strict=False)
    assert not is_correct(block("72"), "not a number")


ADVERSARIAL = [
    "",
    "<answer></answer>",
    "<think></think><answer></answer>",
    "<answer>",
    "</answer>",
    "<answer>" * 3000,  # thousands of unclosed tags: must stay linear
    "<answer>" * 3000 + "</answer>",
    "\\boxed{" * 3000,
    "\x00<answer>\x00 5 \ufffd</answer>\x00",
    "\ufffd" * 20_000,
    "-" * 20_000 + "5",
    "1," * 10_000,
    "1/" * 10_000,
    "9" * 20_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_never_raise_and_stay_fast(text):
    start = time.perf_counter()
    for strict in (True, False):
        result = extract_answer(text, strict=strict)
        assert result is None or isinstance(result, str)
        is_correct(text, 5, strict=strict)
    assert time.perf_counter() - start < 0.5  # 20k characters; quadratic scanning would take seconds


def test_nul_and_replacement_characters_do_not_hide_the_answer():
    assert extract_answer("\x00<answer>\x00 5 \ufffd</answer>\x00") == "5"


def test_random_noise_20k_characters():
    rng = np.random.default_rng(0)
    alphabet = list("0123456789,./-− <>answer\\boxed{}答案元%$\n\x00\ufffd１２，")
    noise = "".join(rng.choice(alphabet, size=20_000))
    start = time.perf_counter()
    for strict in (True, False):
        extract_answer(noise, strict=strict)
        extract_answer(block(noise), strict=strict)
    assert time.perf_counter() - start < 0.5


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300), st.booleans())
def test_extraction_never_raises(text, strict):
    result = extract_answer(text, strict=strict)
    # Whatever comes out is canonical: normalising it again is a fixed point.
    assert result is None or normalize_gold(result) == result


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=100), st.integers(), st.floats(), st.none()), st.text(max_size=100))
def test_answers_match_never_raises(gold, pred):
    assert answers_match(pred, gold) in (True, False)


@needs_gsm8k
def test_every_gold_answer_in_a_block_is_correct_and_a_different_number_is_not():
    rows = [json.loads(line) for line in (GSM8K / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 1319
    for row in rows:
        gold_text = row["answer"].rpartition("####")[2].strip()  # as written, e.g. "2,125" or "-10"
        gold = normalize_gold(row["answer"])
        assert gold is not None, row["answer"][-40:]
        assert is_correct(block(gold_text), row["answer"]), gold_text
        assert is_correct(block(gold), int(gold)), gold  # the int64 answer_only column's form
        wrong = str(int(gold) + 1)
        assert not is_correct(block(wrong), row["answer"]), (wrong, gold_text)


@needs_gsm8k
def test_labelled_model_solutions_agree_with_openai_labels():
    """5,276 real solutions, each wrapped in <think>/<answer> with its final "A:" value as the
    answer (an empty answer if the model never wrote "A:"), must be judged as OpenAI labelled them."""
    golds = [json.loads(line)["answer"] for line in (GSM8K / "test.jsonl").read_text().splitlines()]
    lines = (GSM8K / "example_model_solutions.jsonl").read_text().splitlines()
    disagreements, total, labelled_correct = [], 0, 0
    for gold, line in zip(golds, lines, strict=True):
        row = json.loads(line)
        for solver in SOLVERS:
            solution, label = row[solver]["solution"], row[solver]["is_correct"]
            reasoning, marker, final = solution.rpartition("A:")
            completion = f"<think>\n{(reasoning if marker else solution).strip()}\n</think>\n" + (
                f"<answer>\n{final.strip() if marker else ''}\n</answer>"
            )
            total, labelled_correct = total + 1, labelled_correct + label
            if is_correct(completion, gold) != label:
                disagreements.append((final.strip(), gold[-12:], label))
    assert total == 5276 and labelled_correct > 0  # the file holds both labels
    assert disagreements == []
