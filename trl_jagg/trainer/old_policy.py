"""An old policy: a copy of the trainable weights that follows the trained ones after each rollout's updates,
``old <- decay * old + (1 - decay) * current``. DiffusionNFT's samples the rollouts and gives the ``v_old`` of its
loss (decay :func:`~trl_jagg.core.nft.old_policy_decay`; the reference code keeps it as a second LoRA adapter,
``"old"``, updated the same way after every epoch); AWM's KL-EMA and DGPO's clip reference follow with
:func:`~trl_jagg.core.awm.linear_ramp_decay`.

Each process keeps its own part of every weight, in float32 so that a bf16 average does not lose the ``(1 - decay)``
share: under FSDP2 or DeepSpeed ZeRO-3 its shard (:func:`~trl_jagg.trainer.sharding.aligned_parts`, as the EMA does).
Checkpoints hold the whole weights (``nft_old_policy.safetensors``, gathered) with the optimizer step it last
followed, so a resumed run samples with the same policy as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trl_jagg.trainer.checkpoint_checks import damaged_file, old_policy_stamp
from trl_jagg.trainer.files import OLD_POLICY_FILE
from trl_jagg.trainer.sharding import aligned_parts, local_parts, whole, whole_shape


class OldPolicy:
    """The sampling policy's weights beside the trained ones.

    Args:
        parameters: returns the trainable parameters (the backbone's, in a fixed order).
        decay: the decay at an optimizer step (``GRPOJaggConfig.nft_decay_type``'s, for DiffusionNFT).
        objective: the objective that keeps it, stamped into the saved file and named in errors.
        accelerator: the trainer's, to refuse accelerate's FSDP version 1 plugin (as the EMA does).
    """

    def __init__(
        self,
        parameters: Callable[[], list[torch.nn.Parameter]],
        decay: Callable[[int], float],
        *,
        objective: str = "nft",
        accelerator: Any = None,
    ):
        fsdp = accelerator is not None and getattr(accelerator.state, "fsdp_plugin", None) is not None
        if fsdp and not accelerator.is_fsdp2:  # FSDP1's flat parameters are neither whole weights nor DTensor shards
            raise ValueError(
                f"objective={objective!r} is not supported with FSDP version 1. Use FSDP2 (fsdp_version: 2, as "
                "examples/accelerate_configs/fsdp2.yaml), DeepSpeed or DDP."
            )
        self.parameters = parameters
        self.decay = decay
        self.objective = objective
        self.weights = [p.detach().float().clone() for p in local_parts(parameters())]
        self.followed_step = 0
        """The optimizer step at which the old policy last followed the trained weights."""

    @torch.no_grad()
    def follow(self, global_step: int) -> None:
        """After the updates of a rollout, at optimizer step ``global_step``: move towards the trained weights (once
        per step: a rollout that took no optimizer step leaves the policy as it is)."""
        if global_step == self.followed_step:
            return
        decay = self.decay(global_step)
        for old, part in zip(self.weights, aligned_parts(self.weights, self.parameters())):
            old.mul_(decay).add_(part.detach().to(old.device, torch.float32), alpha=1.0 - decay)
        self.followed_step = global_step

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The old policy's weights in place of the trained ones for the duration of the block."""
        parts = aligned_parts(self.weights, self.parameters())
        trained = [p.detach().clone() for p in parts]
        with torch.no_grad():
            for part, old in zip(parts, self.weights):
                part.copy_(old)
        try:
            yield
        finally:
            with torch.no_grad():
                for part, weight in zip(parts, trained):
                    part.copy_(weight)

    def save(self, folder: str, *, checkpoint_step: int, write: bool = True) -> None:
        """Write the whole weights into ``folder``, stamped with the step they last followed and ``checkpoint_step``
        (the checkpoint's optimizer step, which a resume compares with the checkpoint's own), where ``write``: the
        main process. Under sharding every process must call it: the weights are gathered one at a time."""
        params = self.parameters()
        aligned_parts(self.weights, params)
        tensors = {str(i): whole(w, p).to("cpu").contiguous() for i, (w, p) in enumerate(zip(self.weights, params))}
        if write:
            stamp = {
                "step": str(self.followed_step),
                "checkpoint_step": str(checkpoint_step),
                "objective": self.objective,
            }
            save_file(tensors, os.path.join(folder, OLD_POLICY_FILE), metadata=stamp)

    def load(self, folder: str) -> None:
        """Read what :meth:`save` wrote; refuses a file of another model or another set of trained weights."""
        path = os.path.join(folder, OLD_POLICY_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"objective={self.objective!r} but {path} is missing: the checkpoint was not saved by a "
                f"{self.objective!r} run. Resume it with its own objective, or start a new run."
            )
        stamp = old_policy_stamp(path)
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError) as error:
            raise damaged_file(path, error) from error
        shapes = [whole_shape(p) for p in self.parameters()]
        if (
            sorted(tensors, key=int) != [str(i) for i in range(len(shapes))]
            or [tuple(tensors[str(i)].shape) for i in range(len(shapes))] != shapes
        ):
            raise ValueError(f"{path} does not match the trained weights of this model (other LoRA or model?).")
        device = self.weights[0].device if self.weights else "cpu"
        # Whole tensors: cut to this process's parts where the weights are sharded, at their next use.
        self.weights = [tensors[str(i)].to(device=device, dtype=torch.float32) for i in range(len(shapes))]
        self.followed_step = int(stamp["step"])
