"""The examples' parser saved argument by argument (``example_parser.json``), so that ``python examples/<script>.py
--help`` and a misspelt flag are answered before trl, transformers, diffusers and peft are imported.

``trl-jagg train``'s snapshot (:mod:`~trl_jagg.scripts.train_snapshot`) saves one help text. An example's help shows
the example's own defaults (its preset's values), so this file saves each argument instead (option strings, help,
default, choices) of :class:`~trl_jagg.GRPOJaggConfig` and of the examples' own dataclasses (``ScriptArguments``,
``ExampleArguments`` and those an example declares), and :func:`saved_parser` rebuilds a plain ``argparse`` parser
from them: set to the example's defaults, it prints the help the full parser prints and knows the same names.

The config's arguments hold while the files that declare its fields and parse them, and the installed transformers
and trl, are those recorded (:func:`~trl_jagg.scripts.train_snapshot.snapshot_key`); an own dataclass's while its
fields are those recorded (:func:`fingerprint`). Otherwise the example parses the slow way: a stale file costs time,
never a wrong answer. Rebuild it with ``python -m trl_jagg.scripts.snapshots`` (``make docs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from trl_jagg.scripts.train_snapshot import load_snapshot

SNAPSHOT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "example_parser.json")


def option_names(actions: Iterable[argparse.Action]) -> dict[str, str]:
    """Every accepted ``--flag`` spelling of ``actions`` mapped to its field name, ``--config`` included."""
    names = {"--config": "config"}
    for action in actions:
        for option in action.option_strings:
            if option.startswith("--"):
                names[option] = action.dest
    return names


def library_parent(dtype: type) -> type | None:
    """The first dataclass base of ``dtype`` from another top-level package (``TrainingArguments`` under
    ``GRPOJaggConfig``): the parser shows the fields it declares apart, as inherited."""
    library = dtype.__module__.split(".")[0]
    return next(
        (b for b in dtype.__mro__[1:] if dataclasses.is_dataclass(b) and b.__module__.split(".")[0] != library), None
    )


def fingerprint(dtype: type) -> str | None:
    """A digest of what the parser reads of a dataclass: its help group, the base shown as inherited, and each
    field's name, type, default and metadata (help); ``None`` when its type hints do not resolve."""
    try:
        hints = typing.get_type_hints(dtype)
    except (NameError, TypeError, AttributeError, SyntaxError):  # the full parser answers (and reports it)
        return None
    parent = library_parent(dtype)
    described: list[Any] = [
        getattr(dtype, "_argument_group_name", dtype.__name__),
        None if parent is None else (parent.__name__, parent.__module__.split(".")[0]),
    ]
    for item in dataclasses.fields(dtype):
        if item.init:
            if item.default_factory is not dataclasses.MISSING:
                default = repr(item.default_factory())
            else:
                default = "<required>" if item.default is dataclasses.MISSING else repr(item.default)
            described.append((item.name, repr(hints[item.name]), default, repr(sorted(item.metadata.items()))))
    return hashlib.sha256(repr(described).encode()).hexdigest()


def saved_parser(
    arguments: type, defaults: Mapping[str, Any] | None = None, path: str = SNAPSHOT_PATH, **kwargs: Any
) -> argparse.ArgumentParser | None:
    """A plain ``argparse`` parser over the dataclass ``arguments`` and ``GRPOJaggConfig``, rebuilt from the
    snapshot at ``path`` and set to ``defaults``; ``None`` when the snapshot is stale or lacks ``arguments``.

    It is for the help and the names only: it converts no value (the full parser parses). ``kwargs`` go to
    ``argparse.ArgumentParser`` (``prog``, ``usage``, ``description``, ``epilog``), as the full parser gets them.
    """
    snapshot = load_snapshot(path)
    own = None if snapshot is None else snapshot.get("arguments", {}).get(fingerprint(arguments))
    if own is None:
        return None
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False, **kwargs
    )
    for group in [*own, *snapshot["config"]]:
        target = parser.add_argument_group(group["title"])
        for argument in group["arguments"]:
            options = dict(argument)
            option_strings, action = options.pop("option_strings"), options.pop("action")
            if options["default"] == argparse.SUPPRESS:
                options["default"] = argparse.SUPPRESS
            if action != "store":  # a switch: no value, no choices
                options = {key: options[key] for key in ("dest", "default", "required", "help")}
            target.add_argument(*option_strings, action=action, **options)
    if defaults:
        parser.set_defaults(**defaults)
    return parser
