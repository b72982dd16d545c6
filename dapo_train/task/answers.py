"""What "correct" means: the task's answer check (data.correctness, an AnswerCheck) and the
default one, numeric extraction and equivalence for GSM8K-style (and GSM8K-zh) completions.

The correctness bit drives the accuracy reward, dynamic sampling (Eq. 11: a group is kept only if
0 < #correct < G) and evaluation, so a checker that misreads answers silently poisons all three.
So minus signs are kept ("-10", "−10"), thousands separators are read ("2,125", "2，125"),
numbers compare by value (72 == 72.0 == "72.00", 0.5 == 1/2), and full-width digits, currency,
units, percent signs and \\boxed{...} are understood. A task without numeric answers names its
own check by import path (answer_check).

The numeric check is pure string work with precompiled, linear-time regexes: it runs on every
completion, including 20k characters of degenerate noise, and never raises on any str input.
"""

from __future__ import annotations

import math
import numbers
import re
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

from dapo_train.errors import ConfigError
from dapo_train.plugins import import_plugin, require_signature

# Full-width digits and punctuation (common in Chinese outputs) and Unicode minus signs -> ASCII.
# "。" is deliberately not mapped to "." so "答案是72。" stays 72, not a malformed decimal.
_FULL_WIDTH = {ord("０") + k: ord("0") + k for k in range(10)}
_TRANSLATE = str.maketrans(
    {**_FULL_WIDTH, "，": ",", "．": ".", "／": "/", "％": "%", "＋": "+",
     "－": "-", "−": "-", "﹣": "-", "＄": "$", "￥": "¥", "｛": "{", "｝": "}"}
)

# One number token. The minus sign counts only when it cannot be a subtraction ("16-3" is 16 and 3;
# "是-10", "= -10", "(-10" are -10). The integer part is either comma-grouped by threes or a plain
# run of digits; an optional decimal part; an optional integer denominator ("3/4", "3 / 4").
# Every piece is bounded or possessive-like (no nested quantifiers), so scanning is linear.
_NUMBER = re.compile(
    r"(?:(?<![0-9A-Za-z_)\]}])(?P<sign>-)[ ]?[$¥€£]?[ ]?)?"
    r"(?<![\d.])"
    r"(?:(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.(?P<frac>\d+))?|\.(?P<bare_frac>\d+))"
    r"(?:[ ]?/[ ]?(?P<den>\d+))?",
    re.ASCII,
)
_ANSWER_OPEN = re.compile(r"<[ \t]*answer[ \t]*>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"<[ \t]*/[ \t]*answer[ \t]*>", re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{ ?(-?[\d.,]{1,64}) ?\}\{ ?([\d.,]{1,64}) ?\}")
_BRACE = re.compile(r"[{}]")
_GSM8K_MARK = "####"
_BOXED = "\\boxed{"
_MAX_DIGITS = 64  # a longer token is degenerate output ("3333…"), not an answer
_REL_TOL = 1e-9  # absorbs float-printing noise such as 8.294400000000001 vs 8.2944


def _prepare(text: str) -> str:
    """ASCII-fy digits and signs, and rewrite LaTeX fractions / {,} separators as plain text."""
    text = text.translate(_TRANSLATE).replace("{,}", ",").replace("\\!", "")
    return _LATEX_FRAC.sub(r"\1/\2", text)


def _token_value(match: re.Match) -> Fraction | None:
    """Exact value of one number token; None if it is degenerate (too long, "3/0")."""
    int_part = (match.group("int") or "0").replace(",", "")
    frac_part = match.group("frac") or match.group("bare_frac") or ""
    den = match.group("den")
    if len(int_part) + len(frac_part) + len(den or "") > _MAX_DIGITS:
        return None
    if den is not None and int(den) == 0:
        return None
    value = Fraction(f"{int_part}.{frac_part}" if frac_part else int_part)
    if den is not None:
        value /= int(den)
    return -value if match.group("sign") else value


def last_number(text: str) -> Fraction | None:
    """Value of the last readable number in `text` (units, currency and '%' are ignored)."""
    for match in reversed(list(_NUMBER.finditer(_prepare(text)))):
        value = _token_value(match)
        if value is not None:
            return value
    return None


def answer_block(text: str) -> str | None:
    """Content of the last closed <answer>...</answer> block, tolerant of spaces in the tags.

    Found as the last closing tag, then the last opening tag before it: two linear scans, so
    thousands of unclosed "<answer>" tags cannot cause quadratic matching.
    """
    close = _last(_ANSWER_CLOSE.finditer(text))
    if close is None:
        return None
    opening = _last(_ANSWER_OPEN.finditer(text, 0, close.start()))
    return None if opening is None else text[opening.end() : close.start()]


def _last(matches: Iterator[re.Match]) -> re.Match | None:
    """The last of a scan's matches (None if none), keeping only one at a time."""
    found = deque(matches, maxlen=1)
    return found[0] if found else None


def _last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...}, braces balanced (an unclosed one runs to the end)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for brace in _BRACE.finditer(text, begin):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[begin : brace.start()]
    return text[begin:]


def _number_in(region: str | None) -> Fraction | None:
    """Final number of a region, preferring a \\boxed{} inside it."""
    if region is None:
        return None
    boxed = _last_boxed(region)
    value = last_number(boxed) if boxed is not None else None
    return value if value is not None else last_number(region)


def canonical(value: Fraction) -> str:
    """Canonical string of a value: "72", "-10", "0.5", "2.125"; "1/3" if no finite decimal."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * (10**places // value.denominator)
    digits = str(scaled).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0")


def extract_value(text: str, strict: bool = True) -> Fraction | None:
    """The answer of a completion as an exact value (see extract_answer)."""
    if not isinstance(text, str):
        return None
    value = _number_in(answer_block(text))
    if value is not None or strict:
        return value
    value = _number_in(_last_boxed(text))
    return value if value is not None else last_number(text)


def extract_answer(text: str, strict: bool = True) -> str | None:
    """The final answer of a completion as a canonical numeric string, or None.

    strict=True (rewards, evaluation): the final number of the last closed <answer>...</answer>
    block (a \\boxed{} inside it wins); no block or no number -> None. strict=False additionally
    falls back to the last \\boxed{} and then to the last number anywhere in the text.
    Returns e.g. "72" for "答案是72元", "-10" for "−10", "2125" for "2，125", "0.75" for "3/4".
    """
    value = extract_value(text, strict)
    return None if value is None else canonical(value)


def to_value(value: object) -> Fraction | None:
    """Exact value of a gold or predicted answer of any accepted type; None if unreadable.

    int / numpy integer, float / numpy float (by its shortest repr, so 0.1 is 1/10), Decimal,
    Fraction, or a string that is one number: a GSM8K solution's after its last "####", any other
    string's whole text (_only_number). bool and non-finite floats are unreadable.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return Fraction(int(value))
    if isinstance(value, Fraction):
        return value
    if isinstance(value, Decimal):
        return Fraction(value) if value.is_finite() else None
    if isinstance(value, numbers.Real):
        number = float(value)
        return Fraction(repr(number)) if math.isfinite(number) else None
    if isinstance(value, str):
        return _only_number(value.rpartition(_GSM8K_MARK)[2])
    return None


def _only_number(text: str) -> Fraction | None:
    """The value of a text that is one number and nothing else but spaces, signs, currency or percent;
    None for anything more: "1e3" is not 3, "0x10" not 10, "5 apples and 3 pears" not 3 (a gold read as its
    last number would train on a wrong answer without a word)."""
    prepared = _prepare(text)
    matches = list(_NUMBER.finditer(prepared))
    if len(matches) != 1:
        return None
    match = matches[0]
    rest = prepared[: match.start()] + prepared[match.end() :]
    return None if any(char.isalnum() for char in rest) else _token_value(match)


def normalize_gold(value: object) -> str | None:
    """Canonical numeric string of a gold answer ("#### 2,125" -> "2125"), None if unreadable.

    The data pipeline stores this string; answers_match parses both sides the same way.
    """
    number = to_value(value)
    return None if number is None else canonical(number)


def answers_match(pred: object, gold: object) -> bool:
    """Numeric equivalence of a predicted and a gold answer; False if either is unreadable.

    Exact rational equality, or a relative difference under 1e-9 so float-printing noise
    ("8.294400000000001") does not flip a correct answer. Never raises.
    """
    a, b = to_value(pred), to_value(gold)
    if a is None or b is None:
        return False
    return a == b or abs(a - b) <= _REL_TOL * max(1, abs(b))


def is_correct(completion: str, gold: object, strict: bool = True) -> bool:
    """Whether the completion's extracted answer equals the gold answer numerically."""
    pred = extract_value(completion, strict)
    return pred is not None and answers_match(pred, gold)


def is_answer_correct(completion: str, gold: object) -> bool:
    """is_correct read leniently (strict=False): the answer block, else the last \\boxed{}, else the last
    number, where a reader would take the final answer to be."""
    return is_correct(completion, gold, strict=False)


# --------------------------------------------------------------------------------------------
# The task's check (data.correctness): numeric by default, or a plugin by import path.


@dataclass(frozen=True)
class AnswerCheck:
    """How a task reads its gold answers and grades a completion (data.correctness).

    normalize_gold: an answer cell -> the gold string, or None if unreadable (the row is dropped);
    extract: a completion -> its answer as a string (shown in eval records; maj@k votes on it);
    is_correct: (completion, gold string) -> bool: the correct bit of rewards, filter and eval (strict);
    is_answer_correct: the same, reading the answer wherever a reader would take it to be (eval's answer
    accuracy: the gap to is_correct is the answer's format, not its number).
    """

    name: str
    normalize_gold: Callable[[Any], str | None]
    extract: Callable[[str], str | None]
    is_correct: Callable[[str, str], bool]
    is_answer_correct: Callable[[str, str], bool]


def _text_gold(value: Any) -> str | None:
    text = "" if value is None else str(value).strip()
    return text or None


def _answer_text(completion: str) -> str | None:
    block = answer_block(completion)
    return None if block is None else block.strip()


# Name -> AnswerCheck; data.correctness also takes an import path (see answer_check).
ANSWER_CHECKS = {
    "numeric": AnswerCheck("numeric", normalize_gold, extract_answer, is_correct, is_answer_correct),
}


def _plugin_check(name: str) -> Callable[[str, str], bool]:
    """The data.correctness plugin, checked to take (completion, gold) now and to answer True or False
    when called: any other answer (a text, None) would grade by its truthiness without a word."""
    fn = import_plugin(name, "data.correctness")
    require_signature(fn, ("completion", "gold"), "data.correctness",
                      f"{name} does not take (completion, gold): {{err}}")

    def check(completion: str, gold: str) -> bool:
        try:
            result = fn(completion, gold)
        except Exception as err:  # the plugin's own bug: name it, not the reward that asked it
            shown = repr(completion[:120]) + ("..." if len(completion) > 120 else "")
            raise ConfigError("data.correctness", f"{name} raised {type(err).__name__}: {err} on {shown} "
                              f"(gold {gold!r}); fix the check") from err
        if getattr(result, "shape", None) == () and hasattr(result, "item"):
            result = result.item()  # a numpy or torch scalar
        if not isinstance(result, (bool, int)) or result not in (0, 1):
            raise ConfigError("data.correctness", f"{name} returned {result!r} ({type(result).__name__}), not a bool")
        return bool(result)

    return check


def answer_check(name: str) -> AnswerCheck:
    """data.correctness -> its AnswerCheck: a registered name, or a plugin 'pkg.module:function'
    (completion, gold) -> bool, whose gold is the answer cell as text and whose answer is the
    text of the completion's <answer> block; its verdict is both the strict and the answer one."""
    if name in ANSWER_CHECKS:
        return ANSWER_CHECKS[name]
    if ":" in name:
        check = _plugin_check(name)  # a plugin reads the answer where it will: one verdict for both
        return AnswerCheck(name, _text_gold, _answer_text, check, check)
    raise ConfigError(
        "data.correctness",
        f"unknown check '{name}'; registered: {', '.join(ANSWER_CHECKS)}, or use 'pkg.module:function'",
    )
