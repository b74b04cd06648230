"""trl_jagg: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients.

The trainer and its config are imported lazily, so ``import trl_jagg.jagg`` (the pure-torch engine) and the CLI's
``--help`` do not pay for importing diffusers and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    # One class: DDPOJaggTrainer is its name; GRPOJaggTrainer is its documented alias, pairing with GRPOJaggConfig as
    # TRL's GRPOTrainer with GRPOConfig.
    "GRPOJaggTrainer": ("trl_jagg.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "DDPOJaggTrainer": ("trl_jagg.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "GRPOJaggConfig": ("trl_jagg.grpo_jagg_config", "GRPOJaggConfig"),
}

if TYPE_CHECKING:
    from .ddpo_jagg_trainer import DDPOJaggTrainer
    from .ddpo_jagg_trainer import DDPOJaggTrainer as GRPOJaggTrainer
    from .grpo_jagg_config import GRPOJaggConfig


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'trl_jagg' has no attribute {name!r}")


__all__ = ["DDPOJaggTrainer", "GRPOJaggConfig", "GRPOJaggTrainer", "__version__"]
