"""Checking tables a user wrote (node configs, simulator scenarios): unknown keys and wrong types get one
message that names the key, the valid keys and the closest one, and the type in plain words.

Pure helpers: the caller wraps `TableError` in its own error type (ConfigError, ScenarioError) and adds the
file name.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import PeerloomError

TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
              dict: "a table"}


class TableError(PeerloomError, ValueError):
    """A key is unknown or a value has the wrong type; the message says which and what is valid."""


def check_keys(table: Mapping[str, Any], allowed: Iterable[str], where: str = "") -> None:
    """TableError naming the first unknown key of `table`, the closest allowed key and all allowed keys."""
    allowed = sorted(allowed)
    for key in sorted(set(table) - set(allowed)):
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TableError(f"{_at(where, key)}: unknown key{hint}; valid keys: {', '.join(allowed)}")


def describe(types: tuple[type, ...]) -> str:
    """`(int,)` -> "an integer"; `(float, int)` -> "a number"."""
    if float in types:
        types = tuple(t for t in types if t is not int)
    return " or ".join(TYPE_WORDS.get(t, t.__name__) for t in types)


def typed(table: Mapping[str, Any], key: str, types: type | tuple[type, ...], default: Any = None,
          where: str = "") -> Any:
    """`table[key]` (or `default` when absent or None) if it is one of `types`, else TableError.

    An integer passes where a float is asked (and is returned as a float); a bool never passes as a number,
    and a float is never an integer. NaN and infinities are refused as numbers.
    """
    types = types if isinstance(types, tuple) else (types,)
    if table.get(key) is None:  # absent (TOML has no null; Python callers pass None for "not set")
        return default
    value = table[key]
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        raise TableError(f"{_at(where, key)} must be {describe(types)}, got {value!r}")
    return value


def check_table(table: Mapping[str, Any], keys: Mapping[str, type | tuple[type, ...]], where: str = "") -> None:
    """TableError for the first unknown key of `table` (`check_keys`) or the first value of a known key that is
    not of its types (`typed`); `keys` maps each allowed key to its types."""
    check_keys(table, keys, where)
    for key, types in keys.items():
        typed(table, key, types, where=where)


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key
