"""Rule rewards: hand-computed values, the registry and import paths, and loud failures."""

import ast
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_train.config.load import load_config
from dapo_train.config.schema import RewardSpec
from dapo_train.errors import ConfigError, UserError
from dapo_train.rewards import REWARDS, RewardError, build_rewards, rules, score

GOOD = "<think>\n3 元一个，24 个：3×24=72\n</think>\n<answer>\n72\n</answer>"

# completion, gold, and the expected (correctness, accuracy, digit, hard_format, mark) values.
FORMAT_CASES = [
    # The taught format with a final newline: everything earned.
    (GOOD + "\n", 72, (2.0, 1.0, 0.5, 0.5, 0.5)),
    # No final newline (what decoding usually gives): everything earned too.
    (GOOD, 72, (2.0, 1.0, 0.5, 0.5, 0.5)),
    # Whitespace around the whole completion is fine.
    ("  \n" + GOOD + " \n\n", 72, (2.0, 1.0, 0.5, 0.5, 0.5)),
    # Chinese answer with unit, gold as a GSM8K solution: correct.
    (GOOD.replace("\n72\n", "\n答案是72元\n"), "So 72.\n#### 72", (2.0, 1.0, 0.5, 0.5, 0.5)),
    # Well formed but wrong: only the correctness pair changes.
    (GOOD.replace("\n72\n", "\n73\n"), 72, (0.0, -1.0, 0.5, 0.5, 0.5)),
    # A word instead of a number: no digit reward.
    (GOOD.replace("\n72\n", "\nseventy-two\n"), 72, (0.0, -1.0, 0.0, 0.5, 0.5)),
    # Tags without their newlines: the answer still counts, no format reward and no marks.
    ("<think>3×24</think><answer>72</answer>", 72, (2.0, 1.0, 0.5, 0.0, 0.0)),
    # 5 characters after </answer>: hard_format fails, mark loses 5 * 0.001.
    (GOOD + "\nextra", 72, (2.0, 1.0, 0.5, 0.0, 0.495)),
    # A long tail costs at most the 0.125 that the closing tag earned: 0.5 - 0.125.
    (GOOD + "\n" + "x" * 1000, 72, (2.0, 1.0, 0.5, 0.0, 0.375)),
    # Answer block never closed: no answer, no format; marks for the 3 tags present = 0.375.
    (GOOD.rpartition("\n</answer>")[0], 72, (0.0, -1.0, 0.0, 0.0, 0.375)),
    # Two answer blocks: the two answer marks are not "exactly once", leaving 2 * 0.125.
    (GOOD + "\n<answer>\n72\n</answer>", 72, (2.0, 1.0, 0.5, 0.5, 0.25)),
    ("", 72, (0.0, -1.0, 0.0, 0.0, 0.0)),
]
NAMES = ("correctness", "accuracy", "digit", "hard_format", "mark")


@pytest.mark.parametrize("completion, gold, expected", FORMAT_CASES, ids=range(len(FORMAT_CASES)))
def test_rule_rewards_table(completion, gold, expected):
    for name, value in zip(NAMES, expected):
        got = REWARDS[name].fn([completion], [gold])
        assert got == pytest.approx([value]), name


# The shape hard_format accepts, as the regex the seed trainer (docs/peers.md) used, its "\n$" end relaxed to
# surrounding whitespace: the reference the linear-time check must agree with.
SEED_FORMAT = re.compile(r"\s*<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\s*", re.DOTALL)
FORMAT_PIECES = ["<think>\n", "\n</think>\n<answer>\n", "\n</answer>", "\n", " ", "7", "<think>", "</answer>\n"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FORMAT_PIECES), max_size=8).map("".join))
def test_hard_format_is_the_seed_regex_with_free_surrounding_whitespace(text):
    assert REWARDS["hard_format"].fn([text], [0]) == [0.5 if SEED_FORMAT.fullmatch(text) else 0.0]


# 600 repeats of the tag sequence, the degenerate output a lazy ".*?" pair backtracks over pair by pair.
REPEATED_TAGS = "<think>\n" + "\n</think>\n<answer>\n72\n</answer>" * 600


@pytest.mark.parametrize(
    "text, hard_format",
    [
        # Head first and tail last: the shape holds, the answer ".*?" spanning the other 599 blocks.
        (REPEATED_TAGS, 0.5),
        # Text after the last </answer>: not the shape.
        (REPEATED_TAGS + "\nfoo", 0.0),
    ],
)
def test_format_rewards_on_degenerate_repetition(text, hard_format):
    assert REWARDS["hard_format"].fn([text], [72]) == [hard_format]
    # Only "<think>\n" appears exactly once: 0.125; </answer> is not unique, so no trailing cost either.
    assert REWARDS["mark"].fn([text], [72]) == [0.125]
    assert REWARDS["correctness"].fn([text], [72]) == [2.0]  # the last closed block holds 72
    assert REWARDS["digit"].fn([text], [72]) == [0.5]


def test_the_format_rewards_use_no_regex():
    """hard_format and mark are decided with str.find / count / startswith, one pass each over the
    text, so no regex can backtrack there (the answer-extraction regexes, which correctness and
    digit use, are checked for backtracking shapes in test_answers)."""
    modules = set()
    for node in ast.walk(ast.parse(Path(rules.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module)
    assert "dapo_train.task.answers" in modules  # the walk sees the module's imports
    assert not modules & {"re", "regex"}


def reward_set(*specs, max_new_tokens=100):
    return build_rewards([RewardSpec(**spec) for spec in specs], max_new_tokens=max_new_tokens)


def test_overlong_follows_eq13_with_max_length_from_the_rollout():
    rewards = reward_set({"name": "overlong", "args": {"cache_length": 20}})  # L_max = 100, L_cache = 20
    scores = score(rewards, ["a"] * 5, [1] * 5, lengths=[10, 80, 90, 100, 120])
    # <= 80 free; 90 is halfway into the buffer: (80 - 90) / 20 = -0.5; at and past 100: -1.
    assert scores.per_reward["overlong"] == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_overlong_args_override_max_length():
    rewards = reward_set({"name": "overlong", "args": {"cache_length": 10, "max_length": 50}})
    # threshold 40: length 45 -> (40 - 45) / 10 = -0.5, although rollout.max_new_tokens is 100.
    assert score(rewards, ["a"], [1], lengths=[45]).per_reward["overlong"] == pytest.approx([-0.5])


def test_a_fractional_cache_length_follows_the_budget():
    """cache_length 0.25 is the last quarter of L_max: 20 of 80 tokens, then 8 of 32 when the budget
    shrinks, with no second edit; a token count that no longer fits names both ways out."""
    for budget, lengths, expected in ((80, [60, 70, 80], [0.0, -0.5, -1.0]), (32, [24, 28, 32], [0.0, -0.5, -1.0])):
        rewards = reward_set({"name": "overlong", "args": {"cache_length": 0.25}}, max_new_tokens=budget)
        assert score(rewards, ["a"] * 3, [1] * 3, lengths=lengths).per_reward["overlong"] == pytest.approx(expected)
    with pytest.raises(ConfigError, match="cache_length=32, max_length=24.*fraction of L_max"):
        reward_set({"name": "overlong", "args": {"cache_length": 32}}, max_new_tokens=24)
    with pytest.raises(ConfigError, match="0 < cache_length < 1"):
        reward_set({"name": "overlong", "args": {"cache_length": 1.5}})


def test_overlong_without_lengths_fails_loudly():
    rewards = reward_set({"name": "overlong", "args": {"cache_length": 20}})
    with pytest.raises(RewardError, match="reward 'overlong'.*token lengths"):
        score(rewards, ["a"], [1], lengths=None)


def test_total_is_the_weighted_sum_and_correct_bits_are_strict():
    rewards = reward_set(
        {"name": "accuracy", "weight": 1.0},
        {"name": "correctness", "weight": 0.5},
        {"name": "overlong", "weight": 1.0, "args": {"cache_length": 20}},
    )
    completions = [GOOD, GOOD.replace("\n72\n", "\n70\n"), "答案是72"]
    scores = score(completions=completions, answers=[72, 72, 72], lengths=[90, 50, 10], reward_set=rewards)
    # 1: +1 + 0.5 * 2 + (-0.5) = 1.5; 2: -1 + 0 + 0 = -1; 3 (no answer block, strict): -1.
    assert scores.total == pytest.approx([1.5, -1.0, -1.0])
    assert scores.per_reward == {
        "accuracy": [1.0, -1.0, -1.0],
        "correctness": [2.0, 0.0, 0.0],
        "overlong": [-0.5, 0.0, 0.0],
    }
    assert scores.correct == [True, False, False]


def test_correct_bits_without_a_correctness_reward_and_repeated_names():
    rewards = reward_set({"name": "digit", "weight": 2.0}, {"name": "digit", "weight": -1.0})
    scores = score(rewards, [GOOD, "no"], ["#### 72", "#### 72"])
    assert list(scores.per_reward) == ["digit", "digit_2"]
    assert scores.total == pytest.approx([0.5, 0.0])  # 2 * 0.5 - 1 * 0.5 for the first
    assert scores.correct == [True, False]


def test_rewards_from_yaml(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(
        "rollout:\n  max_new_tokens: 64\n"
        "rewards:\n  - {name: correctness, weight: 1.0}\n  - {name: overlong, weight: 0.5, args: {cache_length: 16}}\n"
    )
    cfg = load_config(str(path), [])
    rewards = build_rewards(cfg.rewards, max_new_tokens=cfg.rollout.max_new_tokens)
    assert rewards.keys == ["correctness", "overlong"]
    # length 56 is halfway into the 16-token buffer before 64: 2.0 + 0.5 * (-0.5) = 1.75.
    assert score(rewards, [GOOD], [72], lengths=[56]).total == pytest.approx([1.75])


PLUGIN = """
import math

def bonus(completions, answers, *, lengths=None, prompts=None, amount=1.0):
    return [amount * len(p) for p in prompts]

def loose(completions, answers, **kwargs):
    return np.ones(len(completions))

def wrong_signature(completion):
    return [0.0]

NOT_A_FUNCTION = 3

def raises_on_boom(completions, answers, *, lengths=None, prompts=None):
    return [1.0 / ("boom" not in text) for text in completions]

def returns_none(completions, answers, **kwargs):
    return None

def nan_for_second(completions, answers, **kwargs):
    return [0.0, math.nan] + [0.0] * (len(completions) - 2)

def too_short(completions, answers, **kwargs):
    return [0.0]

def scalar(completions, answers, **kwargs):
    return np.array(1.0)

def words(completions, answers, **kwargs):
    return ["high" for _ in completions]
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("import numpy as np\n" + textwrap.dedent(PLUGIN))
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('plugin bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_custom_reward_by_import_path_gets_its_args_and_prompts(plugin):
    rewards = reward_set(
        {"name": f"{plugin}:bonus", "weight": 2.0, "args": {"amount": 0.5}}, {"name": f"{plugin}:loose"}
    )
    assert rewards.keys == ["bonus", "loose"]  # import paths are keyed by function name
    scores = score(rewards, ["a", "b"], [1, 2], prompts=["abcd", ""])
    # bonus = 0.5 * len(prompt) -> [2, 0]; total = 2 * bonus + 1 (loose returns a numpy array of ones)
    assert scores.total == pytest.approx([5.0, 1.0])


@pytest.mark.parametrize(
    "spec, key, message",
    [
        ({"name": "acuracy"}, "rewards.0.name", r"unknown reward 'acuracy'; did you mean 'accuracy'\?.*correctness"),
        ({"name": "no_such_module_xyz:f"}, "rewards.0.name", "cannot import module 'no_such_module_xyz'"),
        ({"name": "broken_rewards:f"}, "rewards.0.name", "importing 'broken_rewards' failed: RuntimeError: plugin bug"),
        ({"name": "my_rewards:missing"}, "rewards.0.name", "has no attribute 'missing'"),
        ({"name": "my_rewards:NOT_A_FUNCTION"}, "rewards.0.name", r"is not a function but 3 \(int\)"),
        ({"name": "my_rewards:wrong_signature"}, "rewards.0.name", r"does not accept \(completions, answers"),
        ({"name": "accuracy", "args": {"scale": 2}}, "rewards.0.args", "unexpected keyword argument 'scale'"),
        ({"name": "overlong"}, "rewards.0.args", "missing a required argument: 'cache_length'"),
        ({"name": "overlong", "args": {"cache_length": 200}}, "rewards.0.args", "cache_length < max_length"),
        ({"name": "overlong", "args": {"cache_length": 100}}, "rewards.0.args", "cache_length < max_length"),
        ({"name": "accuracy", "weight": float("nan")}, "rewards.0.weight", "finite"),
        ({"name": "overlong", "args": {"cache_length": "32"}}, "rewards.0.args", "integer token counts"),
    ],
)
def test_config_errors_name_the_key_and_the_problem(plugin, spec, key, message):
    with pytest.raises(ConfigError, match=message) as info:
        reward_set(spec)
    assert info.value.key == key
    assert isinstance(info.value, UserError)  # the CLI prints it as one line, exit code 2


def test_second_reward_is_named_by_its_index(plugin):
    with pytest.raises(ConfigError) as info:
        reward_set({"name": "accuracy"}, {"name": "digt"})
    assert info.value.key == "rewards.1.name"


def test_no_rewards_is_a_config_error():
    with pytest.raises(ConfigError, match="no reward configured"):
        build_rewards([], max_new_tokens=10)


@pytest.mark.parametrize(
    "function, message",
    [
        ("raises_on_boom", r"reward 'raises_on_boom' raised ZeroDivisionError.*completion 1: 'boom here'"),
        ("returns_none", "reward 'returns_none' returned NoneType instead of a list"),
        ("nan_for_second", "reward 'nan_for_second' returned nan on completion 1: 'boom here'"),
        ("scalar", "reward 'scalar' returned ndarray instead of a list of floats"),
        ("too_short", r"reward 'too_short' returned 1 values for 3 completions on the batch \(first: 'fine'\)"),
        ("words", "reward 'words' returned 'high' \\(not a number\\) on completion 0: 'fine'"),
    ],
)
def test_bad_reward_output_fails_naming_reward_and_completion(plugin, function, message):
    rewards = reward_set({"name": f"{plugin}:{function}"})
    with pytest.raises(RewardError, match=message):
        score(rewards, ["fine", "boom here", "ok"], [1, 2, 3])


def test_error_message_truncates_the_completion(plugin):
    rewards = reward_set({"name": f"{plugin}:raises_on_boom"})
    with pytest.raises(RewardError) as info:
        score(rewards, ["boom" + "x" * 10_000], [1])
    message = str(info.value)
    assert "\n" not in message and len(message) < 400


def test_mismatched_columns_are_a_bug_not_a_reward_error():
    rewards = reward_set({"name": "accuracy"})
    with pytest.raises(ValueError, match="2 answers for 1 completions"):
        score(rewards, ["a"], [1, 2])


def test_registered_rewards_never_raise_on_adversarial_text():
    texts = ["", "<answer>", "\x00\ufffd" * 5000, "<think>\n" * 3000, "</answer>\n" * 3000, "9" * 20_000]
    for name in ("correctness", "accuracy", "digit", "hard_format", "mark"):
        values = REWARDS[name].fn(texts, [72] * len(texts))
        assert len(values) == len(texts) and all(np.isfinite(values)), name


def test_builtin_registry_names():
    assert set(REWARDS) >= {"correctness", "accuracy", "digit", "hard_format", "mark", "overlong"}
    rewards = reward_set({"name": "accuracy"}, {"name": "overlong", "args": {"cache_length": 5}}, max_new_tokens=7)
    assert np.array_equal(score(rewards, ["x"], [0], lengths=[7]).total, [-2.0])  # -1 wrong, -1 at L_max
    assert isinstance(RewardError("x"), UserError)


# Transcripts as the rollout decodes them (tools/turns.py): calls, then the template's tool turn.
CALL_OK = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 × 24"}}\n</tool_call>'
CALL_STRING_ARGS = '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
REPLY = "\nuser\n<tool_response>\n72\n</tool_response>\nassistant\n"


@pytest.mark.parametrize("text, expected", [
    ("<think>\n72\n</think>", 0.0),                                         # no call: nothing to score
    (CALL_OK + REPLY + "答案：72", 0.25),                                    # well formed
    (CALL_STRING_ARGS + REPLY, 0.25),                                       # arguments as a JSON string
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 ÷ 0"}}\n</tool_call>'
     "\nuser\n<tool_response>\nerror: division by zero\n</tool_response>", 0.25),  # the tool's own error: not format
    (CALL_OK + REPLY + '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}\n</tool_call>', -1.0),
    ('<tool_call>\n["calculator"]\n</tool_call>', -1.0),                    # JSON, but not an object
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', -1.0),                 # no name
    ('<tool_call>\n{"name": "calculator", "arguments": [1]}\n</tool_call>', -1.0),  # arguments not an object
    ('<tool_call>\n{"name": "calculator", "arguments": "{1"}\n</tool_call>', -1.0),  # arguments string not JSON
    ("<tool_call>\n" + "[" * 5000 + "\n</tool_call>", -1.0),               # too deep for json.loads: malformed
    ("<tool_call>\n{\"name\": \"calculator\"", 0.0),                       # never closed: the rollout read no call
])
def test_tool_format_punishes_calls_the_rollout_cannot_parse(text, expected):
    """well_formed 0.25, malformed -1: a completion with any malformed call gets -1, one whose calls are all
    objects with a name and object arguments gets 0.25, one without calls 0."""
    assert REWARDS["tool_format"].fn([text], [72], well_formed=0.25, malformed=-1.0) == [expected]


def test_tool_format_defaults_only_punish():
    rewards = reward_set({"name": "tool_format"})
    texts = [CALL_OK + REPLY, "72", '<tool_call>\nnot json\n</tool_call>']
    assert score(rewards, texts, [72] * 3, lengths=[1] * 3).per_reward["tool_format"] == [0.0, 0.0, -0.5]
    with pytest.raises(ConfigError, match="tool_format's malformed must be a finite number"):
        reward_set({"name": "tool_format", "args": {"malformed": "much"}})
