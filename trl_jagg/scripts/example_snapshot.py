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
never a wrong answer. Rebuild it with ``python -m trl_jagg.scripts.example_snapshot`` (``make docs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import runpy
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from trl_jagg.scripts.train_snapshot import load_snapshot, snapshot_key

SNAPSHOT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "example_parser.json")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "examples")
"""A checkout's ``examples/`` folder, whose scripts' own dataclasses the snapshot also saves (a wheel has none)."""
PARSER_SOURCES = ("scripts/utils.py", "scripts/example_snapshot.py")
"""The parser's own code, relative to the package; the modules that declare the config's fields are found when the
snapshot is built."""
_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false"}
"""The argparse actions a dataclass field becomes (``HfArgumentParser``), by class name: what ``add_argument`` is
given back."""


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


def describe(dtype: type) -> list[dict[str, Any]]:
    """The help groups the command parser makes of the dataclass ``dtype``: each one's title and arguments."""
    from trl_jagg.scripts.utils import CommandParser

    parser = CommandParser((dtype,), "", "")
    groups = []
    for group in parser._action_groups[2:]:  # after argparse's "positional arguments" and "options"
        arguments = []
        for action in group._group_actions:
            arguments.append(
                {
                    "action": _ACTIONS[type(action).__name__],
                    "option_strings": action.option_strings,
                    "dest": action.dest,
                    "nargs": action.nargs,
                    "default": str(action.default),  # as the help shows it (argparse.SUPPRESS is a string)
                    "choices": None if action.choices is None else [str(choice) for choice in action.choices],
                    "required": action.required,
                    "help": action.help,
                    "metavar": action.metavar,
                }
            )
        groups.append({"title": group.title, "arguments": arguments})
    return groups


def config_sources() -> list[str]:
    """The files, relative to the package, of the classes that declare ``GRPOJaggConfig``'s fields, and the
    parser's own."""
    import inspect

    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig

    classes = [k for k in GRPOJaggConfig.__mro__ if k.__module__.startswith("trl_jagg")]
    return sorted({os.path.relpath(inspect.getsourcefile(k), _PACKAGE_DIR) for k in classes} | set(PARSER_SOURCES))


def example_arguments(folder: str = EXAMPLES_DIR) -> list[type]:
    """The examples' own dataclasses: ``ScriptArguments``, ``ExampleArguments`` and every one an
    ``examples/train_*.py`` in ``folder`` declares (each file run as a module, not as a script)."""
    from trl_jagg.scripts.examples import ExampleArguments, ScriptArguments

    found = {ScriptArguments, ExampleArguments}
    for path in sorted(glob.glob(os.path.join(folder, "train_*.py"))):
        for value in runpy.run_path(path).values():
            if isinstance(value, type) and issubclass(value, ScriptArguments):
                found.add(value)
    return sorted(found, key=lambda cls: cls.__qualname__)


def build_snapshot(arguments: Iterable[type] | None = None) -> dict[str, Any]:
    """The snapshot as this installation builds it: ``GRPOJaggConfig``'s arguments and those of ``arguments`` (by
    default :func:`example_arguments`), keyed by their :func:`fingerprint` (imports the whole parser)."""
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig

    own = {}
    for dtype in example_arguments() if arguments is None else arguments:
        key = fingerprint(dtype)
        if key is None:
            raise TypeError(f"{dtype.__qualname__}: its type hints do not resolve, so no parser can be built for it.")
        own[key] = describe(dtype)
    sources = config_sources()
    return {"sources": sources, "key": snapshot_key(sources), "config": describe(GRPOJaggConfig), "arguments": own}


def write_snapshot(path: str = SNAPSHOT_PATH) -> str:
    """Write :func:`build_snapshot` to ``path``; returns the path."""
    with open(path, "w") as handle:
        json.dump(build_snapshot(), handle, indent=0, sort_keys=True)
        handle.write("\n")
    return path


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


if __name__ == "__main__":
    print(f"wrote {write_snapshot()}")
