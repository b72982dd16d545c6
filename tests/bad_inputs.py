"""Bad input as a table: every key of the schema given invalid values, and damaged or wrong files of
every kind the trainer reads (YAML config, JSONL / JSON / CSV / parquet data, model folder,
checkpoint folder, reward / correctness / engine plugins), plus a few command lines.

Each case runs `dapo-train ARGS` in this process (cli.main) in a folder of its own, with stdout and
stderr captured at their file descriptors, so log lines count as the user would see them. A case is
clean when it exits with code 2, prints no traceback, its last stderr line and only `error:` line is
the message, and what comes before it is log records (a record may span lines: transformers' load
report lists the mismatched shapes); and when nothing in its folder was written, moved or removed (a
refused command writes nothing). Schema cases must print that one line alone and never start loading
a model (nor make a run folder: their folder stays as it was).

Invalid values of a key come from its type (a wrong type is always invalid, so a key another change
adds is covered without editing this file), from its fixed set of choices, from schema.NON_EMPTY
(the empty text), and from IMPOSSIBLE for range checks; test_bad_input.py checks that every key
schema.validate names has an IMPOSSIBLE entry.

    python tests/bad_inputs.py [--group schema|files] [--json]   # the tally: tried / clean / other
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Small settings for any case that got past its check by mistake: it trains one short step, not 40.
SMALL_RUN = ["train.max_steps=1", "logging.progress_bar=false", "rollout.max_new_tokens=40", "eval.num_items=4"]
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) [\w.]+: ")  # cli._setup_logging's format

# Key -> values that have the right type but are impossible (ranges, names that resolve to nothing).
IMPOSSIBLE: dict[str, list[str]] = {
    "seed": ["-1", "4294967296"],
    "model.name_or_path": ["./no-such-model"],
    "model.lora.r": ["-1"],
    "model.lora.alpha": ["0"],
    "model.lora.dropout": ["1.0", "-0.1"],
    "model.lora.target_modules": ["[]", "['']"],
    "data.path": ["./no-such-data.jsonl", "./no-such-folder/"],
    "data.prompt_field": ["no_such_column"],
    "data.answer_field": ["no_such_column"],
    "data.correctness": ["fuzzy", "os:sep", "no_such_pkg.mod:check"],
    "data.train_split": ["no_such_split"],
    "data.eval_split": ["no_such_split"],
    "data.max_prompt_length": ["0", "4000"],  # 4000 + the completion budget exceeds the tiny model's 512 positions
    "rollout.group_size": ["1"],
    "rollout.max_new_tokens": ["0"],
    "rollout.temperature": ["0", "-1"],
    "rollout.top_p": ["0", "1.5"],
    "rollout.top_k": ["-1"],
    "rollout.generation_batch_size": ["0"],
    "rollout.engine": ["vllm-nope", "os:sep", "no_such_pkg.mod:Engine", "os:getcwd"],
    "dapo.policy_loss": ["ppo", "os:sep", "no_such_pkg.mod:loss"],
    "dapo.eps_low": ["1.0", "-0.1"],
    "dapo.eps_high": ["-0.01"],
    "dapo.clip_ratio_c": ["1.0"],
    "dapo.beta": ["-1"],
    "dapo.filter_metric": ["sometimes", "reward:", "reward:nope"],
    "dapo.max_gen_rounds": ["0"],
    "dapo.num_iterations": ["0"],
    "rewards": [
        "[{name: nope}]", "[{name: accuracy, weight: .nan}]", "[{name: overlong, args: {cache_length: 96}}]",
        "[{name: accuracy, args: {bogus: 1}}]", "[{name: 'os.path:join'}]", "[{nme: accuracy}]", "[]",
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
    "train.num_threads": ["-1"],
    "eval.every_steps": ["-1"],
    "eval.num_items": ["-1"],
    "eval.batch_size": ["0"],
    "eval.max_new_tokens": ["-1"],
    "eval.print_samples": ["-1"],
    "checkpoint.every_steps": ["-1"],
    "checkpoint.keep_last": ["-1"],
    "logging.trackers": ["[tensorboard, tensorboard]"],
    "logging.project": [" "],
}
# Impossible combinations of keys: each tuple is one case.
IMPOSSIBLE_TOGETHER = [
    ("train.shared_prefix=on", "model.attn_implementation=flash_attention_2"),
    ("model.attn_implementation=flash_attention_2",),  # its package is not installed here (and it needs CUDA)
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
        elif lines[:-1] and not LOG_LINE.match(lines[0]):
            found.append("lines before the message that are not log records")
        if case.names and lines and not any(name in lines[-1] for name in case.names):
            found.append(f"the message names none of {', '.join(case.names)}")
        if self.model_loaded and not case.model_may_load:
            found.append("the model loaded first")
        if self.changed and not case.writes_ok:
            found.append(f"wrote {', '.join(self.changed[:3])}")
        return sorted(set(found))


# --------------------------------------------------------------------------------------------
# Schema cases: derived from each key's type, choices and ranges.


def wrong_type_values(annotation: object, choices: tuple | None) -> list[str]:
    """KEY=VALUE texts of the wrong type for `annotation` (and outside `choices`); a type with no rule
    here is an error, so a new kind of key cannot go untested."""
    from dapo_train.schema import RewardSpec

    optional = type(None) in typing.get_args(annotation)
    base = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation) if optional else annotation
    rules = {bool: ["maybe", "2"], int: ["1.5", "ten"], float: ["abc", ".nan", "[1]"], str: ["[1, 2]", "{a: 1}"],
             list[str]: ["[1, 2]", "{a: 1}"], list[RewardSpec]: ["5", "[accuracy]", "{name: accuracy}"]}
    if base not in rules:
        raise TypeError(f"no invalid values known for a key of type {annotation}; add a rule to wrong_type_values")
    values = list(rules[base]) + (["None"] if optional else [])  # the text None where null is meant
    if choices:
        values.append("[no-such-choice]" if base == list[str] else "no-such-choice")
    return values


def schema_cases() -> list[Case]:
    from dapo_train.config_keys import schema_keys
    from dapo_train.schema import NON_EMPTY

    cases = []
    for info in schema_keys():
        values = wrong_type_values(info.annotation, info.choices) + IMPOSSIBLE.get(info.key, [])
        values += [""] if info.key in NON_EMPTY else []
        cases += [Case(f"{info.key}={value}", ["run", *SMALL_RUN, f"{info.key}={value}"], group="schema",
                       names=(info.key,)) for value in values]
    cases += [Case(" ".join(pair), ["run", *SMALL_RUN, *pair], group="schema",
                   names=tuple(item.split("=")[0] for item in pair)) for pair in IMPOSSIBLE_TOGETHER]
    return cases


# --------------------------------------------------------------------------------------------
# File cases: what the trainer reads, damaged.


def _write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        (folder / name).write_bytes(data)

    return make


def _both(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        for maker in makers:
            maker(folder)

    return make


YAML_FILES = {
    "yaml-malformed": "dapo:\n  eps_low: 0.2\n eps_high: 0.3\n",
    "yaml-truncated": "dapo:\n  eps_high: [0.3, 0.4\n",
    "yaml-empty": "",
    "yaml-a-list": "- dapo\n- train\n",
    "yaml-a-number": "42\n",
    "yaml-section-a-number": "dapo: 3\n",
    "yaml-unknown-section": "dapoo:\n  eps_high: 0.3\n",
    "yaml-wrong-type": "dapo:\n  eps_high: high\n",
    "yaml-tab-indent": "dapo:\n\teps_high: 0.3\n",
    "yaml-python-tag": "dapo: !!python/object:os.system {}\n",
    "yaml-duplicate-key": "dapo:\n  eps_high: 0.3\n  eps_high: 0.5\n",
    "yaml-binary": b"\xff\xfe\x00dapo",
}

ROWS = [{"q": "1+1=?", "a": 2}, {"q": "2+2=?", "a": 4}, {"q": "3+3=?", "a": 6}]
JSONL = "".join(json.dumps(row) + "\n" for row in ROWS)
CSV = "q,a\n1+1=?,2\n2+2=?,4\n3+3=?,6\n"
DATA_FILES = {
    "train.jsonl": {
        "jsonl-truncated-row": JSONL[:-8],
        "jsonl-malformed-row": JSONL.replace('"a": 4', '"a" 4'),
        "jsonl-empty": "",
        "jsonl-blank-lines": "\n\n",
        "jsonl-a-list-line": JSONL + "[1, 2]\n",
        "jsonl-not-utf8": JSONL.encode() + b'{"q": "\xff", "a": 1}\n',
        "jsonl-wrong-columns": JSONL.replace('"q"', '"question"'),
        "jsonl-answers-unreadable": JSONL.replace('"a": 2', '"a": "two"').replace('"a": 4', '"a": {"x": 1}').replace(
            '"a": 6', '"a": [6]'),
        "jsonl-questions-not-text": JSONL.replace('"1+1=?"', "7").replace('"2+2=?"', "null").replace('"3+3=?"', '""'),
    },
    "train.json": {
        "json-truncated-array": json.dumps(ROWS)[:-10],
        "json-array-of-numbers": "[1, 2, 3]",
    },
    "train.csv": {
        "csv-unterminated-quote-merges-rows": CSV.replace("1+1=?", '"1+1=?').replace("3+3=?", '"3+3=?"'),
        "csv-unterminated-quote-to-the-end": CSV.replace("2+2=?", '"2+2=?'),
        "csv-extra-field": CSV.replace("2+2=?,4", "2+2=?,4,x"),
        "csv-missing-field": CSV.replace("2+2=?,4", "2+2=?"),
        "csv-header-only": "q,a\n",
        "csv-empty": "",
        "csv-wrong-columns": CSV.replace("q,a", "question,answer"),
    },
    "train.parquet": {
        "parquet-not-parquet": "q,a\n1,2\n",
        "parquet-empty": "",
    },
}


def _parquet(rows: list[dict], cut: int | None = None, rename: dict | None = None) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        import pandas as pd

        frame = pd.DataFrame(rows).rename(columns=rename or {})
        frame.to_parquet(folder / "train.parquet")
        if cut:
            data = (folder / "train.parquet").read_bytes()
            (folder / "train.parquet").write_bytes(data[: len(data) - cut])

    return make


def data_cases() -> list[Case]:
    columns = ["data.prompt_field=q", "data.answer_field=a"]
    cases = []
    for name, contents in DATA_FILES.items():
        for case_id, content in contents.items():
            cases.append(Case(case_id, ["run", *SMALL_RUN, "eval.every_steps=0", f"data.path={name}", *columns],
                              _write(name, content)))
    run = ["run", *SMALL_RUN, "eval.every_steps=0", "data.path=train.parquet", *columns]
    cases += [
        Case("parquet-truncated", run, _parquet(ROWS, cut=40)),
        Case("parquet-wrong-columns", run, _parquet(ROWS, rename={"q": "question"})),
        Case("folder-without-split-files", ["run", *SMALL_RUN, "data.path=./data", *columns],
             _write("data/notes.txt", "nothing here\n")),
        Case("folder-without-the-eval-split", ["run", *SMALL_RUN, "data.path=./data", *columns],
             _write("data/train.jsonl", JSONL)),
        Case("folder-mixing-formats", ["run", *SMALL_RUN, "data.path=./data", *columns], _both(
            _write("data/train-1.jsonl", JSONL), _write("data/train-2.csv", CSV), _write("data/test.jsonl", JSONL))),
        Case("save-to-disk-damaged", ["run", *SMALL_RUN, "data.path=./data", *columns],
             _write("data/dataset_dict.json", "{not json")),
        Case("data-unsupported-file-type", ["run", *SMALL_RUN, "data.path=train.txt", *columns],
             _write("train.txt", CSV)),
    ]
    return cases


def yaml_cases() -> list[Case]:
    cases = [Case(case_id, ["run", "bad.yaml", *SMALL_RUN], _write("bad.yaml", text))
             for case_id, text in YAML_FILES.items()]
    cases.append(Case("yaml-a-folder", ["run", "conf.yaml", *SMALL_RUN], lambda folder: (folder / "conf.yaml").mkdir()))
    return cases


def _model_copy(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        from dapo_train.config import TINY_MODEL_DIR

        shutil.copytree(TINY_MODEL_DIR, folder / "model")
        change(folder / "model")

    return make


def _set_config(**changes: object) -> Callable[[Path], None]:
    def change(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, **changes}))

    return change


def _cut(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])

    return change


def _text(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def _remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()

    return change


MODEL_FOLDERS: dict[str, tuple[Callable[[Path], None], bool]] = {  # case -> (damage, found by loading the model)
    "model-config-malformed": (_text("config.json", "{"), False),
    "model-config-empty": (_text("config.json", ""), False),
    "model-config-a-list": (_text("config.json", "[]"), False),
    "model-config-no-model-type": (_text("config.json", "{}"), False),
    "model-config-unknown-model-type": (_text("config.json", '{"model_type": "nonsense"}'), False),
    "model-generation-config-malformed": (_text("generation_config.json", "{"), False),
    "model-tokenizer-truncated": (_cut("tokenizer.json"), False),
    "model-tokenizer-config-malformed": (_text("tokenizer_config.json", "{"), False),
    "model-no-tokenizer": (_remove("tokenizer.json", "tokenizer_config.json"), False),
    "model-no-chat-template": (_remove("chat_template.jinja"), False),
    "model-no-weights": (_remove("model.safetensors"), True),
    "model-weights-truncated": (_cut("model.safetensors"), True),
    "model-weights-empty": (_cut("model.safetensors", 0.0), True),
    "model-weights-other-shapes": (_set_config(hidden_size=64), True),
}


def model_cases() -> list[Case]:
    run = ["run", *SMALL_RUN, "model.name_or_path=./model"]
    cases = [Case(case_id, run, _model_copy(damage), model_may_load=loads)
             for case_id, (damage, loads) in MODEL_FOLDERS.items()]
    cases += [
        Case("model-empty-folder", run, lambda folder: (folder / "model").mkdir()),
        Case("model-folder-of-other-files", run, _write("model/notes.txt", "not a model\n")),
        Case("model-a-file", run, _write("model", "not a folder\n")),
    ]
    return cases


def _checkpoint_copy(change: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """The trained run (make_trained_run) copied into the case folder as run/, its checkpoint_1 changed."""

    def make(folder: Path) -> None:
        shutil.copytree(TRAINED_RUN[0], folder / "run")
        for config in (folder / "run").rglob("config.yaml"):
            config.write_text(config.read_text().replace(str(TRAINED_RUN[0]), str(folder / "run")))
        if change is not None:
            change(folder / "run" / "checkpoint_1")

    return make


def _torch_save(obj: object) -> Callable[[Path], None]:
    def change(checkpoint: Path) -> None:
        import torch

        torch.save(obj, checkpoint / "trainer_state.pt")

    return change


CHECKPOINTS: dict[str, tuple[Callable[[Path], None], bool]] = {
    "checkpoint-state-missing": (_remove("trainer_state.pt"), False),
    "checkpoint-state-empty": (_cut("trainer_state.pt", 0.0), False),
    "checkpoint-state-truncated": (_cut("trainer_state.pt"), False),
    "checkpoint-state-text": (_text("trainer_state.pt", "not a torch file\n"), False),
    "checkpoint-state-not-a-trainer-state": (_torch_save({"step": 1}), False),
    "checkpoint-state-a-list": (_torch_save([1, 2]), False),
    "checkpoint-config-missing": (_remove("config.yaml"), False),
    "checkpoint-config-malformed": (_text("config.yaml", "dapo: [\n"), False),
    "checkpoint-config-unknown-key": (_text("config.yaml", "dapo:\n  no_such_key: 1\n"), False),
    "checkpoint-model-config-missing": (_remove("config.json"), False),
    "checkpoint-weights-truncated": (_cut("model.safetensors"), True),
}


def checkpoint_cases() -> list[Case]:
    resume = ["run", "--resume", "run/checkpoint_1", "train.max_steps=3"]
    cases = [Case(case_id, resume, _checkpoint_copy(damage), model_may_load=loads)
             for case_id, (damage, loads) in CHECKPOINTS.items()]
    cases += [
        Case("resume-a-file", ["run", "--resume", "notes.txt"], _write("notes.txt", "x\n")),
        Case("resume-a-folder-without-checkpoints", ["run", "--resume", "empty"], lambda f: (f / "empty").mkdir()),
        Case("resume-and-overwrite", [*resume, "--overwrite"], _checkpoint_copy()),
        Case("resume-with-a-lora-rank", [*resume, "model.lora.r=4"], _checkpoint_copy()),
        Case("resume-with-other-data", [*resume, "data.max_prompt_length=150"], _checkpoint_copy(),
             model_may_load=True),
    ]
    return cases


PLUGINS = {  # case -> (the module's source, config override naming it, found only while training)
    "reward-plugin-raises-on-import": ("raise RuntimeError('broken plugin')\n", "rewards=[{{name: '{m}:r'}}]", False),
    "reward-plugin-missing-function": ("x = 1\n", "rewards=[{{name: '{m}:r'}}]", False),
    "reward-plugin-not-callable": ("r = 3\n", "rewards=[{{name: '{m}:r'}}]", False),
    "reward-plugin-wrong-signature": ("def r(x):\n    return [0.0]\n", "rewards=[{{name: '{m}:r'}}]", False),
    "reward-plugin-returns-none": (
        "def r(completions, answers, **kw):\n    return None\n", "rewards=[{{name: '{m}:r'}}]", True),
    "correctness-plugin-wrong-signature": ("def check(x):\n    return True\n", "data.correctness={m}:check", False),
    "correctness-plugin-returns-text": (
        "def check(completion, gold):\n    return 'yes'\n", "data.correctness={m}:check", True),
    "engine-plugin-raises-on-import": ("raise ImportError('no vllm here')\n", "rollout.engine={m}:Engine", False),
    "engine-plugin-class-without-methods": ("class Engine:\n    pass\n", "rollout.engine={m}:Engine", False),
    "engine-plugin-class-wrong-init": (
        "class Engine:\n    def __init__(self):\n        pass\n    def generate(self, *a):\n        pass\n"
        "    def sync_weights(self):\n        pass\n", "rollout.engine={m}:Engine", False),
    "engine-plugin-factory-returns-a-number": (
        "def Engine(setup):\n    return 42\n", "rollout.engine={m}:Engine", True),
    "engine-plugin-factory-raises": (
        "def Engine(setup):\n    raise ValueError('no GPU for vllm')\n", "rollout.engine={m}:Engine", True),
    "engine-not-an-engine": ("", "rollout.engine=os.path:join", True),
}


def plugin_cases() -> list[Case]:
    cases = []
    for case_id, (source, override, late) in PLUGINS.items():
        module = "plugin_" + case_id.replace("-", "_")
        # The engine problems found once the model is there ("late") fail before the run folder exists;
        # a reward's or check's answers are seen only while training.
        writes = late and not case_id.startswith("engine")
        cases.append(Case(case_id, ["run", *SMALL_RUN, override.format(m=module)], _write(f"{module}.py", source),
                          model_may_load=late, writes_ok=writes))
    return cases


def command_cases() -> list[Case]:
    return [
        Case("config-keys-unknown", ["config", "--keys", "dapo.nonsense"]),
        Case("config-keys-unknown-section", ["config", "--keys", "dapoo"]),
        Case("compare-a-file", ["compare", "notes.txt"], _write("notes.txt", "x\n")),
        Case("compare-a-folder-without-runs", ["compare", "empty"], lambda folder: (folder / "empty").mkdir()),
        Case("plot-into-proc", ["plot", "run", "-o", "/proc/dapo-plot.png"], _checkpoint_copy()),
        Case("plot-onto-a-folder", ["plot", "run", "-o", "empty"],
             _both(_checkpoint_copy(), lambda folder: (folder / "empty").mkdir())),
        Case("plot-unknown-image-type", ["plot", "run", "-o", "curves.xyz"], _checkpoint_copy()),
        Case("eval-an-empty-folder", ["eval", "empty"], lambda folder: (folder / "empty").mkdir()),
        Case("eval-a-file", ["eval", "./notes.txt"], _write("notes.txt", "x\n")),
        Case("eval-a-missing-split", ["eval", "run/checkpoint_1", "--split", "nope"], _checkpoint_copy()),
        Case("output-dir-under-a-file", ["run", *SMALL_RUN, "output_dir=taken/run"], _write("taken", "x\n")),
        Case("sweep-a-bad-last-value", ["sweep", "bad.yaml", "dapo.eps_high=0.1,-1"], _write("bad.yaml", "seed: 1\n")),
    ]


GROUPS: dict[str, Callable[[], list[Case]]] = {
    "schema": schema_cases,
    "files": lambda: yaml_cases() + data_cases() + model_cases() + checkpoint_cases() + plugin_cases()
    + command_cases(),
}

# --------------------------------------------------------------------------------------------
# Running a case in this process.

TRAINED_RUN: list[Path] = []  # the run folder checkpoint cases copy (make_trained_run)
_MODEL_LOADS: list[str] = []


def spy_on_model_loading() -> None:
    """Record every from_pretrained of a causal LM: schema cases must fail before the first."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):
        _MODEL_LOADS.append(str(args[0] if args else kwargs.get("pretrained_model_name_or_path")))
        return load(*args, **kwargs)

    AutoModelForCausalLM.from_pretrained = recorded


def make_trained_run(root: Path) -> None:
    """A 2-step run with checkpoint_1 and checkpoint_2, trained once for the checkpoint cases: they resume
    from checkpoint_1, so a refusal that moved checkpoint_2 aside first would show as a change."""
    from dapo_train.config import load_config
    from dapo_train.trainer import train

    out = root / "trained" / "run"
    cfg = load_config(None, [
        "rollout.group_size=2", "rollout.max_new_tokens=40", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=1", "eval.num_items=4",
        "logging.progress_bar=false",
        f"output_dir={out}",
    ])
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the tally's (--json)
        train(cfg)
    TRAINED_RUN.append(out)


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


def run_group(name: str, root: Path) -> list[dict]:
    """Every case of a group -> one record each: id, clean, problems, the message."""
    spy_on_model_loading()
    cases = GROUPS[name]()
    if name == "files":
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
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="dapo-bad-inputs-") as root:
        records = [record for group in args.group or sorted(GROUPS) for record in run_group(group, Path(root) / group)]
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
