"""The long embedded task (builtin:tiny-zh-math-long): 3-6 step word problems whose worked
solutions restate each step's givens before its sum.

Why: on the short task no completion reaches the 96-token budget, so overlong filtering and the
soft overlong punishment (Eq. 13) have nothing to act on. Here a worked line reads
"买后：小明有 15 个，又买了 4 个，15 + 4 = 19" (about 32 tokens) where its concise form,
"买后：15 + 4 = 19" (tiny_task.concise), has about 15: a six-step solution runs about 200 tokens
written out and about 100 concise. At a budget of 128 new tokens the written-out solutions of
four steps and more are cut, their concise forms fit: a shorter correct solution always exists.

Same generator and vocabulary as tiny_task.py, exact division, the same GSM8K-zh columns (the
rows' `answer` holds the written-out solution), but smaller numbers (below) and no problem shorter
than three steps.
Every character is one the shipped tiny tokenizer has as one token (a test checks it), so the
long warm start (make_tiny_model.py --recipe tiny-long) continues from the tiny model's weights.
"""

from __future__ import annotations

import random

import tiny_task
from tiny_task import NAMES, NOTES, NOUNS, RECEIVERS, Templates, make_splits

# P(1 step) .. P(6 steps): none shorter than three.
LONG_STEP_WEIGHTS = (0.0, 0.0, 0.25, 0.3, 0.25, 0.2)
# Smaller numbers than the short task's, so that a chain of up to six sums stays within what the
# tiny model can learn: a start or a person's amount 5..20, amounts added or taken 1..9, boxes,
# prices, counts and factors 2..5 (3..6 things per box), every worked result at most 50.
MAX_START = 20
MAX_AMOUNT = 9
MAX_FACTOR = 5
MAX_RESULT = 50


def _problem() -> tiny_task.Problem:
    return tiny_task.Problem(max_result=MAX_RESULT)


def _start(rng: random.Random) -> int:
    return tiny_task._amount(rng, 5, MAX_START)


def _amount(rng: random.Random) -> int:
    return tiny_task._amount(rng, 1, MAX_AMOUNT)


def _factor(rng: random.Random) -> int:
    return tiny_task._factor(rng, MAX_FACTOR)


def _taken(rng: random.Random, have: int) -> int:
    return tiny_task._taken(rng, have, MAX_AMOUNT)


def _divisor(rng: random.Random, value: int) -> int:
    return tiny_task._divisor(rng, value, MAX_FACTOR)


def _story(rng: random.Random, n_steps: int) -> dict:
    """Someone starts with some things (maybe boxes x per box), gains or loses some 1-4 times,
    maybe shares them out exactly."""
    (who, who_en), (other, other_en) = rng.sample(NAMES, 2)
    noun = rng.choice(NOUNS)
    m = noun.measure
    shapes = [(g, n, d) for g in (0, 1) for n in range(1, 5) for d in (0, 1) if g + n + d == n_steps]
    grouped, n_moves, share = rng.choice(shapes)
    p = _problem()
    if grouped:
        boxes, each = _factor(rng), _factor(rng) + 1
        given = f"{who}买了 {boxes} {noun.box_zh}{noun.zh}，每{noun.box_zh}有 {each} {m}"
        p.zh.append(given)
        unit = f" {noun.unit_en}s" if noun.unit_en else ""
        p.en.append(f"{who_en} buys {boxes} {noun.box_en} of {noun.stuff_en}, {each}{unit} in each")
        p.value = p.step("一共", each, "×", boxes, said=given.replace(noun.zh, "", 1))
    else:
        p.value = _start(rng)
        p.zh.append(f"{who}有 {p.value} {m}{noun.zh}")
        p.en.append(f"{who_en} has {p.value} {noun.en}")
    for index in range(n_moves):
        tiny_task._move(rng, p, index, (who, who_en), (other, other_en), m, _amount, _taken, said=True)
    if not share:
        return p.row(f"{who}现在有多少{m}{noun.zh}？", f"How many {noun.en} does {who_en} have now?")
    k = _divisor(rng, p.value)
    if rng.random() < 0.5:
        r = rng.choice(RECEIVERS)
        p.value = p.step(f"每{r.per}", p.value, "÷", k, said=f"把 {p.value} {m}平均分给 {k} 个{r.zh}")
        return p.row(
            f"{who}把这些{noun.zh}平均分给 {k} 个{r.zh}，每{r.per}分到多少{m}？",
            f"{who_en} shares them equally among {k} {r.en}. How many does each get?",
        )
    p.value = p.step(f"{noun.box_zh}数", p.value, "÷", k, said=f"{p.value} {m}每 {k} {m}装一{noun.box_zh}")
    return p.row(
        f"{who}把这些{noun.zh}每 {k} {m}装一{noun.box_zh}，能装多少{noun.box_zh}？",
        f"{who_en} packs them into {noun.box_en} of {k}. How many {noun.box_en} are filled?",
    )


def _shopping(rng: random.Random, n_steps: int) -> dict:
    """Two or three kinds of things at price x count each, their total, maybe the change from the
    smallest note above it: 3 to 6 steps."""
    who, who_en = rng.choice(NAMES)
    n_items = 2 if n_steps <= 4 else 3
    p = _problem()
    costs = []
    for index, noun in enumerate(rng.sample(NOUNS, n_items)):
        price, count = _factor(rng), _factor(rng)
        m = noun.measure
        if index == 0:
            p.zh.append(f"一{m}{noun.zh} {price} 元，{who}买了 {count} {m}")
        else:
            p.zh.append(f"又买了 {count} {m}{noun.zh}，每{m} {price} 元")
        each = f"per {noun.unit_en}" if noun.unit_en else "each"
        p.en.append(f"{who_en} buys {count} {noun.en} at {price} yuan {each}")
        said = f"一{m}{noun.zh} {price} 元，买了 {count} {m}"
        costs.append((noun.zh, p.step(noun.zh, price, "×", count, said=said)))
    (first, total), (second, cost) = costs[:2]
    p.value = p.step("一共", total, "+", cost, said=f"{first} {total} 元，{second} {cost} 元")
    for name, cost in costs[2:]:
        p.value = p.step("一共", p.value, "+", cost, said=f"再付{name}的 {cost} 元")
    if n_steps in (3, 5):
        return p.row(f"{who}一共花了多少元？", f"How many yuan does {who_en} spend in all?")
    note = next(v for v in NOTES if v > p.value)
    p.zh.append(f"{who}付了 {note} 元")
    p.en.append(f"{who_en} pays with {note} yuan")
    p.value = p.step("找回", note, "-", p.value, said=f"付了 {note} 元，要付 {p.value} 元")
    return p.row("应找回多少元？", f"How much change does {who_en} get?")


def _relation(
    rng: random.Random, p: tiny_task.Problem, noun: tiny_task.Noun, before: tuple[str, str], after: tuple[str, str]
) -> int:
    """`after` has d more / d fewer / k times / 1/k of what `before` has (p.value): one worked step."""
    (a_zh, a_en), (b_zh, b_en) = before, after
    m, start = noun.measure, p.value
    kind = rng.choice(("more", "fewer", "times", "part"))
    if kind in ("more", "fewer"):
        d = _amount(rng) if kind == "more" else _taken(rng, start)
        clause = f"{b_zh}比{a_zh}{'多' if kind == 'more' else '少'} {d} {m}"
        said = clause
        p.en.append(f"{b_en} has {d} {kind} than {a_en}")
        op = "+" if kind == "more" else "-"
    elif kind == "times":
        d = _factor(rng)
        clause = f"{b_zh}的{noun.zh}是{a_zh}的 {d} 倍"
        said = f"{b_zh}是{a_zh}的 {d} 倍"
        p.en.append(f"{b_en} has {d} times as many as {a_en}")
        op = "×"
    else:
        d = _divisor(rng, start)
        clause = f"{a_zh}的{noun.zh}是{b_zh}的 {d} 倍"
        said = f"{a_zh}是{b_zh}的 {d} 倍"
        p.en.append(f"{a_en} has {d} times as many as {b_en}")
        op = "÷"
    p.zh.append(clause)
    return p.step(b_zh, start, op, d, said=said)


def _compare(rng: random.Random, n_steps: int) -> dict:
    """A chain of 3 or 4 people, each compared with the one before; ask the last one's amount
    (3 steps) or everyone's total (4 or 6 steps)."""
    people = rng.sample(NAMES, 3 if n_steps == 4 else 4)
    noun = rng.choice(NOUNS)
    m, p = noun.measure, _problem()
    p.value = _start(rng)
    p.zh.append(f"{people[0][0]}有 {p.value} {m}{noun.zh}")
    p.en.append(f"{people[0][1]} has {p.value} {noun.en}")
    amounts = [p.value]
    for before, after in zip(people, people[1:]):
        p.value = _relation(rng, p, noun, before, after)
        amounts.append(p.value)
    last_zh, last_en = people[-1]
    if n_steps == 3:
        return p.row(f"{last_zh}有多少{m}{noun.zh}？", f"How many {noun.en} does {last_en} have?")
    said = f"{people[0][0]}有 {amounts[0]} {m}，{people[1][0]}有 {amounts[1]} {m}"
    p.value = p.step("一共", amounts[0], "+", amounts[1], said=said)
    for (name, _), amount in zip(people[2:], amounts[2:]):
        p.value = p.step("一共", p.value, "+", amount, said=f"{name}有 {amount} {m}")
    together = "、".join(name for name, _ in people[:-1]) + "和" + last_zh
    return p.row(f"{together}一共有多少{m}{noun.zh}？", f"How many {noun.en} do they have together?")


LONG_TEMPLATES: Templates = {
    "story": (_story, (3, 4, 5, 6)),
    "shopping": (_shopping, (3, 4, 5, 6)),
    "compare": (_compare, (3, 4, 6)),
}


def make_long_splits(seed: int = 0, n_train: int = 4000, n_test: int = 500) -> dict[str, list[dict]]:
    """The long task's train and test splits (tiny_task.make_splits with the long templates)."""
    return make_splits(seed, n_train, n_test, LONG_STEP_WEIGHTS, LONG_TEMPLATES)
