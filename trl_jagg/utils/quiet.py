"""Third-party notices that a trl_jagg run triggers and that tell its user nothing, each filtered by its own message
on its own logger or warning category (never a blanket filter): a run prints what matters.

- DeepSpeed logs ``Setting accelerator to CPU ...`` when it is imported on a machine without a GPU. accelerate
  imports it to unwrap any model (``save_pretrained``, the Trainer's ``unwrap_model``) whenever it is installed,
  also in runs that do not use it. A CPU run that does use DeepSpeed still gets DeepSpeed's other messages.
"""

from __future__ import annotations

import logging

DEEPSPEED_LOGGER = "DeepSpeed"
"""The name DeepSpeed's logger registers with ``logging`` (``deepspeed.utils.logging``)."""
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU."


class DropMessages(logging.Filter):
    """Drops the records whose message starts with one of ``prefixes``; lets every other record through."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def quiet_deepspeed_cpu_notice() -> None:
    """Drop DeepSpeed's CPU-accelerator notice (the filter goes on DeepSpeed's own logger, which ``logging`` keeps by
    name, so it applies before DeepSpeed is imported). Calling it again adds nothing."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, DropMessages) and DEEPSPEED_CPU_NOTICE in f.prefixes for f in logger.filters):
        logger.addFilter(DropMessages(DEEPSPEED_CPU_NOTICE))


__all__ = ["DropMessages", "quiet_deepspeed_cpu_notice"]
