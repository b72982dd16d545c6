"""`dapo-train show RUN`: a run's rollout records (run/rollouts.py) on a terminal -- what the policy
wrote, why each completion got its reward, what became of its group -- or as JSON Lines.

    --step N      one step (default: the last step with records); `all`: every step
    --where EXPR  terms separated by commas (or the word `and`), all of which must hold:
                    a flag: truncated, correct, dropped (by Eq. 11 or a screen), screened (ruled out by
                    dapo.screen_size's screen), trained, carried, or a fate (dropped_all_wrong, ...);
                    with tools: called (made a tool call), tool_error (a call got an error text),
                    over_calls (ended past rollout.max_tool_calls); `not X` or `!X` for its opposite
                    FIELD OP VALUE with OP one of < <= > >= = != and FIELD a record field (reward,
                    advantage, length, fate, uid, extracted, ratio_mean, ...), rewards.<key>, or
                    tool_calls / tool_errors (how many calls, how many with an error text)
                  e.g. --where 'dropped'   --where 'reward<0.5,!truncated'   --where 'tool_calls>2'
    --limit K     completions shown (default 20; 0 = all)
    --json        the matching records, one JSON object per line: all of them unless --limit is given

The text form prints a group's question once, then each of its completions with its reward
breakdown, answer and ratios, and its whole text, the tool turns' lines marked `tool|`. Bad input (no
such run, no records, a step without a file, a term that names no field) is one line, exit code 2; a
line of a file that is not a whole record (a file cut short) is skipped with a warning on stderr.
"""

from __future__ import annotations

import json
import operator
import re
import shlex
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from dapo_train.config.load import CONFIG_FILE
from dapo_train.errors import UserError
from dapo_train.run.checkpoint import CHECKPOINT_RE, STATE_FILE
from dapo_train.run.rollouts import (
    FATES,
    RECORD_KEYS,
    ROLLOUTS_DIR,
    read_whole_rollouts,
    reward_breakdown,
    saved_rollouts,
)

Predicate = Callable[[dict], bool]
TEXT_LIMIT = 20  # completions the text form shows without --limit

# Flag name -> what it asks of a record; every fate's name is a flag too.
FLAGS: dict[str, Predicate] = {
    "truncated": lambda record: bool(record["truncated"]),
    "correct": lambda record: bool(record["correct"]),
    "dropped": lambda record: record["fate"].startswith(("dropped", "screened")),  # a screened prompt is dropped too
    "screened": lambda record: record["fate"].startswith("screened"),
    **{fate: (lambda record, fate=fate: record["fate"] == fate) for fate in FATES},
    "called": lambda record: bool(record["tool_calls"]),
    "tool_error": lambda record: any(call["error"] for call in record["tool_calls"]),
    "over_calls": lambda record: bool(record["over_calls"]),
}
OPERATORS: dict[str, Callable] = {"<=": operator.le, ">=": operator.ge, "!=": operator.ne, "==": operator.eq,
                                  "=": operator.eq, "<": operator.lt, ">": operator.gt}
ORDERING = ("<", "<=", ">", ">=")
_FLAG_RE = re.compile(r"^(?:(!|not\s+))?([\w.-]+)$")
_TERM_SEPARATOR = re.compile(r",|\s+and\s+")
_COMPARE_RE = re.compile(r"^([\w.-]+)\s*(<=|>=|!=|==|=|<|>)\s*(.*)$")


# Record fields that hold several values: --where reads rewards.<key>, and tool_calls as COUNTED's count.
UNCOMPARED = ("rewards", "tool_calls", "tool_turn_spans")
COUNTED: dict[str, Callable[[dict], int]] = {
    "tool_calls": lambda record: len(record["tool_calls"]),
    "tool_errors": lambda record: sum(call["error"] for call in record["tool_calls"]),
}


def _field(name: str, reward_keys: set[str]) -> Callable[[dict], object]:
    """The getter of a record field named in --where: a RECORD_KEYS name, a COUNTED count or rewards.<key>."""
    if name in COUNTED:
        return COUNTED[name]
    if name in RECORD_KEYS and name not in UNCOMPARED:
        return lambda record: record[name]
    if name.startswith("rewards.") and name[len("rewards."):] in reward_keys:
        return lambda record: record["rewards"].get(name[len("rewards."):])
    fields = [key for key in RECORD_KEYS if key not in UNCOMPARED] + list(COUNTED)
    fields += [f"rewards.{key}" for key in sorted(reward_keys)]
    raise UserError(f"--where: no record field '{name}'; fields: {', '.join(fields)}; flags: {', '.join(FLAGS)}")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _comparison(term: str, name: str, symbol: str, raw: str, reward_keys: set[str]) -> Predicate:
    """FIELD OP VALUE (the whole term) as a predicate. Ordering needs a number and holds only for numeric values;
    equality reads VALUE as the field's type (true/false, a number, null, else text)."""
    get, compare, wanted = _field(name, reward_keys), OPERATORS[symbol], raw.strip().strip("'\"")
    number = _number(wanted)
    if symbol in ORDERING:
        if number is None:
            raise UserError(f"--where: '{term}' compares with {symbol}, which needs a number, not '{wanted}'; join "
                            f"terms with ',' or 'and' ({name}{symbol}-0.5, truncated)")
        return lambda record: _is_number(get(record)) and compare(get(record), number)

    def equal(value: object) -> bool:
        if isinstance(value, bool):
            return value == (wanted.lower() == "true")
        if _is_number(value):
            return number is not None and value == number
        if value is None:
            return wanted.lower() in ("null", "none")
        return str(value) == wanted

    return lambda record: compare(equal(get(record)), True)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_where(expression: str, reward_keys: set[str]) -> Predicate:
    """--where EXPR as one predicate: every comma-separated term must hold."""
    terms = [term.strip() for term in _TERM_SEPARATOR.split(expression) if term.strip()]
    if not terms:
        raise UserError("--where: empty expression; e.g. --where dropped or --where 'reward<0.5,!truncated'")
    predicates = []
    for term in terms:
        if match := _COMPARE_RE.match(term):
            predicates.append(_comparison(term, *match.groups(), reward_keys))
        elif (match := _FLAG_RE.match(term)) and match.group(2) in FLAGS:
            flag = FLAGS[match.group(2)]
            predicates.append((lambda record, flag=flag: not flag(record)) if match.group(1) else flag)
        else:
            raise UserError(f"--where: cannot read '{term}'; a term is a flag ({', '.join(FLAGS)}), `!FLAG`, or "
                            "FIELD OP VALUE with OP one of < <= > >= = != (e.g. reward<0.5, rewards.overlong<0)")
    return lambda record: all(predicate(record) for predicate in predicates)


# --------------------------------------------------------------------------------------------
# Which files.


def _steps(run_dir: Path, step: str | None) -> dict[int, Path]:
    """--step as the files to read: one step, every step (`all`), or by default the last one."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    saved = saved_rollouts(run_dir)
    if not saved and CHECKPOINT_RE.fullmatch(run_dir.name) and (run_dir / STATE_FILE).is_file():
        raise UserError(f"{run_dir} is a checkpoint folder; show reads its run's rollouts: dapo-train show "
                        f"{shlex.quote(str(run_dir.parent))}")
    if not saved and not (run_dir / CONFIG_FILE).is_file():
        raise UserError(f"{run_dir} is not a run folder (no {CONFIG_FILE}); give the output_dir of a run")
    if not saved:
        raise UserError(f"{run_dir} holds no rollout records ({ROLLOUTS_DIR}/step_<N>.jsonl): the run kept none "
                        "(logging.rollout_groups=0), or trained before they were kept")
    if step is None:
        last = max(saved)
        return {last: saved[last]}
    if step == "all":
        return saved
    if not step.isdigit():
        raise UserError(f"--step {step}: give a step number or 'all'")
    if int(step) not in saved:
        raise UserError(f"--step {step}: no {ROLLOUTS_DIR}/step_{step}.jsonl in {run_dir}; steps with records: "
                        f"{_ranges(list(saved))}")
    return {int(step): saved[int(step)]}


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts, start = [], None
    for index, step in enumerate(steps):
        start = step if start is None else start
        if index + 1 == len(steps) or steps[index + 1] != step + 1:
            parts.append(str(step) if start == step else f"{start}-{step}")
            start = None
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Text.


def _group_header(record: dict) -> list[str]:
    return [
        f"step {record['step']}, round {record['round']}, group {record['group']}: {record['uid']}, gold "
        f"{record['gold']} -- {record['fate']}: {FATES.get(record['fate'], '')}",
        f"  question: {record['question']}",
    ]


def _completion(record: dict) -> list[str]:
    verdict = "correct" if record["correct"] else "wrong"
    details = [f"got {record['extracted']} ({verdict})", f"{record['length']} tokens"]
    details += ["truncated"] if record["truncated"] else []
    if record["behaviour_logprob_mean"] is not None:
        details.append(f"behaviour log-prob {record['behaviour_logprob_mean']:.3f}/token")
    if record["ratio_mean"] is not None:
        details.append(f"ratio {record['ratio_mean']:.4f}")
    if record["clip_frac"] is not None:
        details.append(f"clipped {record['clip_frac']:.3f}")
    calls = record["tool_calls"]
    if calls:
        errors = sum(call["error"] for call in calls)
        details.append(f"{_count(len(calls), 'tool call')}" + (f" ({errors} with an error)" if errors else ""))
    if record["over_calls"]:
        details.append("ended by a turn past rollout.max_tool_calls (its calls not run)")
    return [f"  [{record['sample']}] {reward_breakdown(record)}; {', '.join(details)}",
            *_text_lines(record["completion"], record["tool_turn_spans"]),
            *(f"    call {call['name'] or '?'}: {' '.join(call['text'].split())} -> {' '.join(call['result'].split())}"
              for call in calls)]


def _text_lines(text: str, spans: list[list[int]]) -> list[str]:
    """A completion's lines, the policy's indented and a tool turn's marked `tool|` (its blank lines left out):
    without the mark, a tool turn reads as the policy writing 'user' and 'assistant' lines."""
    lines, cursor = [], 0
    for start, end in spans:
        lines += [f"      {line}" for line in text[cursor:start].splitlines()]
        lines += [f"  tool| {line}" for line in text[start:end].splitlines() if line.strip()]
        cursor = end
    lines += [f"      {line}" for line in text[cursor:].splitlines()]
    return lines or ["      "]


def render(records: list[dict]) -> list[str]:
    """Records grouped by their group (its question once), each completion in full."""
    lines, current = [], None
    for record in records:
        key = (record["step"], record["round"], record["group"])
        if key != current:
            lines += ([""] if lines else []) + _group_header(record)
            current = key
        lines += _completion(record)
    return lines


def _heading(files: dict[int, Path], records: list[dict], shown: int, matching: int, where: str | None,
             skipped: bool) -> str:
    what = f"step {next(iter(files))}" if len(files) == 1 else f"{len(files)} steps"
    if not records and skipped:
        return f"{what}: no whole record"
    if not records:
        return f"{what}: no group generated (a step whose batch came whole from carried-over groups)"
    groups = len({(r["step"], r["round"], r["group"]) for r in records})
    fates = Counter(r["fate"] for r in records if r["sample"] == 0)
    head = (f"{what}: {_count(len(records), 'completion')} of {_count(groups, 'sampled group')} ("
            f"{', '.join(f'{fate} {count}' for fate, count in fates.items())})")
    if where:
        head += f"; {matching} match '{where}'"
    return head + (f"; showing {shown} (--limit)" if shown < matching else "")


def _read(files: dict[int, Path]) -> tuple[list[dict], bool]:
    """The whole records of the files, in order, and whether any line was skipped, each file's skipped lines
    said on stderr (the output itself stays records, as --json must)."""
    records, skipped = [], False
    for path in files.values():
        whole, bad = read_whole_rollouts(path)
        records += whole
        if bad:
            which = f"line {bad[0]} is not a whole record" if len(bad) == 1 else \
                f"lines {_ranges(bad)} are not whole records"
            print(f"warning: {path}: {which} (cut short?); skipped, {_count(len(whole), 'whole record')} read",
                  file=sys.stderr)
            skipped = True
    return records, skipped


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def show(
    run: str, step: str | None = None, where: str | None = None, limit: int | None = None, as_json: bool = False
) -> str:
    """The `dapo-train show` output for a run folder (see the module docstring); limit None: 20
    completions as text, every matching record as JSON (what a script reads must not stop short)."""
    limit = (0 if as_json else TEXT_LIMIT) if limit is None else limit
    if limit < 0:
        raise UserError(f"--limit {limit}: must be >= 0 (0 = all)")
    files = _steps(Path(run), step)
    records, skipped = _read(files)
    keep = parse_where(where, {key for r in records for key in r["rewards"]}) if where else (lambda record: True)
    matching = [record for record in records if keep(record)]
    shown = matching[:limit] if limit else matching
    if as_json:
        return "\n".join(json.dumps(record, ensure_ascii=False) for record in shown)
    lines = [_heading(files, records, len(shown), len(matching), where, skipped)]
    return "\n".join(lines + ([""] + render(shown) if shown else []))
