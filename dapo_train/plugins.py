"""What a user names in a config instead of a built-in: by-name registries and `pkg.module:function` imports.

Every choice between variants (rewards, policy objectives, loss reductions, rollout corrections,
engines) is a dict from a config name to a function or class, filled by a `@register(name)`
decorator (decorator_for), so a test or a plugin adds a variant without editing the module that
uses it. A name with a colon is imported (import_plugin) and its signature checked before anything
heavy loads (require_signature); each failure is one ConfigError naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from dapo_train.errors import ConfigError

T = TypeVar("T")


def decorator_for(table: dict[str, T]) -> Callable[[str], Callable[[T], T]]:
    """`register = decorator_for(TABLE)`, then `@register("name")` puts the decorated object in TABLE
    under "name" and returns it unchanged (a later registration of the same name replaces it)."""

    def register(name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            table[name] = entry
            return entry

        return add

    return register


def import_plugin(path: str, key: str) -> Callable:
    """The function a config names by import path, 'pkg.module:function' (rewards, data.correctness);
    ConfigError naming `key` when it cannot be imported or is not callable. The current folder is on
    the import path, as under `python -m dapo_train` (the `dapo-train` command's own sys.path[0] is
    its script's folder): my_rewards.py beside the config imports as my_rewards. It comes after the
    installed packages, so a file there cannot stand in for one of them."""
    module_name, _, attr = path.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            key, f"cannot import module '{module_name}' ({err}); it is looked for in the current folder ({here}), "
            "then PYTHONPATH and the installed packages"
        ) from err
    except Exception as err:  # the plugin's own code failed while importing
        raise ConfigError(key, f"importing '{module_name}' failed: {type(err).__name__}: {err}") from err
    fn: object = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ConfigError(key, f"module '{module_name}' has no attribute '{attr}'")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(key, f"'{path}' is not a function but {fn!r} ({type(fn).__name__})")
    return fn


def require_signature(fn: Callable, args: tuple, key: str, refusal: str) -> None:
    """A plugin's signature must take `args` (its call in the trainer), checked when the config is read:
    ConfigError(key, refusal with {err} filled in) if it cannot. A function without a readable signature
    (C code) passes: calling it will tell."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as err:
        raise ConfigError(key, refusal.format(err=err)) from None
    except ValueError:
        pass
