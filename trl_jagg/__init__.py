"""trl_jagg: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients."""

__version__ = "0.1.0"
