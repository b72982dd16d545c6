"""The file cases of tests/bad_inputs.py: what the trainer reads, damaged. Each case writes its files into
its own folder; the checkpoint and plot cases copy a 2-step run trained once (make_trained_run), the reward
model cases the shipped builtin:tiny-verifier."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from bad_inputs import SMALL_RUN, Case

TRAINED_RUN: list[Path] = []  # the run folder checkpoint cases copy (make_trained_run)


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
        Case("folder-only-compressed", ["run", *SMALL_RUN, "data.path=./data", *columns],
             _write("data/train.jsonl.gz", b"\x1f\x8b"),  # issue 59: it was not mentioned
             expect=r"^data.path \S*data: no split files found; .*; it holds train.jsonl.gz, which is not read: "
             r"decompress it \(gunzip\) or convert it to one of .parquet, .jsonl, .json, .csv$"),
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
    cases.append(Case(  # issue 59: the mark was printed as it is, invisibly
        "yaml-bom-in-a-key", ["run", "bad.yaml", *SMALL_RUN], _write("bad.yaml", "train:\n  \ufeffmax_steps: 1\n"),
        expect="config key 'train.\\ufeffmax_steps': unknown key: it holds an invisible U+FEFF (a byte-order mark, "
        "ZERO WIDTH NO-BREAK SPACE); delete it: 'train.max_steps'"))
    return cases


def _model_copy(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        from dapo_train.task.locations import TINY_MODEL_DIR

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


def _remove(*names: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        for name in names:
            (folder / name).unlink()

    return change


MODEL_FOLDERS: dict[str, tuple[Callable[[Path], None], bool]] = {  # case -> (damage, found by loading the model)
    "model-config-malformed": (_write("config.json", "{"), False),
    "model-config-empty": (_write("config.json", ""), False),
    "model-config-a-list": (_write("config.json", "[]"), False),
    "model-config-no-model-type": (_write("config.json", "{}"), False),
    "model-config-unknown-model-type": (_write("config.json", '{"model_type": "nonsense"}'), False),
    "model-generation-config-malformed": (_write("generation_config.json", "{"), False),
    "model-tokenizer-truncated": (_cut("tokenizer.json"), False),
    "model-tokenizer-config-malformed": (_write("tokenizer_config.json", "{"), False),
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


def _verifier_copy(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(folder: Path) -> None:
        from dapo_train.task.locations import TINY_VERIFIER_DIR

        shutil.copytree(TINY_VERIFIER_DIR, folder / "rm")
        change(folder / "rm")

    return make


REWARD_MODEL_FOLDERS: dict[str, tuple[Callable[[Path], None], str, bool]] = {  # case -> (damage, args, found loading)
    "reward-model-two-labels": (_set_config(id2label={"0": "wrong", "1": "right"}), "", False),
    "reward-model-tokenizer-truncated": (_cut("tokenizer.json"), "", False),
    "reward-model-no-tokenizer": (_remove("tokenizer.json", "tokenizer_config.json"), "", False),
    "reward-model-vocabulary-smaller-than-tokenizer": (_set_config(vocab_size=100, pad_token_id=None), "", False),
    "reward-model-chat-without-template": (_remove("chat_template.jinja"), ", format: chat", False),
    "reward-model-weights-truncated": (_cut("model.safetensors"), "", True),
    "reward-model-no-weights": (_remove("model.safetensors"), "", True),
}


def reward_model_cases() -> list[Case]:
    """A reward model's folder, damaged: found when the config is read, or (the weights) when it loads
    after the policy, before the run folder is made."""
    return [Case(case_id, ["run", *SMALL_RUN, f"rewards=[{{name: reward_model, args: {{path: ./rm{args}}}}}]"],
                 _verifier_copy(damage), model_may_load=loads)
            for case_id, (damage, args, loads) in REWARD_MODEL_FOLDERS.items()]


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
    "checkpoint-state-text": (_write("trainer_state.pt", "not a torch file\n"), False),
    "checkpoint-state-not-a-trainer-state": (_torch_save({"step": 1}), False),
    "checkpoint-state-a-list": (_torch_save([1, 2]), False),
    "checkpoint-config-missing": (_remove("config.yaml"), False),
    "checkpoint-config-malformed": (_write("config.yaml", "dapo: [\n"), False),
    "checkpoint-config-unknown-key": (_write("config.yaml", "dapo:\n  no_such_key: 1\n"), False),
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
    "engine-not-an-engine": ("", "rollout.engine=os.path:join", False),  # its *args: refused before the data
    "engine-a-function-of-one-argument": ("", "rollout.engine=builtins:len", True),
}


PLUGIN_MESSAGES = {  # case -> the whole message, where the case gives it
    "correctness-plugin-returns-text": "config key 'data.correctness': plugin_correctness_plugin_returns_text:check "
    "returned 'yes' (str), not a bool",  # the check's fault, not the accuracy reward's that called it
}


def plugin_cases() -> list[Case]:
    cases = []
    for case_id, (source, override, late) in PLUGINS.items():
        module = "plugin_" + case_id.replace("-", "_")
        # The engine problems found once the model is there ("late") fail before the run folder exists;
        # a reward's or check's answers are seen only while training.
        writes = late and not case_id.startswith("engine")
        cases.append(Case(case_id, ["run", *SMALL_RUN, override.format(m=module)], _write(f"{module}.py", source),
                          model_may_load=late, writes_ok=writes, expect=PLUGIN_MESSAGES.get(case_id, "")))
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
        Case("a-key-given-twice", ["run", *SMALL_RUN, "train.max_steps=2"]),  # SMALL_RUN has train.max_steps=1
        Case("lora-targets-matching-nothing", ["run", *SMALL_RUN, "model.lora.r=4", "model.lora.target_modules=[x]"]),
        Case("sweep-a-bad-last-value", ["sweep", "bad.yaml", "dapo.eps_high=0.1,-1"], _write("bad.yaml", "seed: 1\n")),
    ]


LONG_ROWS = "".join(json.dumps({"q": "很长的问题 " * 700, "a": i}) + "\n" for i in range(3))
VALID_SECTIONS = "output_dir, run_name, seed, model, data, rollout, dapo, rewards, train, eval, checkpoint, logging"


def message_cases() -> list[Case]:
    """What a new user tried (issue 38), each with the whole message it must give: refusals of what
    used to be accepted silently, and messages that pointed the wrong way."""
    columns = ["data.prompt_field=q", "data.answer_field=a", "eval.every_steps=0", "eval.final_full=false"]
    resume = ["run", "--resume", "run/checkpoint_1", "train.max_steps=3"]
    return [
        Case("resume-with-another-model", [*resume, "model.name_or_path=builtin:tiny-long"], _checkpoint_copy(),
             expect="--resume run/checkpoint_1: model.name_or_path is 'builtin:tiny' in the checkpoint and "
             "'builtin:tiny-long' now; its weights were trained from 'builtin:tiny', so a run keeps its model (to "
             "train another model, start a new run)"),
        Case("policy-a-sequence-classifier", ["run", *SMALL_RUN, "model.name_or_path=builtin:tiny-verifier"],
             expect="config key 'model.name_or_path': builtin:tiny-verifier is not a causal LM: its config.json "
             "names Qwen2ForSequenceClassification, not a causal-LM head (*ForCausalLM); a reward model goes in "
             "rewards (name: reward_model)"),
        Case("fewer-prompts-than-a-step", ["run", *SMALL_RUN, "data.path=train.jsonl", *columns],
             _write("train.jsonl", JSONL),
             expect="config key 'train.prompts_per_step': a step needs 8 different prompts, but train.jsonl "
             "[train] has 3 usable; set train.prompts_per_step to at most 3, or give more data"),
        Case("eval-more-new-tokens-than-positions",
             ["eval", "run/checkpoint_1", "--max-new-tokens", "600", "--limit", "2"], _checkpoint_copy(),
             expect="--max-new-tokens: 600 completion tokens exceed the 512 positions of run/checkpoint_1 "
             "(max_position_embeddings); with data.max_prompt_length=256 it can be at most 256"),
        Case("correctness-plugin-raises", ["run", *SMALL_RUN, "data.correctness=plugin_check_raises:check"],
             _write("plugin_check_raises.py", "def check(completion, gold):\n    raise ValueError('boom')\n"),
             model_may_load=True, writes_ok=True,
             expect=r"^config key 'data\.correctness': plugin_check_raises:check raised ValueError: boom on "
             r"'.*' \(gold '\d+'\); fix the check$"),
        Case("show-a-checkpoint", ["show", "run/checkpoint_1"], _checkpoint_copy(),
             expect="run/checkpoint_1 is a checkpoint folder; show reads its run's rollouts: dapo-train show run"),
        Case("show-where-not-a-number", ["show", "run", "--where", "reward < -0.5 truncated"], _checkpoint_copy(),
             expect="--where: 'reward < -0.5 truncated' compares with <, which needs a number, not '-0.5 truncated'; "
             "join terms with ',' or 'and' (reward<-0.5, truncated)"),
        Case("a-section-given-a-value", ["run", *SMALL_RUN, "train=5"],
             expect="config key 'train': is a section, not a value; set its keys, e.g. train.max_steps=..."),
        Case("a-key-without-equals", ["run", "train.max_steps", "3"],
             expect="config file not found: train.max_steps; to set that key write KEY=VALUE: train.max_steps=..."),
        Case("yaml-a-key-outside-its-section", ["run", "top.yaml", *SMALL_RUN], _write("top.yaml", "max_steps: 3\n"),
             expect=f"config key 'max_steps': unknown key; did you mean 'train.max_steps'? (valid: {VALID_SECTIONS})"),
        Case("parquet-no-rows", ["run", *SMALL_RUN, "data.path=train.parquet", *columns], _parquet([]),
             expect="could not read split 'train' of train.parquet: train.parquet holds no rows"),
        Case("data-every-prompt-too-long", ["run", *SMALL_RUN, "data.path=long.jsonl", *columns],
             _write("long.jsonl", LONG_ROWS), absent=("Token indices sequence length",),
             expect="no usable prompts in long.jsonl [train]: 3 rows, 0 prompts kept; dropped: 0 unreadable answer, "
             "3 too long, 0 empty question, 0 question not text; raise data.max_prompt_length=256 (the longest prompt "
             "has 7101 tokens)"),
    ]


def make_trained_run(root: Path) -> None:
    """A 2-step run with checkpoint_1 and checkpoint_2, trained once for the checkpoint cases: they resume
    from checkpoint_1, so a refusal that moved checkpoint_2 aside first would show as a change."""
    from dapo_train.config.load import load_config
    from dapo_train.train.loop import train

    out = root / "trained" / "run"
    cfg = load_config(None, [
        "rollout.group_size=2", "rollout.max_new_tokens=40", "train.prompts_per_step=2", "train.micro_batch_size=4",
        "train.max_steps=2", "checkpoint.every_steps=1", "eval.every_steps=1", "eval.num_items=4",
        "eval.final_full=false", "logging.progress_bar=false",  # no case reads an eval of the whole split
        f"output_dir={out}",
    ])
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the tally's (--json)
        train(cfg)
    TRAINED_RUN.append(out)


def file_cases() -> list[Case]:
    return (yaml_cases() + data_cases() + model_cases() + reward_model_cases() + checkpoint_cases() + plugin_cases()
            + command_cases() + message_cases())
