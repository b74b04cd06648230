"""The ``trl-jagg train`` parser's option names and help, saved to a JSON file so that typos, unknown fields and
``--help`` are answered before trl, transformers, diffusers and peft are imported (tens of seconds on a loaded
machine, against a fraction of a second to read the file).

The file records what it was built from: the source of the modules that declare the fields and parse them, and the
versions of transformers (``TrainingArguments``) and trl (the parser). Where any of them differs (an edited config, another
transformers), :func:`load_snapshot` returns ``None`` and ``train`` parses the slow way: a stale file costs time,
never a wrong answer. Rebuild it with ``python -m trl_jagg.scripts.snapshots`` (``make docs``), which writes both
parsers' files.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from typing import Any

SNAPSHOT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_parser.json")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def load_snapshot(path: str = SNAPSHOT_PATH) -> dict[str, Any] | None:
    """The saved snapshot when it matches this installation's sources and versions, else ``None``."""
    try:
        with open(path) as handle:
            snapshot = json.load(handle)
        current = snapshot.get("key") == snapshot_key(list(snapshot["sources"]))
    except (OSError, ValueError, KeyError, TypeError, metadata.PackageNotFoundError):
        return None
    return snapshot if current else None
