"""How the config's checks report a problem: an error naming the field and the fix, or a warning pointing at the
user's ``GRPOJaggConfig(...)`` call."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def fail(name: str, problem: str, fix: str) -> None:
    """Raise the config's error: ``GRPOJaggConfig.<name> <problem>. <fix>``."""
    raise ValueError(f"GRPOJaggConfig.{name} {problem}. {fix}")


def _is_generated_init(frame: Any) -> bool:
    """The ``__init__`` that ``dataclasses`` writes (compiled from a string)."""
    return frame.f_code.co_name == "__init__" and frame.f_code.co_filename == "<string>"


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the first frame outside this package and the dataclass's generated ``__init__``: the user's
    ``GRPOJaggConfig(...)`` (or ``from_recipe(...)``) call, whichever check in the package warns."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(_CONFIG_DIR) or _is_generated_init(frame)):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level + 1)
