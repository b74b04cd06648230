"""The types the CLI flags convert dataclass fields to, checked for values that reach a dataclass without a flag
(the Python API, and YAML values, which TRL's parser sets as argparse defaults and argparse converts only when
they are strings)."""

from __future__ import annotations

import numbers
import types
import typing
from typing import Any

_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_ITEM_NAMES = {int: "integers", float: "numbers", str: "strings"}


def flag_type(hint: Any) -> tuple[type, type | None, bool] | None:
    """``hint`` as ``(kind, item, optional)`` for the types a flag converts to (int, float, bool, str, a list of
    one of them, optionally ``| None``); ``None`` for anything else (enums, dicts, unions), which is not checked."""
    args = typing.get_args(hint)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None
        hint, optional = rest[0], len(rest) < len(args)
    if hint in (int, float, bool, str):
        return (hint, None, optional)
    item = typing.get_args(hint)[0] if typing.get_origin(hint) is list and typing.get_args(hint) else None
    if item in (int, float, str):
        return (list, item, optional)
    return None


def has_kind(value: Any, kind: type) -> bool:
    """Whether ``value`` is a ``kind`` (int, float, bool or str) as a flag would convert it: a bool is neither an
    integer nor a number, an integer is a number."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, kind)


def type_problem(value: Any, hint: Any) -> str | None:
    """``None`` when ``value`` has the flag type of ``hint`` (a scalar of a list's item type counts, as a list of
    one); otherwise the expected type in words, e.g. ``"an integer"``."""
    expected = flag_type(hint)
    if expected is None:
        return None
    kind, item, optional = expected
    if value is None:
        ok = optional
    elif kind is list:
        ok = has_kind(value, item) or (isinstance(value, (list, tuple)) and all(has_kind(v, item) for v in value))
    else:
        ok = has_kind(value, kind)
    if ok:
        return None
    name = f"a list of {_ITEM_NAMES[item]}" if kind is list else _KIND_NAMES[kind]
    return f"{name} or None" if optional else name


__all__ = ["flag_type", "has_kind", "type_problem"]
