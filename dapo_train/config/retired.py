"""Retired keys and values: config keys are a public interface, so an old run folder's config.yaml
stays readable (eval, --resume) after a key is removed or a value renamed; each gets a notice.

config/load.py applies these to every dict it builds a Config from (defaults, YAML files,
KEY=VALUE overrides, saved configs); a new retirement is one entry in a table below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import yaml

logger = logging.getLogger(__name__)

# Dotted key -> why it went.
RETIRED_KEYS = {
    "checkpoint.save_optimizer": "checkpoints always hold the optimizer state (resume needs it)",
    "train.logprob_chunk_size": "replaced by train.logprob_chunk_mib (chunks sized in MiB of logits, not rows)",
}
# (dotted key, old value) -> new value.
RENAMED_VALUES = {
    ("dapo.filter_metric", "reward"): "total",
}
# Old dotted key -> (new dotted key, old value -> new value); the new key must sit in the same section.
RENAMED_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    # One tracker name reads as a list of one; "none" as the empty list.
    "logging.tracker": ("logging.trackers", lambda old: [] if old in ("none", None) else [old]),
}


def _parent(data: dict, dotted: str) -> tuple[dict | None, str]:
    """(the section holding `dotted`'s last part, that part); None when a section is missing."""
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


def renamed_override(item: str) -> str:
    """`OLD=VALUE` for a renamed key -> `NEW=converted VALUE`, with the notice: the new key already
    holds its default in the dict being overridden, and an explicit old key must win over that."""
    key, sep, raw = item.partition("=")
    if not sep or key.strip() not in RENAMED_KEYS:
        return item
    new_key, convert = RENAMED_KEYS[key.strip()]
    try:
        value = convert(yaml.safe_load(raw) if raw.strip() else "")
    except yaml.YAMLError:
        value = convert(raw)
    new_item = f"{new_key}={yaml.safe_dump(value, default_flow_style=True).strip()}"
    logger.warning("KEY=VALUE: config key '%s' is now '%s': read %s as %s", key.strip(), new_key, item, new_item)
    return new_item


def upgrade_retired(data: dict, source: str, notify: bool = True) -> None:
    """Drop retired keys from a config dict and rename old values, in place, one notice each
    (none with notify=False, for a file whose notices another reading of it gives)."""
    log = logger.warning if notify else logger.debug
    for dotted, why in RETIRED_KEYS.items():
        node, last = _parent(data, dotted)
        if node is not None and last in node:
            del node[last]
            log("%s: config key '%s' is retired and ignored: %s", source, dotted, why)
    for dotted, (new_key, convert) in RENAMED_KEYS.items():
        node, last = _parent(data, dotted)
        if node is None or last not in node:
            continue
        old = node.pop(last)
        new_last = new_key.rsplit(".", 1)[-1]
        if new_last in node:
            log("%s: config key '%s' is now '%s', which is also set; %s=%r is ignored", source, dotted, new_key,
                dotted, old)
        else:
            node[new_last] = convert(old)
            log("%s: config key '%s' is now '%s': read %s=%s as %s=%s", source, dotted, new_key, dotted, old,
                new_key, node[new_last])
    for (dotted, old), new in RENAMED_VALUES.items():
        node, last = _parent(data, dotted)
        if node is not None and node.get(last) == old:
            node[last] = new
            log("%s: %s=%s is now called %s=%s", source, dotted, old, dotted, new)
