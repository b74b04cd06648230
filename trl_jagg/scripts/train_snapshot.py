"""The ``trl-jagg train`` parser's option names and help, saved to a JSON file so that typos, unknown fields and
``--help`` are answered before trl, transformers, diffusers and peft are imported (tens of seconds on a loaded
machine, against a fraction of a second to read the file).

The file records what it was built from: the source of the modules that declare the fields and parse them, and the
versions of transformers (``TrainingArguments``) and trl (the parser). Where any of them differs (an edited config, another
transformers), :func:`load_snapshot` returns ``None`` and ``train`` parses the slow way: a stale file costs time,
never a wrong answer. Rebuild it with ``python -m trl_jagg.scripts.train_snapshot``.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from typing import Any

SNAPSHOT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_parser.json")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP_COLUMNS = 119
"""The width the saved help is wrapped to (argparse wraps to the terminal otherwise)."""
PARSER_SOURCES = ("scripts/train.py", "scripts/utils.py")
"""The parser's own code, relative to the package; the modules that declare the fields are found when it is built."""


def _field_sources() -> list[str]:
    """The files, relative to the package, of every trl_jagg class whose fields ``train`` parses (imports them)."""
    import inspect

    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.scripts.train import ScriptArguments

    classes = [
        k for cls in (ScriptArguments, GRPOJaggConfig) for k in cls.__mro__ if k.__module__.startswith("trl_jagg")
    ]
    return sorted({os.path.relpath(inspect.getsourcefile(k), _PACKAGE_DIR) for k in classes} | set(PARSER_SOURCES))


def snapshot_key(sources: list[str]) -> str:
    """A digest of the files ``sources`` (relative to the package) and of the installed transformers and trl
    versions."""
    digest = hashlib.sha256()
    for package in ("transformers", "trl"):
        digest.update(f"{package}=={metadata.version(package)}\n".encode())
    for source in sources:
        digest.update(source.encode() + b"\n")
        with open(os.path.join(_PACKAGE_DIR, source), "rb") as handle:
            digest.update(handle.read())
    return digest.hexdigest()


def build_snapshot() -> dict[str, Any]:
    """The snapshot of the parser as this installation builds it (imports the whole parser)."""
    from trl_jagg.scripts.train import make_parser

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
    sources = _field_sources()
    return {"sources": sources, "key": snapshot_key(sources), "options": parser.option_names(), "help": help_text}


def write_snapshot(path: str = SNAPSHOT_PATH) -> str:
    """Write :func:`build_snapshot` to ``path``; returns the path."""
    with open(path, "w") as handle:
        json.dump(build_snapshot(), handle, indent=0, sort_keys=True)
        handle.write("\n")
    return path


def load_snapshot(path: str = SNAPSHOT_PATH) -> dict[str, Any] | None:
    """The saved snapshot when it matches this installation's sources and versions, else ``None``."""
    try:
        with open(path) as handle:
            snapshot = json.load(handle)
        current = snapshot.get("key") == snapshot_key(list(snapshot["sources"]))
    except (OSError, ValueError, KeyError, TypeError, metadata.PackageNotFoundError):
        return None
    return snapshot if current else None


if __name__ == "__main__":
    print(f"wrote {write_snapshot()}")
