"""Backward calls of an update, shared by the GRPO and DiffusionNFT update stages: ``accelerator.backward`` as the
engine's ``backward_fn``, and the context of one backward unit (DDP's ``no_sync`` / DeepSpeed's deferred step for
all but the last unit of a micro-batch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import DistributedType


@contextlib.contextmanager
def deepspeed_step_deferred(accelerator: Any) -> Iterator[None]:
    """Backward calls inside are not a gradient-accumulation boundary for DeepSpeed: no engine step after them."""
    state = accelerator.gradient_state
    sync = state.sync_gradients
    state._set_sync_gradients(False)
    try:
        yield
    finally:
        state._set_sync_gradients(sync)


def backward(accelerator: Any, loss: torch.Tensor) -> None:
    """``accelerator.backward``; under DeepSpeed without its own division by the accumulation steps: the engine's
    loss weight already has it (the Trainer passes ``scale_wrt_gas=False`` for the same reason)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.backward(loss, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def backward_unit(accelerator: Any, model: torch.nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
    """The context of one backward unit of a micro-batch: all but the last defer the gradient reduction (DDP's
    ``no_sync``) or, under DeepSpeed, the optimizer step: accelerate's DeepSpeed backward steps the engine after
    every backward call of a boundary micro-batch, which would step once per unit. ZeRO-2 reduces at every
    backward call anyway; the engine accumulates them until the single step."""
    if is_last:
        return contextlib.nullcontext()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return deepspeed_step_deferred(accelerator)
    return accelerator.no_sync(model)
