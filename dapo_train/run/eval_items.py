"""Per-item eval records inside a run folder, so that two runs can be compared item by item.

    eval_items/step_<N>.jsonl    every periodic eval (step 0 first): the fixed subset of eval.num_items
    eval_items/final_<N>.jsonl   the end-of-run eval on the whole eval split (eval.final_full), N = last step
    eval_items/sampled_<N>.jsonl the periodic eval's K samples per item (eval.samples), K records per item

One JSON object per item, in item order: uid ("<split>:<row>"), gold, extracted (None: no answer),
correct (strict: the answer block, as the reward grades), answer_correct (the answer block, else the
last \\boxed{}, else the last number; absent in records written before it), format_ok, length (tokens,
EOS included), truncated, completion, with K samples an item its sample index, and with reward models
configured their scores ({key: value}).
Written by the main process, atomically. A resumed run drops the files of steps after its checkpoint,
as metrics.jsonl drops those rows, so the folder never holds records of weights the run no longer has.

EvalKind says how each kind is logged in metrics.jsonl: the periodic eval as `accuracy` and
`eval/<metric>`, the final one as `final_accuracy` and `final/<metric>`, the sampled one as `eval/sampled/<metric>`
(evaluation/sampled.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dapo_train.run.files import read_jsonl, write_jsonl_atomic

ITEMS_DIR = "eval_items"
RECORD_KEYS = ("uid", "gold", "extracted", "correct", "answer_correct", "format_ok", "length", "truncated",
               "completion")
OPTIONAL_KEYS = ("sample", "scores")  # K > 1 samples an item; reward models configured
_FILE_RE = re.compile(r"^(step|final|sampled)_(\d+)\.jsonl$")


@dataclass(frozen=True)
class EvalKind:
    """name: the file prefix; accuracy: its accuracy key in metrics.jsonl; prefix: the prefix of its
    other metrics; seconds: the key of its time."""

    name: str
    accuracy: str
    prefix: str
    seconds: str


PERIODIC = EvalKind("step", "accuracy", "eval/", "seconds_eval")
FINAL = EvalKind("final", "final_accuracy", "final/", "seconds_final_eval")
SAMPLED = EvalKind("sampled", "eval/sampled/pass_at_1", "eval/sampled/", "seconds_eval_sampled")


def items_path(run_dir: Path, kind: EvalKind, step: int) -> Path:
    return Path(run_dir) / ITEMS_DIR / f"{kind.name}_{step}.jsonl"


def write_items(run_dir: Path, kind: EvalKind, step: int, records: list[dict]) -> Path:
    """The eval's records (evaluate.completion_records), each cut to RECORD_KEYS and the OPTIONAL_KEYS it
    has."""
    path = items_path(run_dir, kind, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(path, [{key: record[key] for key in (*RECORD_KEYS, *OPTIONAL_KEYS) if key in record}
                              for record in records])
    return path


def saved_evals(run_dir: Path) -> dict[tuple[str, int], Path]:
    """(kind name, step) -> file, for every per-item file of the run."""
    folder = Path(run_dir) / ITEMS_DIR
    found = {}
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if match := _FILE_RE.match(path.name):
            found[(match.group(1), int(match.group(2)))] = path
    return found


def items_after(run_dir: Path, step: int | None) -> list[Path]:
    """The per-item files of evals after `step` (None: all of them)."""
    return [path for (_, saved_step), path in saved_evals(run_dir).items() if step is None or saved_step > step]


def drop_items(run_dir: Path) -> None:
    """A fresh run in an old folder without checkpoints starts its records anew, as its logs do."""
    for path in items_after(run_dir, None):
        path.unlink()


def read_items(path: Path) -> list[dict]:
    return read_jsonl(path)
