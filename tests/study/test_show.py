"""`dapo-train show`: which records the filters pick (flags, comparisons, rewards.<key>, tool calls), the step
files read (a file cut short: its whole records), the text and JSON forms with tool turns marked, and one-line
errors for what cannot be read."""

import json

import pytest

from dapo_train.errors import UserError
from dapo_train.run.rollouts import write_rollouts
from dapo_train.study.show import parse_where, show


def _record(step, group, sample, fate, reward, *, correct=False, truncated=False, overlong=0.0, ratio=None):
    return {
        "step": step, "round": 1, "group": group, "sample": sample, "uid": f"train:{group}",
        "question": f"question {group}", "gold": "7", "completion": f"line one\nanswer {group}.{sample}",
        "length": 30 + sample, "truncated": truncated, "extracted": "7" if correct else "8", "correct": correct,
        "rewards": {"accuracy": 1.0 if correct else -1.0, "overlong": overlong}, "reward": reward, "advantage": 0.0,
        "fate": fate, "behaviour_logprob_mean": -0.5, "ratio_mean": ratio, "clip_frac": None if ratio is None else 0.0,
        "tool_calls": [], "over_calls": False, "tool_turn_spans": [],
    }


STEP_2 = [
    _record(2, 0, 0, "trained", 1.0, correct=True, ratio=1.0),
    _record(2, 0, 1, "trained", -1.5, truncated=True, overlong=-0.5, ratio=1.1),
    _record(2, 1, 0, "dropped_all_wrong", -1.0),
    _record(2, 1, 1, "dropped_all_wrong", -1.0),
]


@pytest.fixture
def run(tmp_path):
    write_rollouts(tmp_path, 1, [_record(1, 0, 0, "carried", 1.0, correct=True)])
    write_rollouts(tmp_path, 2, STEP_2)
    return tmp_path


def _picked(expression: str) -> list[tuple[int, int]]:
    keep = parse_where(expression, {"accuracy", "overlong"})
    return [(r["group"], r["sample"]) for r in STEP_2 if keep(r)]


def test_where_terms_are_flags_comparisons_and_all_must_hold():
    assert _picked("dropped") == [(1, 0), (1, 1)]
    assert _picked("!dropped") == _picked("not dropped") == _picked("trained") == [(0, 0), (0, 1)]
    assert _picked("truncated") == [(0, 1)] and _picked("correct") == [(0, 0)]
    assert _picked("reward<0") == [(0, 1), (1, 0), (1, 1)]
    assert _picked("reward<-1") == [(0, 1)] and _picked("reward<=-1") == [(0, 1), (1, 0), (1, 1)]
    assert _picked("reward<0, !truncated") == [(1, 0), (1, 1)]
    assert _picked("rewards.overlong<0") == [(0, 1)]
    assert _picked("fate=dropped_all_wrong") == _picked("dropped_all_wrong") == [(1, 0), (1, 1)]
    assert _picked("extracted=7") == [(0, 0)] and _picked("extracted!=7") == [(0, 1), (1, 0), (1, 1)]
    assert _picked("correct=false") == [(0, 1), (1, 0), (1, 1)]
    assert _picked("ratio_mean>1.05") == [(0, 1)]  # a record without a ratio (None) never passes an ordering
    assert _picked("ratio_mean=null") == [(1, 0), (1, 1)]


@pytest.mark.parametrize("expression, message", [
    ("bogus<1", "no record field 'bogus'; fields: step, round"),
    ("rewards.nope<0", "no record field 'rewards.nope'"),
    ("reward<high", "needs a number"),
    ("maybe", "cannot read 'maybe'"),
    (" , ", "empty expression"),
])
def test_a_term_that_cannot_be_read_is_one_error(expression, message):
    with pytest.raises(UserError, match=message):
        parse_where(expression, {"accuracy", "overlong"})


def test_the_last_step_shows_by_default_grouped_with_each_completion_in_full(run):
    text = show(str(run))
    lines = text.splitlines()
    assert lines[0] == "step 2: 4 completions of 2 sampled groups (trained 1, dropped_all_wrong 1)"
    assert lines[2] == "step 2, round 1, group 0: train:0, gold 7 -- trained: trained this step"
    assert lines[3] == "  question: question 0"
    assert lines[4] == ("  [0] reward 1.000 (accuracy 1.000, overlong 0.000), advantage 0.000; got 7 (correct), "
                        "30 tokens, behaviour log-prob -0.500/token, ratio 1.0000, clipped 0.000")
    assert lines[5:7] == ["      line one", "      answer 0.0"]
    assert "truncated" in lines[7] and text.count("question: ") == 2  # a group's question once
    assert "group 1: train:1, gold 7 -- dropped_all_wrong: every completion wrong (Eq. 11)" in text


def test_filters_limits_steps_and_json(run):
    head = show(str(run), where="dropped", limit=1).splitlines()[0]
    assert head.endswith("; 2 match 'dropped'; showing 1 (--limit)")
    rows = [json.loads(line) for line in show(str(run), step="all", where="correct", as_json=True).splitlines()]
    assert [(r["step"], r["fate"]) for r in rows] == [(1, "carried"), (2, "trained")]
    assert show(str(run), step="1", limit=0).splitlines()[0].startswith("step 1: 1 completion of 1 sampled group")
    assert show(str(run), where="reward>5").splitlines() == [
        "step 2: 4 completions of 2 sampled groups (trained 1, dropped_all_wrong 1); 0 match 'reward>5'"]


@pytest.mark.parametrize("args, message", [
    ({"step": "3"}, r"--step 3: no rollouts/step_3.jsonl in .*; steps with records: 1-2"),
    ({"step": "last"}, "give a step number or 'all'"),
    ({"limit": -1}, "must be >= 0"),
])
def test_bad_arguments_are_one_error(run, args, message):
    with pytest.raises(UserError, match=message):
        show(str(run), **args)


def test_a_folder_without_records_says_why(tmp_path):
    with pytest.raises(UserError, match="no such run folder"):
        show(str(tmp_path / "nope"))
    with pytest.raises(UserError, match=r"is not a run folder \(no config.yaml\); give the output_dir of a run"):
        show(str(tmp_path))
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(UserError, match=r"holds no rollout records .*logging.rollout_groups=0"):
        show(str(tmp_path))


def test_terms_join_with_and_and_negative_numbers_compare():
    """Issue 38: 'reward < -0.5 and truncated' said -0.5 "needs a number" (the word and was read as part of it)."""
    assert _picked("reward < -0.5 and truncated") == _picked("reward<-0.5,truncated") == [(0, 1)]
    assert _picked("reward <= -1 and dropped and !correct") == [(1, 0), (1, 1)]
    with pytest.raises(UserError, match=r"'reward < -0.5 truncated' compares with <, which needs a number, not "
                                        r"'-0.5 truncated'; join terms with ',' or 'and'"):
        parse_where("reward < -0.5 truncated", {"accuracy"})


def test_json_prints_every_match_unless_limited(tmp_path):
    """Issue 38: --json stopped at the text form's 20 completions without a sign; a script gets all of them."""
    records = [_record(1, group, sample, "trained", 0.5) for group in range(5) for sample in range(6)]
    write_rollouts(tmp_path, 1, records)
    assert len(show(str(tmp_path), as_json=True).splitlines()) == 30
    assert len(show(str(tmp_path), as_json=True, limit=7).splitlines()) == 7
    assert show(str(tmp_path)).splitlines()[0].endswith("; showing 20 (--limit)")


def test_show_on_a_checkpoint_names_its_run(tmp_path):
    write_rollouts(tmp_path, 1, STEP_2)
    (tmp_path / "checkpoint_1").mkdir()
    (tmp_path / "checkpoint_1" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(UserError, match=r"checkpoint_1 is a checkpoint folder; show reads its run's rollouts: "
                                        f"dapo-train show {tmp_path}$"):
        show(str(tmp_path / "checkpoint_1"))


def test_a_completion_that_called_tools_shows_each_call_and_its_answer(tmp_path):
    calls = [{"name": "calculator", "text": '{"name": "calculator",\n "arguments": {"expression": "17 * 23"}}',
              "result": "391", "error": False},
             {"name": "", "text": "calculator(1 / 0)", "result": "error: the tool call is not valid JSON",
              "error": True}]
    write_rollouts(tmp_path, 1, [{**_record(1, 0, 0, "trained", 1.0, correct=True), "tool_calls": calls}])
    lines = show(str(tmp_path)).splitlines()
    assert lines[4].endswith("30 tokens, behaviour log-prob -0.500/token, 2 tool calls (1 with an error)")
    assert lines[-2:] == [
        '    call calculator: {"name": "calculator", "arguments": {"expression": "17 * 23"}} -> 391',
        "    call ?: calculator(1 / 0) -> error: the tool call is not valid JSON"]


def _tool_record(sample, calls, *, over_calls=False):
    """A completion that made `calls` ((result, error) pairs) and whose transcript holds their tool turns."""
    text, spans = "Let me compute.\n", []
    for result, _ in calls:
        text += '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'
        turn = f"\nuser\n<tool_response>\n{result}\n</tool_response>\nassistant\n"
        spans.append([len(text), len(text) + len(turn)])
        text += turn
    text += "#### 391"
    made = [{"name": "calculator", "text": "{}", "result": result, "error": error} for result, error in calls]
    return {**_record(1, 0, sample, "trained", 1.0), "completion": text, "tool_calls": made,
            "over_calls": over_calls, "tool_turn_spans": spans}


TOOL_RECORDS = [_tool_record(0, []), _tool_record(1, [("391", False)]),
                _tool_record(2, [("391", False), ("error: division by zero", True)]),
                _tool_record(3, [("391", False)], over_calls=True)]


@pytest.mark.parametrize("expression, samples", [
    ("called", [1, 2, 3]),
    ("!called", [0]),
    ("tool_error", [2]),
    ("over_calls", [3]),
    ("tool_calls>=2", [2]),
    ("tool_calls=1", [1, 3]),
    ("tool_errors=0, called", [1, 3]),
])
def test_where_selects_by_tool_calls_and_errors(tmp_path, expression, samples):
    """Issue 49, item 6: --where could not select by tool calls (tool_calls was a field it refused)."""
    write_rollouts(tmp_path, 1, TOOL_RECORDS)
    rows = [json.loads(line) for line in show(str(tmp_path), where=expression, as_json=True).splitlines()]
    assert [row["sample"] for row in rows] == samples


def test_tool_turns_are_marked_as_tool_turns(tmp_path):
    """Issue 49, item 6: a tool turn printed as bare 'user' and 'assistant' lines among the policy's own."""
    write_rollouts(tmp_path, 1, [TOOL_RECORDS[2]])
    lines = show(str(tmp_path)).splitlines()
    assert lines[5:] == [
        "      Let me compute.",
        "      <tool_call>",
        '      {"name": "calculator", "arguments": {"expression": "17 * 23"}}',
        "      </tool_call>",
        "  tool| user",
        "  tool| <tool_response>",
        "  tool| 391",
        "  tool| </tool_response>",
        "  tool| assistant",
        "      <tool_call>",
        '      {"name": "calculator", "arguments": {"expression": "17 * 23"}}',
        "      </tool_call>",
        "  tool| user",
        "  tool| <tool_response>",
        "  tool| error: division by zero",
        "  tool| </tool_response>",
        "  tool| assistant",
        "      #### 391",
        "    call calculator: {} -> 391",
        "    call calculator: {} -> error: division by zero",
    ]
    write_rollouts(tmp_path, 1, [TOOL_RECORDS[3]])
    assert show(str(tmp_path)).splitlines()[4].endswith(
        "1 tool call, ended by a turn past rollout.max_tool_calls (its calls not run)")


def test_records_from_before_tool_turns_were_kept_still_show(tmp_path):
    old = {key: value for key, value in _record(1, 0, 0, "trained", 1.0).items()
           if key not in ("tool_calls", "over_calls", "tool_turn_spans")}
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_1.jsonl").write_text(json.dumps(old) + "\n")
    assert show(str(tmp_path)).splitlines()[5:] == ["      line one", "      answer 0.0"]
    assert show(str(tmp_path), where="!called,tool_calls=0", as_json=True).count("\n") == 0  # one record


def test_a_file_cut_short_shows_its_whole_records_and_says_what_it_skipped(run, capsys):
    """Issue 47, item 9: a rollouts/step_N.jsonl cut short (a copy stopped, a disk filled) was a traceback."""
    path = run / "rollouts" / "step_2.jsonl"
    text = path.read_text()
    path.write_text(text[: text.rindex("\n", 0, len(text) - 1) + 40])  # the last line cut after 40 characters
    lines = show(str(run)).splitlines()
    assert lines[0] == "step 2: 3 completions of 2 sampled groups (trained 1, dropped_all_wrong 1)"
    assert capsys.readouterr().err == (f"warning: {path}: line 4 is not a whole record (cut short?); skipped, "
                                       "3 whole records read\n")
    rows = show(str(run), as_json=True).splitlines()
    assert [json.loads(row)["sample"] for row in rows] == [0, 1, 0]
    assert "line 4 is not a whole record" in capsys.readouterr().err
    path.write_text('{"step": 2, "round"')  # nothing whole at all
    assert show(str(run)).splitlines() == ["step 2: no whole record"]
    assert "line 1 is not a whole record" in capsys.readouterr().err
