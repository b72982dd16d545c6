"""The calculator tool: exact arithmetic on an expression the policy writes, answered as text.

The expression is parsed into Python's syntax tree (ast.parse, mode "eval") and walked here over a
whitelist of node types; nothing is evaluated by Python itself (no eval, exec or code object), so a
name, an attribute, a call to anything but the functions below, a subscript, a lambda, a comprehension
or a string is refused. Numbers are exact fractions (fractions.Fraction): 0.1 is 1/10, not the nearest
float. Every cost is bounded before it is paid: the input's length, each literal's digits, each
exact result's digits (numerator and denominator: past MAX_DIGITS it goes on as an approximation), each
approximation's magnitude (10^-MAX_DIGITS to 10^MAX_DIGITS), a power's size (estimated before computing
it), the nesting depth and the wall time. Anything malformed or refused is an answer starting "error: ",
never an exception: the text goes back to the model as the tool's reply.

Accepted: integers and decimals (1_000, 2.5, .5, 1e3), + - * / // % ** (also ^ for power), unary + and -,
parentheses, and the functions of FUNCTIONS. A run of superscripts is a power (3² is 3 ** 2, 10⁻³ is
10 ** (-3)). Chinese full-width input is folded to ASCII (NFKC on the full-width forms: digits, （）,
＋－＊／; and × ÷ −), any other space to a space; every other character NFKC would change (a subscript,
a circled number, a vulgar fraction) is refused: NFKC would read 3₂ as 32 and ①3 as 13. A trailing "="
is ignored.

Answers: an integer plainly ("42"); any other exact value as its decimal when that ends within
EXACT_DECIMAL_PLACES places ("0.25", "-1.125"), else as a fraction with its rounded value
("1/3 ≈ 0.333333333333"); a value that is not exact (the square root of a non-square, a power with a
fractional exponent, and anything computed from one) as "≈ " and SIGNIFICANT_DIGITS significant digits.
A rounded value is written in scientific notation from 10^12 or 10^-12 on ("≈ 1.41421356237e-12").
An exact value past MAX_DIGITS digits is shown rounded ((241/240) ** 120, 286 digits over 286).
"""

from __future__ import annotations

import ast
import decimal
import math
import re
import time
import unicodedata
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from dapo_train.tools.registry import register

MAX_INPUT_CHARS = 500  # of the expression, before and after folding full-width characters
MAX_DIGITS = 200  # of any literal, and of any result's numerator or denominator
MAX_DEPTH = 32  # nested operations and calls
TIME_LIMIT_S = 0.5  # checked at every node; the other bounds keep one node's work far below it
EXACT_DECIMAL_PLACES = 20  # an exact value with more decimal places is shown as a fraction
SIGNIFICANT_DIGITS = 12  # of a rounded value
_WORKING_DIGITS = 40  # the precision of an approximation (a root, a fractional or an oversized power)
_LIMIT = 10**MAX_DIGITS
_LN10 = decimal.Decimal(10).ln(decimal.Context(prec=_WORKING_DIGITS + 10))
_FOLD = str.maketrans({"×": "*", "÷": "/", "−": "-", "^": "**"})
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁽⁾", "0123456789+-()")
_SUPERSCRIPT_RUN = re.compile("[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁽⁾]+")  # one character class: linear
_FULL_WIDTH = range(0xFF01, 0xFF5F)  # the full-width forms of ASCII's ! to ~, which NFKC folds to them
_LITERAL = re.compile(r"(?P<int>\d+(?:_\d+)*)?(?:\.(?P<frac>\d+(?:_\d+)*)?)?(?:[eE](?P<exp>[+-]?\d+(?:_\d+)*))?")


class Refused(Exception):
    """An expression the calculator will not compute; its message is the error text after "error: "."""


@dataclass(frozen=True)
class Value:
    """A number: `fraction` is exact when `exact`, else an approximation to about _WORKING_DIGITS digits."""

    fraction: Fraction
    exact: bool = True


@register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, e.g. (12 + 30) * 3 / 4. Numbers may be integers, decimals
    or fractions; operators + - * / // % ** and parentheses; functions sqrt, abs, round, floor, ceil, min, max.

    Args:
        expression: The arithmetic expression to evaluate, such as 48 / 2 + 3 * 1.5
    """
    return calculate(expression)


def calculate(expression: str) -> str:
    """The answer to `expression` as text (module docstring); an error text, never an exception."""
    try:
        return show(_evaluate_text(expression))
    except Refused as refusal:
        return f"error: {refusal}"
    except Exception as err:  # a bug here must not stop a rollout; the text says it is ours
        return f"error: internal calculator error ({type(err).__name__}: {err})"


def _evaluate_text(expression: str) -> Value:
    if not isinstance(expression, str):
        raise Refused(f"the expression must be text, not {type(expression).__name__}")
    if len(expression) > MAX_INPUT_CHARS:
        raise Refused(f"the expression is longer than {MAX_INPUT_CHARS} characters")
    text = _fold(expression).translate(_FOLD).strip().removesuffix("=").strip()
    if len(text) > MAX_INPUT_CHARS:
        raise Refused(f"the expression is longer than {MAX_INPUT_CHARS} characters")
    if not text:
        raise Refused("the expression is empty")
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and the like: the refusal says enough
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise Refused(f"cannot parse {shown!r}: {getattr(err, 'msg', err)}") from None
    return _Walk(text, time.monotonic() + TIME_LIMIT_S).value(tree.body, 0)


def _fold(expression: str) -> str:
    """Superscript runs as powers, then full-width forms and spaces as ASCII (module docstring); Refused
    naming the first other character that NFKC would change."""
    text = _SUPERSCRIPT_RUN.sub(lambda run: f"**({run.group().translate(_SUPERSCRIPTS)})", expression)
    folded = []
    for character in text:
        plain = unicodedata.normalize("NFKC", character)
        if plain != character and not (ord(character) in _FULL_WIDTH or character.isspace()):
            raise Refused(f"the character {character!r} is not arithmetic; write plain digits and + - * / ** ( )")
        folded.append(" " if character.isspace() else plain)
    return "".join(folded)


# --------------------------------------------------------------------------------------------
# The walk: numbers, the operators of _OPERATORS, calls of FUNCTIONS; any other node is refused by name.

_REFUSED_NODES = {
    ast.Name: "names are not allowed (only numbers and the functions {functions})",
    ast.Attribute: "attribute access is not allowed",
    ast.Subscript: "subscripts are not allowed",
    ast.Lambda: "lambdas are not allowed",
    ast.JoinedStr: "strings are not allowed",
    ast.Tuple: "commas are only allowed between a function's arguments (write 1000, not 1,000)",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "and/or are not allowed",
}


class _Walk:
    def __init__(self, text: str, deadline: float):
        self.text = text
        self.deadline = deadline

    def value(self, node: ast.AST, depth: int) -> Value:
        if depth > MAX_DEPTH:
            raise Refused(f"the expression nests deeper than {MAX_DEPTH} levels")
        if time.monotonic() > self.deadline:
            raise Refused(f"the expression takes longer than {TIME_LIMIT_S} s")
        if isinstance(node, ast.Constant):
            return Value(self.literal(node))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            operand = self.value(node.operand, depth + 1)
            return operand if isinstance(node.op, ast.UAdd) else Value(-operand.fraction, operand.exact)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = self.value(node.left, depth + 1), self.value(node.right, depth + 1)
            return _bounded(_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            raise Refused(f"the operator {type(node.op).__name__} is not allowed; the operators are + - * / // % **")
        reason = _REFUSED_NODES.get(type(node), f"{type(node).__name__} is not arithmetic")
        raise Refused(reason.format(functions=", ".join(FUNCTIONS)))

    def literal(self, node: ast.Constant) -> Fraction:
        if type(node.value) not in (int, float):
            raise Refused(f"{type(node.value).__name__} literals are not allowed, only numbers")
        source = ast.get_source_segment(self.text, node) or ""
        match = _LITERAL.fullmatch(source)
        if not match or not (match["int"] or match["frac"]):
            raise Refused(f"write numbers in decimal digits, not {source!r}")
        digits = (match["int"] or "").replace("_", "") + (match["frac"] or "").replace("_", "")
        exponent_text = (match["exp"] or "0").replace("_", "")
        if len(digits) > MAX_DIGITS or len(exponent_text) > 6:
            raise Refused(f"the number {source[:20]}... has more than {MAX_DIGITS} digits")
        exponent = int(exponent_text) - len((match["frac"] or "").replace("_", ""))
        if abs(exponent) > 2 * MAX_DIGITS:
            raise Refused(f"the number {source} has more than {MAX_DIGITS} digits")
        value = Fraction(int(digits)) * Fraction(10) ** exponent
        return _bounded(Value(value)).fraction

    def call(self, node: ast.Call, depth: int) -> Value:
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            called = node.func.id if isinstance(node.func, ast.Name) else "that"
            raise Refused(f"cannot call {called}; the functions are {', '.join(FUNCTIONS)}")
        if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
            raise Refused(f"{node.func.id}() takes plain arguments only")
        function = FUNCTIONS[node.func.id]
        if not function.min_args <= len(node.args) <= function.max_args:
            raise Refused(f"{node.func.id}() takes {function.arity}, not {len(node.args)}")
        return _bounded(function.fn(*[self.value(arg, depth + 1) for arg in node.args]))


def _bounded(value: Value) -> Value:
    """`value` itself when exact within MAX_DIGITS digits (numerator and denominator); else an approximation
    rounded to _WORKING_DIGITS significant digits (so that a chain of them stays short), Refused unless its
    magnitude lies within 10^-MAX_DIGITS and 10^MAX_DIGITS (zero always does)."""
    fraction = value.fraction
    if fraction == 0 or (value.exact and abs(fraction.numerator) < _LIMIT and fraction.denominator < _LIMIT):
        return value
    with decimal.localcontext() as context:
        context.prec = _WORKING_DIGITS
        approximate = decimal.Decimal(fraction.numerator) / decimal.Decimal(fraction.denominator)
    _require_magnitude(approximate.adjusted())
    return Value(Fraction(approximate), exact=False)


def _require_magnitude(exponent: float) -> None:
    """Refused unless 10^exponent, a result's size, lies within 10^-MAX_DIGITS and 10^MAX_DIGITS."""
    if exponent >= MAX_DIGITS:
        raise Refused(f"a result is too large (10^{MAX_DIGITS} or more)")
    if exponent < -MAX_DIGITS:
        raise Refused(f"a result is too small (nonzero, under 10^-{MAX_DIGITS})")


# --------------------------------------------------------------------------------------------
# Operators.


def _divide(left: Value, right: Value) -> Value:
    if right.fraction == 0:
        raise Refused("division by zero")
    return Value(left.fraction / right.fraction, left.exact and right.exact)


def _floor_divide(left: Value, right: Value) -> Value:
    if right.fraction == 0:
        raise Refused("division by zero")
    return Value(Fraction(left.fraction // right.fraction), left.exact and right.exact)


def _modulo(left: Value, right: Value) -> Value:
    if right.fraction == 0:
        raise Refused("modulo by zero")
    return Value(left.fraction % right.fraction, left.exact and right.exact)


def _power(base: Value, exponent: Value) -> Value:
    """base ** exponent: exact when both are and the result's digits, estimated before computing it, stay
    within MAX_DIGITS; else an approximation (_approximate_power)."""
    b, e = base.fraction, exponent.fraction
    exact = base.exact and exponent.exact
    if b == 0:
        if e < 0:
            raise Refused("division by zero (0 to a negative power)")
        return Value(Fraction(1 if e == 0 else 0), exact)
    if b in (1, -1) and e.denominator == 1:
        return Value(b ** int(e), exact)
    if b < 0 and e.denominator != 1:
        raise Refused("a negative number to a fractional power is not a real number")
    root = b if e.denominator == 1 else _exact_root(b, e.denominator)
    if root is not None and abs(e.numerator) * math.log10(max(abs(root.numerator), root.denominator)) <= MAX_DIGITS:
        return Value(root ** e.numerator, exact)
    return _approximate_power(b, e)


def _approximate_power(b: Fraction, e: Fraction) -> Value:
    """b ** e to _WORKING_DIGITS digits as exp(e ln |b|) (b < 0 only with a whole e), Refused from its
    magnitude, e ln |b|, before the exp. The logarithm is taken with as many more digits as e has before its
    point, so that e's size does not eat the result's precision (b = 1 + 10^-30, e = 10^31)."""
    with decimal.localcontext() as context:
        context.prec = _WORKING_DIGITS + 5 + len(str(abs(e.numerator) // e.denominator))
        logarithm = (decimal.Decimal(abs(b.numerator)) / decimal.Decimal(b.denominator)).ln()
        logarithm = logarithm * e.numerator / e.denominator
        _require_magnitude(math.floor(logarithm / _LN10))
        approximate = logarithm.exp()
    sign = -1 if b < 0 and e.numerator % 2 else 1
    return _bounded(Value(sign * Fraction(approximate), exact=False))


def _exact_root(value: Fraction, degree: int) -> Fraction | None:
    """The positive rational `degree`-th root of value > 0, or None when it is irrational (or degree > 64)."""
    if degree > 64:
        return None
    numerator, denominator = _integer_root(value.numerator, degree), _integer_root(value.denominator, degree)
    if numerator ** degree == value.numerator and denominator ** degree == value.denominator:
        return Fraction(numerator, denominator)
    return None


def _integer_root(n: int, degree: int) -> int:
    """The largest r with r ** degree <= n (n >= 0), by bisection over r's bits."""
    low, high = 0, 1 << (n.bit_length() // degree + 1)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if middle**degree <= n else (low, middle - 1)
    return low


_OPERATORS: dict[type, Callable[[Value, Value], Value]] = {
    ast.Add: lambda a, b: Value(a.fraction + b.fraction, a.exact and b.exact),
    ast.Sub: lambda a, b: Value(a.fraction - b.fraction, a.exact and b.exact),
    ast.Mult: lambda a, b: Value(a.fraction * b.fraction, a.exact and b.exact),
    ast.Div: _divide,
    ast.FloorDiv: _floor_divide,
    ast.Mod: _modulo,
    ast.Pow: _power,
}


# --------------------------------------------------------------------------------------------
# Functions.


def _sqrt(x: Value) -> Value:
    """The square root: exact for the square of a fraction, else rounded."""
    if x.fraction < 0:
        raise Refused("sqrt of a negative number")
    return _power(x, Value(Fraction(1, 2)))


def _round(x: Value, places: Value | None = None) -> Value:
    """To `places` decimal places (0 by default), halves away from zero as taught at school: round(2.5) = 3."""
    n = places.fraction if places is not None else Fraction(0)
    if n.denominator != 1 or abs(n) > MAX_DIGITS:
        raise Refused(f"round()'s places must be a whole number from -{MAX_DIGITS} to {MAX_DIGITS}")
    scale = Fraction(10) ** int(n)
    magnitude = math.floor(abs(x.fraction) * scale + Fraction(1, 2))
    return Value((magnitude if x.fraction >= 0 else -magnitude) / scale, x.exact)


def _extreme(pick: Callable) -> Callable[..., Value]:
    return lambda *values: Value(pick(v.fraction for v in values), all(v.exact for v in values))


@dataclass(frozen=True)
class Function:
    fn: Callable[..., Value]
    min_args: int
    max_args: int
    arity: str  # as an error text says it: "1 argument"


FUNCTIONS = {
    "sqrt": Function(_sqrt, 1, 1, "1 argument"),
    "abs": Function(lambda x: Value(abs(x.fraction), x.exact), 1, 1, "1 argument"),
    "round": Function(_round, 1, 2, "1 or 2 arguments"),
    "floor": Function(lambda x: Value(Fraction(math.floor(x.fraction)), x.exact), 1, 1, "1 argument"),
    "ceil": Function(lambda x: Value(Fraction(math.ceil(x.fraction)), x.exact), 1, 1, "1 argument"),
    "min": Function(_extreme(min), 1, 50, "1 to 50 arguments"),
    "max": Function(_extreme(max), 1, 50, "1 to 50 arguments"),
}


# --------------------------------------------------------------------------------------------
# Answers.


def show(value: Value) -> str:
    """The answer text of `value` (module docstring)."""
    fraction = value.fraction
    if not value.exact:
        return f"≈ {_rounded(fraction)}"
    if fraction.denominator == 1:
        return str(fraction.numerator)
    places = _decimal_places(fraction.denominator)
    if places is not None and places <= EXACT_DECIMAL_PLACES:
        whole = abs(fraction.numerator) * 10**places // fraction.denominator
        digits = str(whole).rjust(places + 1, "0")
        return f"{'-' if fraction < 0 else ''}{digits[:-places]}.{digits[-places:]}"
    return f"{fraction.numerator}/{fraction.denominator} ≈ {_rounded(fraction)}"


def _decimal_places(denominator: int) -> int | None:
    """How many places 1/denominator's decimal needs (denominator = 2^a 5^b: max(a, b)), or None when infinite."""
    twos = (denominator & -denominator).bit_length() - 1
    rest = denominator >> twos
    fives = 0
    while rest % 5 == 0:
        rest //= 5
        fives += 1
    return max(twos, fives) if rest == 1 else None


def _rounded(fraction: Fraction) -> str:
    with decimal.localcontext() as context:
        context.prec = SIGNIFICANT_DIGITS
        number = decimal.Decimal(fraction.numerator) / decimal.Decimal(fraction.denominator)
    number = number.normalize()
    return format(number, "f") if abs(number.adjusted()) < SIGNIFICANT_DIGITS else format(number, "e")
