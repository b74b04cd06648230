"""trl_jagg: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients.

The trainer and its config are imported lazily, so ``import trl_jagg.core.jagg`` (the pure-torch engine) and the CLI's
``--help`` do not pay for importing diffusers and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

MODEL_FAMILIES = (
    "text-to-image (Flux, SD3 / SD3.5, Qwen-Image, Z-Image, FLUX.2 klein and dev), image editing (FLUX.1 Kontext, "
    "Qwen-Image-Edit and Edit-Plus) and text-to-video (Wan2.1, Wan2.2 A14B and TI2V-5B)"
)
"""The supported model families in words, for ``trl-jagg --help`` (one list, kept equal to ``MODEL_ADAPTERS`` by
``tests/test_cli.py``)."""

_LAZY = {
    # One class: DDPOJaggTrainer is its name; GRPOJaggTrainer is its documented alias, pairing with GRPOJaggConfig as
    # TRL's GRPOTrainer with GRPOConfig.
    "GRPOJaggTrainer": ("trl_jagg.trainer.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "DDPOJaggTrainer": ("trl_jagg.trainer.ddpo_jagg_trainer", "DDPOJaggTrainer"),
    "GRPOJaggConfig": ("trl_jagg.config.grpo_jagg_config", "GRPOJaggConfig"),
}

if TYPE_CHECKING:
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer as GRPOJaggTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'trl_jagg' has no attribute {name!r}")


__all__ = ["MODEL_FAMILIES", "DDPOJaggTrainer", "GRPOJaggConfig", "GRPOJaggTrainer", "__version__"]
