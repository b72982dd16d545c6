"""What a run writes in its folder, by the exact names it writes: the kinds run/outputs.py's rule reads
(a run folder is the run's when it holds the marker; --overwrite and preflight --keep remove only these), and
the run's files that must not be links.

An entry is the run's only in the exact form the run writes it: checkpoint_<N>/ (and only one it wrote:
run/checkpoint.py), .tmp_checkpoint_<N>_<pid>/,
abandoned_after_step<N>_<YYYYmmdd-HHMMSS>[_<n>]/, eval_items/ and rollouts/ (their record files), and fixed
names. Inside a checkpoint: the files transformers, peft and the trainer save there, and the results
`dapo-train eval` adds. A user's checkpoint_1.tar.gz or checkpoint_1_notes.md is not the run's, nor are the
notes inside checkpoint_3/: --overwrite is refused while any such entry is there, and names it.

A run appends to its logs and rewrites config.yaml in place: through a symbolic link that would change the
file the link points to, through a hard link every other name of the file. So a run refuses to start (or
resume) while one of its files is a link, before anything is written or loaded.
"""

from __future__ import annotations

import re
from pathlib import Path

from dapo_train.config.load import CONFIG_FILE, config_from_dict, read_saved_config
from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.run.checkpoint import CHECKPOINT_KIND, CHECKPOINT_RE, PARTIAL_CHECKPOINT_KIND, STATE_FILE, TEMPORARY_RE
from dapo_train.run.eval_items import ITEMS_DIR
from dapo_train.run.logs import LOG_FILES, METRICS_FILE, RUN_LOG, RUN_STATUS
from dapo_train.run.outputs import OutputKind
from dapo_train.run.rollouts import ROLLOUTS_DIR

# Written in output_dir when a run starts: the folder is a run's, which --overwrite may replace.
RUN_MARKER = ".dapo-train-run"
# Sub-folder of a run holding what a resume from an earlier checkpoint left behind (folder.set_aside_abandoned).
ABANDONED_PREFIX = "abandoned_after_step"
# What every run saved in config.yaml, from the first version on: the resolved config, never a hand-written one.
RESOLVED_KEYS = ("output_dir", "model", "data", "rollout", "train")

# A run's eval_items/ and rollouts/: step_<N>.jsonl and final_<N>.jsonl, each written beside and renamed
# (run/files.py: .<name>.<pid>.tmp).
RECORDS_KIND = OutputKind("run's record folder", None,
                          patterns=(r"(step|final)_\d+\.jsonl", r"\.(step|final)_\d+\.jsonl\.\d+\.tmp"))
_RECORD_FOLDERS = ((re.escape(ITEMS_DIR), RECORDS_KIND), (re.escape(ROLLOUTS_DIR), RECORDS_KIND))
# What folder.set_aside_abandoned moves there: later checkpoints, records and log rows, and the config.
ABANDONED_KIND = OutputKind(
    "abandoned steps' folder", None, names=(CONFIG_FILE, *LOG_FILES.values()),
    nested=((CHECKPOINT_RE.pattern.strip("^$"), CHECKPOINT_KIND), *_RECORD_FOLDERS),
)


def run_kind(cfg: Config) -> OutputKind:
    """What a run writes at the top of output_dir (run/outputs.py's rule): the marker, config.yaml, the
    three logs, run.log and run_status.json, eval_items/ and rollouts/ (their record files), checkpoint_<step>/
    and their temporary folders, what a resume set aside, and TensorBoard's folder, named logging.project. A
    folder without the marker is a run when an older dapo-train wrote it (_older_run)."""
    project = cfg.logging.project  # a name, never a pattern; none where it is a path
    return OutputKind(
        "dapo-train run folder", RUN_MARKER,
        names=(CONFIG_FILE, *LOG_FILES.values(), RUN_LOG, RUN_STATUS,
               *((project,) if Path(project).name == project else ())),
        nested=((CHECKPOINT_RE.pattern.strip("^$"), CHECKPOINT_KIND),
                (TEMPORARY_RE.pattern.strip("^$"), PARTIAL_CHECKPOINT_KIND),
                (rf"{ABANDONED_PREFIX}\d+_\d{{8}}-\d{{6}}(_\d+)?", ABANDONED_KIND), *_RECORD_FOLDERS),
        older=_older_run,
    )


def _older_run(folder: Path) -> str | None:
    """Why `folder`, which has no run marker, is not a run an older dapo-train wrote, or None when it is one:
    such a run saved its resolved config with metrics.jsonl or a checkpoint_<step>/ beside it, and every
    checkpoint_<step>/ with its trainer state. A config of the user's or another trainer's is no run."""
    checkpoints = sorted(path for path in folder.iterdir() if CHECKPOINT_RE.match(path.name))
    if not (folder / CONFIG_FILE).is_file():
        return f"no {CONFIG_FILE}"
    if not checkpoints and not (folder / METRICS_FILE).is_file():
        return f"no {METRICS_FILE} or checkpoint_<step>/ beside its {CONFIG_FILE}"
    try:
        saved = read_saved_config(folder / CONFIG_FILE, notify=False)
        config_from_dict(saved)
    except UserError as exc:
        said = str(exc).splitlines()[0].split(" (valid: ")[0]  # the key and the problem, not every valid key
        return f"{CONFIG_FILE} is not a dapo-train config ({said[:200]})"
    except OSError as exc:
        return f"{CONFIG_FILE} cannot be read ({exc.strerror or exc})"
    missing = [key for key in RESOLVED_KEYS if key not in saved]
    if missing:
        return f"{CONFIG_FILE} is not a config a run saved (it names no {', '.join(missing)})"
    stateless = [path.name for path in checkpoints if not (path / STATE_FILE).is_file()]
    if stateless:
        return f"{stateless[0]}/ holds no {STATE_FILE}, so no dapo-train run saved it"
    return None


def refuse_links(run_dir: Path, cfg: Config) -> None:
    """Refuse (UserError, one line) a run folder where the run would write through a link: its config.yaml,
    logs or run.log a symbolic link or a file with other hard links, or its marker or the folders it writes into
    (eval_items/, rollouts/, TensorBoard's) a symbolic link."""
    files = (CONFIG_FILE, *LOG_FILES.values(), RUN_LOG)
    for name in (*files, RUN_MARKER, ITEMS_DIR, ROLLOUTS_DIR, cfg.logging.project):
        path = run_dir / name
        if path.is_symlink():
            what = "a symbolic link"
        elif name in files and path.is_file() and path.stat().st_nlink > 1:
            what = f"a hard link (one of {path.stat().st_nlink} names of one file)"
        else:
            continue
        raise UserError(f"{path} is {what}: a run never writes its files through a link, which would change the "
                        "file it points to; remove the link (that file stays as it is) or choose another output_dir "
                        "(nothing was changed)")
