"""trl_jagg: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients."""

from .ddpo_jagg_trainer import DDPOJaggTrainer
from .grpo_jagg_config import GRPOJaggConfig

__version__ = "0.1.0"

__all__ = ["DDPOJaggTrainer", "GRPOJaggConfig", "__version__"]
