"""trl_jagg: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients.

The trainer and its config are imported lazily, so ``import trl_jagg.core.jagg`` (the pure-torch engine) and the CLI's
``--help`` do not pay for importing diffusers and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    # One class: DDPOJaggTrainer is its name; GRPOJaggTrainer is its documented alias, pairing with GRPOJaggConfig as
    # TRL's GRPOTrainer with GRPOConfig.
    "GRPOJaggTrainer": ("trl_jagg.trainer.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "DDPOJaggTrainer": ("trl_jagg.trainer.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "GRPOJaggConfig": ("trl_jagg.config.grpo_jagg_config", "GRPOJaggConfig"),
}

if TYPE_CHECKING:
    MODEL_FAMILIES: str
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer as GRPOJaggTrainer


def __getattr__(name: str) -> Any:
    if name == "MODEL_FAMILIES":
        # The supported model families in words, for ``trl-jagg --help``: read from the family records (on first
        # use, so that ``import trl_jagg.recipes`` imports nothing of the models).
        from trl_jagg.models.families import families_in_words

        return families_in_words()
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'trl_jagg' has no attribute {name!r}")


__all__ = ["MODEL_FAMILIES", "DDPOJaggTrainer", "GRPOJaggConfig", "GRPOJaggTrainer", "__version__"]
