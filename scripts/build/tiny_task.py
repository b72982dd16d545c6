"""The embedded task: generated Chinese grade-school word problems with 1-3 arithmetic steps.

Why generated: the shipped demo must run offline, and a model of about a million parameters
cannot do GSM8K. These problems keep GSM8K-zh's shape (a short story, a question, a worked
solution ending "#### N") and the swulling/gsm8k_chinese column names, so the same data code
serves both; but the numbers stay small (amounts below 20, prices, counts and factors below 10,
every worked result below 100; only a "k times as many" start, k x amount, and a 10/20/50/100
note paid in a shop go higher) and every division is exact, so a character-level model of a million
parameters learns the arithmetic in a few CPU minutes. (Measured with the same model, the same
1000-step SFT and HF's default init: amounts up to 99 and results up to 999 gave 25% greedy
accuracy, these ranges 50%. make_tiny_model.md has the details.)

Rows: {"question": English rendering, "question_zh-cn": the problem, "answer": one line per
step ("送后：17 - 4 = 13") then "#### N", "answer_only": N (int)}.

The mix runs from easy to hard (about 50% one step, 30% two, 20% three) so that a small model
starts partially right: the easy items give RL groups with some correct samples, the hard ones
leave headroom.

Everything is a pure function of the seed: `random.Random(seed)` is the only source of choices.

Build-time code, not part of the package: make_tiny_model.py (next to this file) writes the splits
to dapo_train/assets/tiny/data/, and the trainer only reads those files. The long task
(builtin:tiny-zh-math-long) comes from this same generator with its own templates and ranges:
tiny_task_long.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Noun:
    """A countable thing: 苹果 with measure word 个, sold in 筐 (baskets)."""

    zh: str
    measure: str
    en: str
    box_zh: str
    box_en: str

    @property
    def stuff_en(self) -> str:
        """"rope" for "meters of rope"; countable nouns are their own stuff."""
        return self.en.split(" of ")[-1]

    @property
    def unit_en(self) -> str:
        """"meter" for "meters of rope"; "" for countable nouns."""
        return self.en.split(" of ")[0][:-1] if " of " in self.en else ""


@dataclass(frozen=True)
class Receiver:
    """Who a share goes to: 同学 (each share is 每人) or 小组 (每组)."""

    zh: str
    per: str
    en: str


NAMES = (
    ("小明", "Xiaoming"), ("小红", "Xiaohong"), ("小华", "Xiaohua"), ("小丽", "Xiaoli"),
    ("小刚", "Xiaogang"), ("小芳", "Xiaofang"), ("小军", "Xiaojun"), ("小兰", "Xiaolan"),
    ("小东", "Xiaodong"), ("小美", "Xiaomei"), ("小杰", "Xiaojie"), ("小雪", "Xiaoxue"),
    ("王老师", "Teacher Wang"), ("李阿姨", "Aunt Li"), ("张叔叔", "Uncle Zhang"),
    ("妈妈", "Mom"), ("爸爸", "Dad"), ("奶奶", "Grandma"), ("爷爷", "Grandpa"),
)

NOUNS = tuple(Noun(*row) for row in (
    ("苹果", "个", "apples", "筐", "baskets"), ("橘子", "个", "oranges", "袋", "bags"),
    ("铅笔", "支", "pencils", "盒", "boxes"), ("蜡笔", "支", "crayons", "盒", "boxes"),
    ("本子", "本", "notebooks", "包", "packs"), ("故事书", "本", "storybooks", "套", "sets"),
    ("气球", "个", "balloons", "包", "packs"), ("糖果", "颗", "candies", "袋", "bags"),
    ("弹珠", "颗", "marbles", "罐", "jars"), ("邮票", "张", "stamps", "册", "albums"),
    ("贴纸", "张", "stickers", "版", "sheets"), ("鸡蛋", "个", "eggs", "盒", "cartons"),
    ("花", "朵", "flowers", "束", "bunches"), ("金鱼", "条", "goldfish", "缸", "tanks"),
    ("饼干", "块", "cookies", "盒", "boxes"), ("卡片", "张", "cards", "套", "sets"),
    ("玩具车", "辆", "toy cars", "箱", "crates"), ("乒乓球", "个", "ping-pong balls", "筒", "tubes"),
    ("绳子", "米", "meters of rope", "卷", "rolls"), ("彩带", "米", "meters of ribbon", "卷", "rolls"),
    ("大米", "千克", "kilograms of rice", "袋", "bags"), ("面粉", "千克", "kilograms of flour", "袋", "bags"),
    ("牛奶", "升", "liters of milk", "桶", "buckets"), ("果汁", "升", "liters of juice", "桶", "buckets"),
))

RECEIVERS = (
    Receiver("同学", "人", "classmates"), Receiver("小朋友", "人", "children"),
    Receiver("朋友", "人", "friends"), Receiver("小组", "组", "groups"),
)

# (zh clause, en clause, step label); {b} the amount, {o} another person, {m} the measure word.
GAINS = (
    ("又买了 {b} {m}", "buys {b} more", "买后"),
    ("又捡到了 {b} {m}", "finds {b} more", "捡后"),
    ("{o}又送来 {b} {m}", "gets {b} more from {o}", "送来后"),
)
LOSSES = (
    ("送给{o} {b} {m}", "gives {b} to {o}", "送后"),
    ("用掉了 {b} {m}", "uses {b}", "用后"),
    ("卖掉了 {b} {m}", "sells {b}", "卖后"),
    ("弄丢了 {b} {m}", "loses {b}", "丢后"),
)

STEP_WEIGHTS = (0.5, 0.3, 0.2)  # P(1 step), P(2 steps), P(3 steps): the easy-to-hard mix
MAX_AMOUNT = 19  # amounts given in a question: 1..19 (a start 5..19; "k times" starts k x 2..19)
MAX_FACTOR = 9  # boxes, prices, counts, divisors: 2..9
MAX_RESULT = 99  # every worked step's result: 1..99
NOTES = (10, 20, 50, 100)  # a shopper pays with the smallest note above the cost


class Rejected(Exception):
    """The sampled numbers break a rule (no exact division, a result out of range): resample."""


@dataclass
class Problem:
    """A problem being written: Chinese and English clauses, worked steps, the running value."""

    zh: list[str] = field(default_factory=list)
    en: list[str] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    value: int = 0
    max_result: int = MAX_RESULT

    def step(self, label: str, a: int, op: str, b: int, said: str = "") -> int:
        """Record one worked line "label：a op b = c" and return c (integer or Rejected).

        `said` restates the step's givens before the sum ("label：said，a op b = c"): the long task's
        worked style (tiny_task_long.py); concise() drops it again.
        """
        if op == "÷" and (b < 2 or a % b or a // b < 2):
            raise Rejected
        c = {"+": a + b, "-": a - b, "×": a * b, "÷": a // b if b else 0}[op]
        if not 0 < c <= self.max_result:
            raise Rejected
        self.steps.append(f"{label}：{said}，{a} {op} {b} = {c}" if said else f"{label}：{a} {op} {b} = {c}")
        return c

    def row(self, question_zh: str, question_en: str) -> dict:
        zh = "，".join(self.zh) + "。" + question_zh
        en = ". ".join(self.en) + ". " + question_en
        answer = "\n".join(self.steps) + f"\n#### {self.value}"
        return {"question": en, "question_zh-cn": zh, "answer": answer, "answer_only": self.value}


def _amount(rng: random.Random, low: int = 2, high: int = MAX_AMOUNT) -> int:
    return rng.randint(low, high)


def _factor(rng: random.Random, high: int = MAX_FACTOR) -> int:
    return rng.randint(2, high)


def _taken(rng: random.Random, have: int, high: int = MAX_AMOUNT) -> int:
    """An amount to take away from `have`: at most `high`, leaving at least 2 (1 when have is 2)."""
    return rng.randint(1, max(1, min(have - 2, high)))


def _divisor(rng: random.Random, value: int, high: int = MAX_FACTOR) -> int:
    """A divisor k of value with 2 <= k <= high and value / k >= 2, else Rejected."""
    choices = [k for k in range(2, high + 1) if value % k == 0 and value // k >= 2]
    if not choices:
        raise Rejected
    return rng.choice(choices)


def _move(
    rng: random.Random, p: Problem, index: int, who: tuple[str, str], other: tuple[str, str], measure: str,
    amount: Callable[[random.Random], int], taken: Callable[[random.Random, int], int], said: bool = False,
) -> None:
    """One gain or loss of a story: its clause in both languages ("然后" / "Then" after the first)
    and its worked step, restating the givens when `said` (the long task's style)."""
    (who_zh, who_en), (other_zh, other_en) = who, other
    gain = rng.random() < 0.5
    zh, en, label = rng.choice(GAINS if gain else LOSSES)
    b = amount(rng) if gain else taken(rng, p.value)
    zh = zh.format(b=b, o=other_zh, m=measure)
    p.zh.append(("然后" if index else "") + zh)
    p.en.append(f"Then {who_en} " + en.format(b=b, o=other_en))
    restated = f"{who_zh}有 {p.value} {measure}，{zh}" if said else ""
    p.value = p.step(label, p.value, "+" if gain else "-", b, said=restated)


def _story(rng: random.Random, n_steps: int) -> dict:
    """Someone starts with some things, gains or loses some, maybe shares them out.

    Steps: an optional "boxes x per box" start, 0-2 gains/losses, an optional exact share.
    """
    (who, who_en), (other, other_en) = rng.sample(NAMES, 2)
    noun = rng.choice(NOUNS)
    shapes = [(g, m, d) for g in (0, 1) for m in (0, 1, 2) for d in (0, 1) if g + m + d == n_steps]
    grouped, n_moves, share = rng.choice(shapes)
    p = Problem()
    if grouped:
        boxes, each = _factor(rng), _amount(rng)
        p.zh.append(f"{who}买了 {boxes} {noun.box_zh}{noun.zh}，每{noun.box_zh}有 {each} {noun.measure}")
        unit = f" {noun.unit_en}s" if noun.unit_en else ""
        p.en.append(f"{who_en} buys {boxes} {noun.box_en} of {noun.stuff_en}, {each}{unit} in each")
        p.value = p.step("一共", each, "×", boxes)
    else:
        p.value = _amount(rng, low=5)
        p.zh.append(f"{who}有 {p.value} {noun.measure}{noun.zh}")
        p.en.append(f"{who_en} has {p.value} {noun.en}")
    for index in range(n_moves):
        _move(rng, p, index, (who, who_en), (other, other_en), noun.measure, _amount, _taken)
    if not share:
        when = "现在" if n_moves else "一共"
        return p.row(f"{who}{when}有多少{noun.measure}{noun.zh}？", f"How many {noun.en} does {who_en} have now?")
    k = _divisor(rng, p.value)
    if rng.random() < 0.5:
        r = rng.choice(RECEIVERS)
        p.value = p.step(f"每{r.per}", p.value, "÷", k)
        return p.row(
            f"{who}把这些{noun.zh}平均分给 {k} 个{r.zh}，每{r.per}分到多少{noun.measure}？",
            f"{who_en} shares them equally among {k} {r.en}. How many does each get?",
        )
    p.value = p.step(f"{noun.box_zh}数", p.value, "÷", k)
    return p.row(
        f"{who}把这些{noun.zh}每 {k} {noun.measure}装一{noun.box_zh}，能装多少{noun.box_zh}？",
        f"{who_en} packs them into {noun.box_en} of {k}. How many {noun.box_en} are filled?",
    )


def _compare(rng: random.Random, n_steps: int) -> dict:
    """B has b more / fewer / k times / 1/k of what A has; ask B's amount (1 step) or the total (2)."""
    (a_zh, a_en), (b_zh, b_en) = rng.sample(NAMES, 2)
    noun = rng.choice(NOUNS)
    m, p = noun.measure, Problem()
    kind = rng.choice(("more", "fewer", "times", "part"))
    if kind == "part":
        k, share = _factor(rng), _amount(rng)
        p.value = k * share
    else:
        p.value = _amount(rng, low=5)
    p.zh.append(f"{a_zh}有 {p.value} {m}{noun.zh}")
    p.en.append(f"{a_en} has {p.value} {noun.en}")
    start = p.value
    if kind in ("more", "fewer"):
        d = _amount(rng) if kind == "more" else _taken(rng, start)
        word, op = ("多", "+") if kind == "more" else ("少", "-")
        p.zh.append(f"{b_zh}比{a_zh}{word} {d} {m}")
        p.en.append(f"{b_en} has {d} {kind} than {a_en}")
        p.value = p.step(b_zh, start, op, d)
    elif kind == "times":
        k = _factor(rng)
        p.zh.append(f"{b_zh}的{noun.zh}是{a_zh}的 {k} 倍")
        p.en.append(f"{b_en} has {k} times as many as {a_en}")
        p.value = p.step(b_zh, start, "×", k)
    else:
        p.zh.append(f"{a_zh}的{noun.zh}是{b_zh}的 {k} 倍")
        p.en.append(f"{a_en} has {k} times as many as {b_en}")
        p.value = p.step(b_zh, start, "÷", k)
    if n_steps == 1:
        return p.row(f"{b_zh}有多少{m}{noun.zh}？", f"How many {noun.en} does {b_en} have?")
    p.value = p.step("一共", start, "+", p.value)
    return p.row(f"{a_zh}和{b_zh}一共有多少{m}{noun.zh}？", f"How many {noun.en} do they have together?")


def _shopping(rng: random.Random, n_steps: int) -> dict:
    """Price x quantity; then the change from a note (2 steps) or a second item (3 steps)."""
    who, who_en = rng.choice(NAMES)
    first, second = rng.sample(NOUNS, 2)
    p = Problem()
    price, count = _factor(rng), _factor(rng)
    p.zh.append(f"一{first.measure}{first.zh} {price} 元，{who}买了 {count} {first.measure}")
    if first.unit_en:
        p.en.append(f"{first.stuff_en.capitalize()} costs {price} yuan per {first.unit_en}, and {who_en} buys {count}")
    else:
        p.en.append(f"{first.en.capitalize()} cost {price} yuan each, and {who_en} buys {count}")
    p.value = p.step(first.zh, price, "×", count)
    if n_steps == 1:
        return p.row("一共要付多少元？", "How many yuan does that cost?")
    if n_steps == 2:
        note = next(v for v in NOTES if v > p.value)
        p.zh.append(f"{who}付了 {note} 元")
        p.en.append(f"{who_en} pays with {note} yuan")
        p.value = p.step("找回", note, "-", p.value)
        return p.row("应找回多少元？", "How much change does " + who_en + " get?")
    spent = p.value
    price2, count2 = _factor(rng), _factor(rng)
    p.zh.append(f"又买了 {count2} {second.measure}{second.zh}，每{second.measure} {price2} 元")
    each = f"per {second.unit_en}" if second.unit_en else "each"
    p.en.append(f"Then {who_en} buys {count2} {second.en} at {price2} yuan {each}")
    p.value = p.step(second.zh, price2, "×", count2)
    p.value = p.step("一共", spent, "+", p.value)
    return p.row(f"{who}一共花了多少元？", f"How many yuan does {who_en} spend in all?")


# Kinds of problem by name, with the step counts each can make.
Templates = dict[str, tuple[Callable[[random.Random, int], dict], tuple[int, ...]]]
TEMPLATES: Templates = {
    "story": (_story, (1, 2, 3)),
    "compare": (_compare, (1, 2)),
    "shopping": (_shopping, (1, 2, 3)),
}


def _one_problem(rng: random.Random, step_weights: tuple[float, ...], templates: Templates) -> dict:
    """Draw a step count (step_weights[i] is P(i + 1 steps)), then a template that can make it;
    resample until the numbers fit."""
    while True:
        n_steps = rng.choices(range(1, len(step_weights) + 1), weights=step_weights)[0]
        names = [name for name, (_, counts) in templates.items() if n_steps in counts]
        make = templates[rng.choice(names)][0]
        try:
            return make(rng, n_steps)
        except Rejected:
            continue


def generate_problems(
    n: int, seed: int, step_weights: tuple[float, ...] = STEP_WEIGHTS, templates: Templates = TEMPLATES
) -> list[dict]:
    """n problems with distinct Chinese questions; the same (n, seed) always gives the same list."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < n:
        row = _one_problem(rng, step_weights, templates)
        if row["question_zh-cn"] not in seen:
            seen.add(row["question_zh-cn"])
            rows.append(row)
    return rows


def make_splits(
    seed: int = 0, n_train: int = 4000, n_test: int = 500,
    step_weights: tuple[float, ...] = STEP_WEIGHTS, templates: Templates = TEMPLATES,
) -> dict[str, list[dict]]:
    """Disjoint train and test splits (no question in both) drawn from one deduplicated pool."""
    rows = generate_problems(n_train + n_test, seed, step_weights, templates)
    return {"train": rows[n_test:], "test": rows[:n_test]}


def concise(answer: str) -> str:
    """A worked solution with each step's restatement dropped, the sums and the #### line kept:
    "买后：小明有 15 个，又买了 4 个，15 + 4 = 19" -> "买后：15 + 4 = 19"."""
    return "\n".join(
        line.split("：", 1)[0] + "：" + line.rsplit("，", 1)[1] if "，" in line else line for line in answer.split("\n")
    )
