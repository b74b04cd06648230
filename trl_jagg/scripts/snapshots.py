"""Writes the parsers' snapshots that answer ``--help`` and typos before the heavy imports: ``train_parser.json``
(``trl-jagg train``, read by :mod:`~trl_jagg.scripts.train_snapshot`) and ``example_parser.json`` (the examples, read
by :mod:`~trl_jagg.scripts.example_snapshot`).

Building a snapshot imports the whole parser (``train`` and the examples), while the parser reads its snapshot first:
the writer lives apart from the readers so that neither imports the other. Run ``python -m trl_jagg.scripts.snapshots``
(``make docs``) after a config field, its help or a parser changes.
"""

from __future__ import annotations

import glob
import inspect
import json
import os
import runpy
from collections.abc import Iterable
from typing import Any

from trl_jagg.scripts import example_snapshot, train_snapshot
from trl_jagg.scripts.example_snapshot import fingerprint
from trl_jagg.scripts.train_snapshot import snapshot_key

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES_DIR = os.path.join(os.path.dirname(_PACKAGE_DIR), "examples")
"""A checkout's ``examples/`` folder, whose scripts' own dataclasses the snapshot also saves (a wheel has none)."""
HELP_COLUMNS = 119
"""The width the saved help is wrapped to (argparse wraps to the terminal otherwise)."""
TRAIN_PARSER_SOURCES = ("scripts/train.py", "scripts/utils.py")
"""``trl-jagg train``'s parser code, relative to the package; the modules that declare the fields are found when the
snapshot is built."""
EXAMPLE_PARSER_SOURCES = ("scripts/utils.py", "scripts/example_snapshot.py", "scripts/snapshots.py")
"""The examples' parser code (the saved parser's reader and the writer that describes each argument)."""
_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false"}
"""The argparse actions a dataclass field becomes (``HfArgumentParser``), by class name: what ``add_argument`` is
given back."""


def _sources(classes: Iterable[type], parser_sources: Iterable[str]) -> list[str]:
    """The files, relative to the package, of every trl_jagg class in the MROs of ``classes``, and the parser's own."""
    found = {k for cls in classes for k in cls.__mro__ if k.__module__.startswith("trl_jagg")}
    return sorted({os.path.relpath(inspect.getsourcefile(k), _PACKAGE_DIR) for k in found} | set(parser_sources))


def build_train_snapshot() -> dict[str, Any]:
    """``trl-jagg train``'s snapshot as this installation builds it: its option names and help text."""
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.scripts.train import ScriptArguments, make_parser

    parser = make_parser()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_COLUMNS)
    try:
        help_text = parser.format_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    sources = _sources((ScriptArguments, GRPOJaggConfig), TRAIN_PARSER_SOURCES)
    return {"sources": sources, "key": snapshot_key(sources), "options": parser.option_names(), "help": help_text}


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


def build_example_snapshot(arguments: Iterable[type] | None = None) -> dict[str, Any]:
    """The examples' snapshot as this installation builds it: ``GRPOJaggConfig``'s arguments and those of
    ``arguments`` (by default :func:`example_arguments`), keyed by their
    :func:`~trl_jagg.scripts.example_snapshot.fingerprint`."""
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig

    own = {}
    for dtype in example_arguments() if arguments is None else arguments:
        key = fingerprint(dtype)
        if key is None:
            raise TypeError(f"{dtype.__qualname__}: its type hints do not resolve, so no parser can be built for it.")
        own[key] = describe(dtype)
    sources = _sources((GRPOJaggConfig,), EXAMPLE_PARSER_SOURCES)
    return {"sources": sources, "key": snapshot_key(sources), "config": describe(GRPOJaggConfig), "arguments": own}


def write_snapshot(snapshot: dict[str, Any], path: str) -> str:
    """Write ``snapshot`` to ``path`` as the readers load it; returns the path."""
    with open(path, "w") as handle:
        json.dump(snapshot, handle, indent=0, sort_keys=True)
        handle.write("\n")
    return path


def write_snapshots() -> list[str]:
    """Write both snapshots to their package paths; returns the paths."""
    return [
        write_snapshot(build_train_snapshot(), train_snapshot.SNAPSHOT_PATH),
        write_snapshot(build_example_snapshot(), example_snapshot.SNAPSHOT_PATH),
    ]


if __name__ == "__main__":
    for written in write_snapshots():
        print(f"wrote {written}")
