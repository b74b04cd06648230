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

LIKELY_CAUSES = (
    # (what the quantity's name starts with, its likeliest cause, the settings that fix it)
    ("latents", "the sampler diverged (noise_level or guidance_scale outside their usual ranges, or the transformer "
     "overflowing in float16)", "noise_level and guidance_scale in their usual ranges, or dtype bfloat16 / float32"),
    ("decoded", "the VAE overflowed in half precision (its latents were finite)",
     "dtype bfloat16 or float32 (the VAE decodes in it)"),
    ("loss", "the policy moved too far from the rollout's in one step (an exploding probability ratio)",
     "a lower learning_rate, epsilon (the clip range) in its usual range, max_grad_norm > 0"),
    ("gradient", "the backward overflowed (a loss too large for the dtype, or an exploding ratio)",
     "max_grad_norm > 0, a lower learning_rate, or dtype float32"),
    ("weights", "the optimizer step diverged", "a lower learning_rate and max_grad_norm > 0"),
    ("EMA", "the weights it averages diverged", "a lower learning_rate and max_grad_norm > 0"),
)  # fmt: skip


def non_finite_advice(run_dir: str, quantity: str, value: torch.Tensor | float | None = None) -> str:
    """What to do after a non-finite ``quantity`` (``value``: what was seen, to tell an overflow from a NaN): the
    latest checkpoint in ``run_dir`` or that there is none, the likeliest cause, and the settings to resume (or start
    again) with."""
    cause, fix = next(
        ((cause, fix) for start, cause, fix in LIKELY_CAUSES if quantity.startswith(start)),
        ("", "max_grad_norm > 0, a lower learning_rate, or dtype float32"),
    )
    if value is not None:
        seen = torch.as_tensor(value).detach().float()
        if not bool(seen.isnan().any()):  # only infinities: an overflow
            cause = f"{cause}; the values overflowed to infinity" if cause else "the values overflowed to infinity"
    likely = f"Likeliest cause: {cause}. " if cause else ""
    last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    if last is None:
        return f"{likely}{last_checkpoint_note(run_dir)} Start the run again with {fix}."
    caveat = (
        " (a resume keeps the checkpoint's optimizer and learning-rate schedule: a lower learning_rate needs a fresh run)"
        if "learning_rate" in fix
        else ""
    )
    return (
        f"{likely}{last_checkpoint_note(run_dir)} Resume from it (from an earlier one if the run had just resumed from "
        f"it) with {fix}{caveat}."
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
            f"{non_finite_advice(run_dir, quantity, value)}"
        )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a (possibly FSDP2 DTensor) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor (this process's shards) holds only finite values."""
    tensors = [local_tensor(t) for t in tensors]
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True
