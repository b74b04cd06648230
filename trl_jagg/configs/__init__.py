"""Configuration files shipped inside the package (as TRL ships ``trl/accelerate_configs``), so that an installed
wheel has them: ``accelerate/<name>.yaml`` (``trl-jagg train --accelerate_config <name>``) and
``recipes/<name>.yaml`` (the presets of :mod:`trl_jagg.recipes` as ``trl-jagg train --config`` files).

A source checkout also reaches them as ``examples/accelerate_configs/`` and ``examples/recipes/`` (links here).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

KINDS = ("accelerate", "recipes")


def config_dir(kind: str) -> Path:
    """The folder of the shipped ``kind`` files (``"accelerate"`` or ``"recipes"``) in the installed package."""
    if kind not in KINDS:
        raise ValueError(f"Unknown config kind {kind!r}: use one of {', '.join(KINDS)}.")
    # A regular installation (wheel, editable or source tree) is a folder on disk, which accelerate needs as a path.
    return Path(str(files(__name__) / kind))


def config_names(kind: str) -> list[str]:
    """The names (file stems) of the shipped ``kind`` files, sorted."""
    return sorted(path.stem for path in config_dir(kind).glob("*.yaml"))
