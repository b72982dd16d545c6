"""Bad input as a table: every key of the schema given invalid values (here), and damaged or wrong files
of every kind the trainer reads (YAML config, JSONL / JSON / CSV / parquet data, model folder, reward
model folder, checkpoint folder, reward / correctness / engine plugins) plus a few command lines (bad_files.py).

Each case runs `dapo-train ARGS` in this process (cli.main) in a folder of its own, with stdout and
stderr captured at their file descriptors, so log lines count as the user would see them. A case is
clean when it exits with code 2, prints no traceback, its last stderr line and only `error:` line is
the message, and what comes before it is log records (a record may span lines: transformers' load
report lists the mismatched shapes); and when nothing in its folder was written, moved or removed (a
refused command writes nothing). Schema cases must print that one line alone and never start loading
a model (nor make a run folder: their folder stays as it was). A case may also give the whole message
it must print (expect, written by hand) and texts that must not appear (a library's warning).

Invalid values of a key come from its type (a wrong type is always invalid, so a key another change
adds is covered without editing this file), from its fixed set of choices, from validation.NON_EMPTY
(the empty text), and from IMPOSSIBLE for range checks; test_bad_input.py checks that every key
validation.validate names has an IMPOSSIBLE entry.

    python tests/bad_inputs.py [--group schema|files] [--only TEXT] [--json]   # the tally: tried / clean / other
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Small settings for any case that got past its check by mistake: it trains one short step, not 40.
SMALL_RUN = ["train.max_steps=1", "logging.progress_bar=false", "rollout.max_new_tokens=40", "eval.num_items=4"]
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) [\w.]+: ")  # run/console.py's console_logging format

# Key -> values that have the right type but are impossible (ranges, names that resolve to nothing).
IMPOSSIBLE: dict[str, list[str]] = {
    "output_dir": ["outputs/" + "x" * 300],  # a folder name past the file system's limit (255 bytes on most)
    "run_name": ["x" * 300],
    "seed": ["-1", "4294967296"],
    "model.name_or_path": ["./no-such-model"],
    "model.lora.r": ["-1"],
    "model.lora.alpha": ["0"],
    "model.lora.dropout": ["1.0", "-0.1"],
    "model.lora.target_modules": ["[]", "['']"],
    "data.path": ["./no-such-data.jsonl", "./no-such-folder/", "/dev/null"],
    "data.prompt_field": ["no_such_column"],
    "data.answer_field": ["no_such_column"],
    "data.correctness": ["fuzzy", "os:sep", "no_such_pkg.mod:check"],
    "data.train_split": ["no_such_split"],
    "data.eval_split": ["no_such_split"],
    "data.max_prompt_length": ["0", "4000"],  # 4000 + the completion budget exceeds the tiny model's 512 positions
    "rollout.group_size": ["1"],
    "rollout.max_new_tokens": ["0", "100000"],  # 100000 exceeds the tiny model's 512 positions
    "rollout.temperature": ["0", "-1"],
    "rollout.top_p": ["0", "1.5"],
    "rollout.top_k": ["-1"],
    "rollout.generation_batch_size": ["0"],
    "rollout.engine": ["vllm-nope", "os:sep", "no_such_pkg.mod:Engine", "os:getcwd"],
    # calculater: no such tool; os.path:join: no docstring to describe it; calculator alone: the tiny model's
    # chat template ignores tools= (found once the tokenizer loads, before the model).
    "rollout.tools": ["[calculater]", "['os.path:join']", "[calculator, calculator]", "[calculator]"],
    "rollout.max_tool_calls": ["0"],
    "rollout.vllm_memory": ["0", "1.0"],
    "rollout.vllm_kv_cache_mib": ["-1"],
    "dapo.policy_loss": ["ppo", "os:sep", "no_such_pkg.mod:loss"],
    "dapo.eps_low": ["1.0", "-0.1"],
    "dapo.eps_high": ["-0.01"],
    "dapo.clip_ratio_c": ["1.0"],
    "dapo.gspo_eps_low": ["1.0", "-0.1"],
    "dapo.gspo_eps_high": ["-0.01"],
    "dapo.cispo_eps_low": ["1.5", "-0.1"],
    "dapo.cispo_eps_high": ["-0.01"],
    "dapo.rollout_correction_cap": ["1.0", "0.5"],
    "dapo.beta": ["-1"],
    "dapo.filter_metric": ["sometimes", "reward:", "reward:nope"],
    "dapo.max_gen_rounds": ["0"],
    "dapo.max_round_prompts": ["-1", "1"],  # below train.prompts_per_step
    "dapo.skip_floor": ["0", "1.5"],
    "dapo.screen_size": ["1", "-1", "8"],  # a screen of 1 is always alike; 8 = the demo's whole group
    "dapo.num_iterations": ["0"],
    "rewards": [
        "[{name: nope}]", "[{name: accuracy, weight: .nan}]", "[{name: overlong, args: {cache_length: 96}}]",
        "[{name: accuracy, args: {bogus: 1}}]", "[{name: 'os.path:join'}]", "[{nme: accuracy}]", "[]",
        # A reward model: no path, a missing folder, a causal LM (no score head), an unknown arg or value.
        "[{name: reward_model}]", "[{name: reward_model, args: {path: ./no-such-model}}]",
        "[{name: reward_model, args: {path: builtin:tiny}}]",
        "[{name: reward_model, args: {path: builtin:tiny-verifier, bogus: 1}}]",
        "[{name: reward_model, args: {path: builtin:tiny-verifier, normalize: cube}}]",
    ],
    "train.max_steps": ["0"],
    "train.prompts_per_step": ["0"],
    "train.updates_per_step": ["0"],
    "train.micro_batch_size": ["0", "1000"],
    "train.micro_batch_tokens": ["-1"],
    "train.learning_rate": ["0", "-1e-4"],
    "train.adam_beta1": ["1.0", "-0.1"],
    "train.adam_beta2": ["1.5"],
    "train.weight_decay": ["-0.1"],
    "train.warmup_steps": ["-1"],
    "train.max_grad_norm": ["-1"],
    "train.logprob_chunk_mib": ["0"],
    "train.max_bad_steps": ["0"],
    "train.max_starved_steps": ["0"],
    "train.num_threads": ["-1"],
    "eval.every_steps": ["-1"],
    "eval.num_items": ["-1"],
    "eval.batch_size": ["0"],
    "eval.max_new_tokens": ["-1"],
    "eval.print_samples": ["-1"],
    "eval.samples": ["1", "-1"],
    "eval.regression_alpha": ["0", "1"],  # a false-alarm rate in (0, 1)
    "checkpoint.every_steps": ["-1"],
    "checkpoint.keep_last": ["-1"],
    "logging.trackers": ["[tensorboard, tensorboard]"],
    "logging.project": [" "],
    "logging.rollout_groups": ["-2"],
    "logging.rollout_every": ["-1"],
}
# Impossible combinations of keys: each tuple is one case.
IMPOSSIBLE_TOGETHER = [
    ("dapo.dynamic_sampling=false", "dapo.screen_size=2"),
    ("dapo.dynamic_sampling=false", "dapo.skip_history=true"),
    ("dapo.screen_size=2", "dapo.screen_drop=[]"),  # empty alone is fine: screening is off
    ("train.shared_prefix=on", "model.attn_implementation=flash_attention_2"),
    ("model.attn_implementation=flash_attention_2",),  # its package is not installed here (and it needs CUDA)
    ("rollout.tools=[calculator]", "rollout.engine=hf-generate"),  # model.generate cannot be fed a tool turn
    ("rollout.tools=[calculator]", "rollout.compile=on"),  # nor the static-cache engine
    ("model.dtype=float16", "train.mixed_precision=fp16"),  # fp16's loss scaler needs float32 master weights
]


@dataclass
class Case:
    """One bad input. make(folder): writes the files it needs; model_may_load: the problem is found by
    loading the model (damaged weights); writes_ok: found only while training (a reward plugin's
    answers), after the run folder was made."""

    id: str
    argv: list[str]
    make: Callable[[Path], None] | None = None
    group: str = "files"
    model_may_load: bool = False
    writes_ok: bool = False
    names: tuple[str, ...] = ()  # the message must name one of these (the key of a schema case)
    expect: str = ""  # the whole message, after "error: " (a regular expression when it starts with ^)
    absent: tuple[str, ...] = ()  # texts that must not appear anywhere in stderr (a library's warning)


@dataclass
class Outcome:
    code: int | str
    stderr: str
    model_loaded: bool
    changed: list[str] = field(default_factory=list)

    def problems(self, case: Case) -> list[str]:
        """What makes this outcome not clean (empty: clean)."""
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        found = []
        if self.code != 2:
            found.append(f"exit code {self.code}")
        if "Traceback" in self.stderr:
            found.append("traceback")
        if not lines or not lines[-1].startswith("error: ") or sum(line.startswith("error") for line in lines) != 1:
            found.append("no single error line last")
        if case.group == "schema" and len(lines) != 1:
            found.append("more than one line")
        elif not case.model_may_load and any(not LOG_LINE.match(line) for line in lines[:-1]):
            found.append("lines before the message that are not log records")  # (a model load may print its report)
        if case.names and lines and not any(name in lines[-1] for name in case.names):
            found.append(f"the message names none of {', '.join(case.names)}")
        if case.expect and not _matches(case.expect, lines[-1].removeprefix("error: ") if lines else ""):
            found.append(f"the message is not: {case.expect}")
        found += [f"stderr shows {text!r}" for text in case.absent if text in self.stderr]
        if self.model_loaded and not case.model_may_load:
            found.append("the model loaded first")
        if self.changed and not case.writes_ok:
            found.append(f"wrote {', '.join(self.changed[:3])}")
        return sorted(set(found))


def _matches(expect: str, message: str) -> bool:
    return bool(re.fullmatch(expect, message)) if expect.startswith("^") else message == expect


# --------------------------------------------------------------------------------------------
# Schema cases: derived from each key's type, choices and ranges.


def wrong_type_values(annotation: object, choices: tuple | None) -> list[str]:
    """KEY=VALUE texts of the wrong type for `annotation` (and outside `choices`); a type with no rule
    here is an error, so a new kind of key cannot go untested."""
    from dapo_train.config.schema import RewardSpec

    optional = type(None) in typing.get_args(annotation)
    base = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation) if optional else annotation
    rules = {bool: ["maybe", "2"], int: ["1.5", "ten"], float: ["abc", ".nan", "[1]"], str: ["[1, 2]", "{a: 1}"],
             list[str]: ["[1, 2]", "{a: 1}"], list[RewardSpec]: ["5", "[accuracy]", "{name: accuracy}"],
             int | str: ["1.5", "[1]", "ten"]}  # a number or one word (train.micro_batch_tokens: auto)
    if base not in rules:
        raise TypeError(f"no invalid values known for a key of type {annotation}; add a rule to wrong_type_values")
    values = list(rules[base]) + (["None"] if optional else [])  # the text None where null is meant
    if choices:
        values.append("[no-such-choice]" if base == list[str] else "no-such-choice")
    return values


def schema_cases() -> list[Case]:
    from dapo_train.config.keys import schema_keys
    from dapo_train.config.validate import NON_EMPTY

    cases = []
    for info in schema_keys():
        values = wrong_type_values(info.annotation, info.choices) + IMPOSSIBLE.get(info.key, [])
        values += [""] if info.key in NON_EMPTY else []
        cases += [Case(f"{info.key}={value}", ["run", *SMALL_RUN, f"{info.key}={value}"], group="schema",
                       names=(info.key,)) for value in values]
    cases += [Case(" ".join(pair), ["run", *SMALL_RUN, *pair], group="schema",
                   names=tuple(item.split("=")[0] for item in pair)) for pair in IMPOSSIBLE_TOGETHER]
    return cases


def _file_cases() -> list[Case]:
    from bad_files import file_cases  # it builds on Case and SMALL_RUN from here

    return file_cases()


GROUPS: dict[str, Callable[[], list[Case]]] = {"schema": schema_cases, "files": _file_cases}


# --------------------------------------------------------------------------------------------
# Running a case in this process.

_MODEL_LOADS: list[str] = []


def spy_on_model_loading() -> None:
    """Record every from_pretrained of a causal LM: schema cases must fail before the first."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):
        _MODEL_LOADS.append(str(args[0] if args else kwargs.get("pretrained_model_name_or_path")))
        return load(*args, **kwargs)

    AutoModelForCausalLM.from_pretrained = recorded


def _snapshot(folder: Path) -> dict[str, tuple[int, int] | str]:
    """Every file (time and size) and folder under `folder`: what a refused command must leave as it was.
    A folder's own time is left out: the output_dir probe makes and removes a folder in it."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size) if p.is_file() else "folder"
            for p in folder.rglob("*")}


def run_case(case: Case, folder: Path) -> Outcome:
    """`dapo-train ARGV` in `folder`, in this process, with stdout and stderr captured."""
    from dapo_train import cli

    folder.mkdir(parents=True)
    if case.make is not None:
        case.make(folder)
    before, loads = _snapshot(folder), len(_MODEL_LOADS)
    saved_fds = {fd: os.dup(fd) for fd in (1, 2)}
    cwd, argv, path = os.getcwd(), sys.argv, list(sys.path)
    code: int | str
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            os.chdir(folder)
            sys.argv, sys.path = ["dapo-train", *case.argv], [str(folder), *path]
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:  # a crash: what a user would see as a traceback
            code = "crash"
            sys.stderr.write(traceback.format_exc())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, saved in saved_fds.items():
                os.dup2(saved, fd)
                os.close(saved)
            os.chdir(cwd)
            sys.argv, sys.path = argv, path
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    after = _snapshot(folder)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    return Outcome(code, stderr, len(_MODEL_LOADS) > loads, changed)


def run_group(name: str, root: Path, only: list[str] | None = None) -> list[dict]:
    """Every case of a group (only: those whose id holds one of these texts) -> one record each: id,
    clean, problems, the message."""
    spy_on_model_loading()
    cases = [case for case in GROUPS[name]() if not only or any(text in case.id for text in only)]
    if name == "files":
        from bad_files import make_trained_run

        make_trained_run(root)
    records = []
    for number, case in enumerate(cases):
        outcome = run_case(case, root / f"case{number}")
        lines = [line for line in outcome.stderr.splitlines() if line.strip()]
        problems = outcome.problems(case)
        records.append({"id": case.id, "clean": not problems, "problems": problems,
                        "message": lines[-1] if lines else "", "stderr": outcome.stderr if problems else ""})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the bad-input cases and print the tally.")
    parser.add_argument("--group", choices=sorted(GROUPS), action="append", help="default: every group")
    parser.add_argument("--json", action="store_true", help="print one JSON record per case instead")
    parser.add_argument("--only", metavar="TEXT", action="append", help="run only the cases whose id holds TEXT "
                        "(repeat it for several)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="dapo-bad-inputs-") as root:
        records = [record for group in args.group or sorted(GROUPS)
                   for record in run_group(group, Path(root) / group, args.only)]
    if args.json:
        print(json.dumps(records, ensure_ascii=False))
        return
    for record in records:
        if not record["clean"]:
            print(f"NOT CLEAN {record['id']}: {'; '.join(record['problems'])}\n{record['stderr'][-1500:]}")
    clean = sum(record["clean"] for record in records)
    print(f"tried {len(records)}, clean exit 2 {clean}, anything else {len(records) - clean}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
