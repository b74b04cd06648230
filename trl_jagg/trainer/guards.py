"""Guards every process agrees on: a flag raised on any process, non-finite values stopped before they are applied.

Each process must take the same branch (no rank left waiting in a collective the others skipped), so every check
reduces its flag over the processes first.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.trainer_utils import get_last_checkpoint

from trl_jagg.utils.errors import NonFiniteError

NON_FINITE_FIX = (
    "Resume from it (from an earlier one if the run had just resumed from it) with max_grad_norm > 0, noise_level "
    "and guidance_scale in their usual ranges, or dtype float32; a lower learning_rate needs a fresh run (a resume "
    "keeps the checkpoint's optimizer and schedule)."
)


def any_process(accelerator: Any, flag: bool) -> bool:
    """Whether ``flag`` holds on any process (a sum-reduce; no collective on one process)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor(float(flag), device=accelerator.device)
    return bool(accelerator.reduce(value, reduction="sum") > 0)


def largest_over_processes(accelerator: Any, value: float) -> float:
    """``value``'s largest over the processes (every process calls it at the same point; no collective on one)."""
    if accelerator.num_processes == 1:
        return value
    local = torch.tensor([value], device=accelerator.device, dtype=torch.float64)
    return float(accelerator.gather(local).max())


def last_checkpoint_note(run_dir: str) -> str:
    """A sentence naming the latest ``checkpoint-N`` in ``run_dir``, or saying there is none. Not called "good": the
    run may have just resumed from it (its files passed the resume checks, yet the values led here)."""
    last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    if last is None:
        return f"No checkpoint was saved before it in {run_dir}."
    return f"Latest checkpoint: {last}."


def stop_if_non_finite(
    accelerator: Any, quantity: str, value: torch.Tensor | float | None, *, step: int, run_dir: str
) -> None:
    """Raise :class:`NonFiniteError` naming optimizer step ``step`` (1-based, the one being computed), ``quantity``
    and the latest checkpoint when ``value`` holds a NaN or an infinity on any process."""
    if value is None:
        return
    bad = not bool(torch.isfinite(torch.as_tensor(value)).all())
    if any_process(accelerator, bad):
        raise NonFiniteError(
            f"Non-finite {quantity} at step {step}: training stopped before the optimizer applied it. "
            f"{last_checkpoint_note(run_dir)} {NON_FINITE_FIX}"
        )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a (possibly FSDP2 DTensor) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor (this process's shards) holds only finite values."""
    tensors = [local_tensor(t) for t in tensors]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True
