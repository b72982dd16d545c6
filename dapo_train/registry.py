"""The one shape every by-name registry shares: a dict from a config name to a function or class,
filled by a `@register(name)` decorator, so a test or a plugin adds a variant without editing the
module that uses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

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
