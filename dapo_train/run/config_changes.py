"""What a resume changes from the settings its checkpoint was saved with, named key by key before the model loads.

`--resume` continues with the checkpoint's config.yaml and the KEY=VALUE overrides (folder.resume_config).
Three files can hold other settings, and none changes the run, or is dropped, without a word:
- KEY=VALUE: each changed key is listed, old -> new;
- the checkpoint's config.yaml, edited after the save (its trainer_state.pt keeps the config it was saved
  with): the edit applies, as the documented source of a resume's settings, and each edited key is listed;
- the run folder's config.yaml, which the resume replaces with the settings it continues with: where it
  holds other values (an edit, or an earlier resume's overrides), they are discarded, each named with the
  KEY=VALUE that would apply it.
"""

from __future__ import annotations

import copy
import logging
import shlex
from pathlib import Path

import yaml

from dapo_train.config.load import CONFIG_FILE, load_config, read_saved_config
from dapo_train.config.retired import upgrade_retired
from dapo_train.config.schema import Config
from dapo_train.errors import UserError
from dapo_train.run.checkpoint import SAVED_CONFIG_KEY, STATE_FILE, load_state
from dapo_train.run.folder import config_differences, resume_command

logger = logging.getLogger(__name__)

MOVED = ("output_dir", "run_name")  # where the run is, not how it trains: a moved run changes them


def warn_config_changes(cfg: Config, checkpoint: Path) -> None:
    """Name every difference between `cfg`, which a resume from `checkpoint` trains with, and the settings the
    checkpoint was saved with, the checkpoint's config.yaml and the run folder's config.yaml."""
    in_checkpoint = load_config(None, [], base=read_saved_config(checkpoint / CONFIG_FILE))  # new keys: defaults
    at_save = _saved_with(checkpoint) or in_checkpoint
    edited = config_differences(at_save, in_checkpoint, skip=MOVED)
    if edited:
        logger.warning("%s/%s was edited after the checkpoint was saved, and the resume applies it: %s",
                       checkpoint.name, CONFIG_FILE, ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in edited))
    changed = config_differences(in_checkpoint, cfg)
    if Path(in_checkpoint.output_dir).resolve() == Path(cfg.output_dir).resolve():
        changed = [change for change in changed if change[0] != "output_dir"]
    if changed:
        logger.warning(
            "resuming %s with settings changed from %s's: %s", cfg.output_dir, checkpoint.name,
            ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changed),
        )
    _discarded(cfg, checkpoint, at_save)


def _saved_with(checkpoint: Path) -> Config | None:
    """The config `checkpoint` was saved with, as its trainer state keeps it (None: saved before it did, or a
    model folder with a config.yaml and no trainer state, which the resume's own checks refuse)."""
    if not (checkpoint / STATE_FILE).is_file():
        return None
    saved = load_state(checkpoint, mmap=True).get(SAVED_CONFIG_KEY)
    if not isinstance(saved, dict):
        return None
    saved = copy.deepcopy(saved)
    upgrade_retired(saved, str(checkpoint), notify=False)  # keys a later version retired, as in the file
    return load_config(None, [], base=saved)


def _discarded(cfg: Config, checkpoint: Path, at_save: Config) -> None:
    """The values of the run folder's config.yaml that the resume does not apply: where it differs from the
    config the checkpoint was saved with (an edit, or a later resume's KEY=VALUE) and from `cfg`. The file is
    replaced with `cfg`, so they would be lost unsaid."""
    path = Path(cfg.output_dir) / CONFIG_FILE
    if not path.is_file():
        return
    try:
        in_run = load_config(None, [], base=read_saved_config(path, notify=False))
    except UserError as exc:
        logger.warning("%s is not a config this version reads (%s); the resume replaces it with the settings it "
                       "continues with, %s's", path, str(exc).splitlines()[0][:200], checkpoint.name)
        return
    edited = {key for key, _, _ in config_differences(in_run, at_save, skip=MOVED)}
    lost = [(key, value, kept) for key, value, kept in config_differences(in_run, cfg, skip=MOVED) if key in edited]
    if lost:
        logger.warning(
            "%s differs from %s/%s, which the resume continues with: %s %s discarded (%s is replaced by the "
            "settings the run continues with); to change a setting on resume, pass KEY=VALUE: %s %s",
            path, checkpoint.name, CONFIG_FILE,
            ", ".join(f"{key} {value!r} ({checkpoint.name}: {kept!r})" for key, value, kept in lost),
            "is" if len(lost) == 1 else "are", CONFIG_FILE, resume_command(checkpoint),
            " ".join(shlex.quote(f"{key}={_value_text(value)}") for key, value, _ in lost),
        )


def _value_text(value: object) -> str:
    """`value` as KEY=VALUE reads it back (as YAML): a text that YAML would read as another value is quoted."""
    if isinstance(value, str) and value:
        try:
            read_back = yaml.safe_load(value)
        except yaml.YAMLError:  # KEY=VALUE keeps such a text as it is
            read_back = value
        if read_back == value:
            return value
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).removesuffix("...\n").strip()
