"""Wan2.2 A14B's two experts as the one module the trainer trains: ``transformer`` denoises the high-noise steps
(timesteps at or above the boundary), ``transformer_2`` the low-noise ones, as ``WanPipeline.__call__`` switches."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from diffusers import WanTransformer3DModel

from trl_jagg.utils.errors import CheckpointError

EXPERTS: tuple[str, str] = ("transformer", "transformer_2")
"""The experts' pipeline component names, high-noise first."""

TRAIN_EXPERTS: dict[str, tuple[str, ...]] = {
    "both": EXPERTS,
    "high_noise": EXPERTS[:1],
    "low_noise": EXPERTS[1:],
}
"""``GRPOJaggConfig.train_experts``: its values and the experts each trains."""


class WanExperts(torch.nn.Module):
    """The high-noise expert ``transformer`` and the low-noise expert ``transformer_2`` of a Wan2.2 A14B pipeline,
    held under their pipeline component names (their parameters are ``transformer.*`` and ``transformer_2.*``).

    A backbone call names its expert (``forward(expert, **inputs)``): wrapped by DDP or not, the call goes through
    this module, so a wrapper sees every forward. :attr:`trained` lists the experts that get trainable weights (LoRA
    or all of them, :meth:`trained_parts`); the others stay frozen.

    Args:
        high_noise, low_noise: the pipeline's ``transformer`` and ``transformer_2``.
        boundary_timestep: ``boundary_ratio * num_train_timesteps``: timesteps ``>=`` it go to ``high_noise``.
    """

    def __init__(self, high_noise: WanTransformer3DModel, low_noise: WanTransformer3DModel, boundary_timestep: float):
        super().__init__()
        self.transformer = high_noise
        self.transformer_2 = low_noise
        self.boundary_timestep = boundary_timestep
        self.trained: tuple[str, ...] = EXPERTS

    def expert_of(self, timestep: float | torch.Tensor) -> str:
        """The expert ``WanPipeline.__call__`` calls at scheduler timestep ``timestep``."""
        return EXPERTS[0] if timestep >= self.boundary_timestep else EXPERTS[1]

    def forward(self, expert: str, **inputs: Any) -> Any:
        return getattr(self, expert)(**inputs)

    def trained_parts(self) -> dict[str, WanTransformer3DModel]:
        """The trained experts by component name: what gets LoRA (or trainable weights) and is saved."""
        return {name: getattr(self, name) for name in self.trained}

    # What the trainer reads of a diffusers backbone: the experts share their architecture and placement.
    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def disable_adapters(self) -> None:
        """The base weights of the LoRA-trained experts (the KL reference)."""
        for part in self.trained_parts().values():
            part.disable_adapters()

    def enable_adapters(self) -> None:
        for part in self.trained_parts().values():
            part.enable_adapters()


def check_saved_experts(path: str, trained: Sequence[str], train_experts: str) -> None:
    """A two-expert checkpoint (Wan2.2) holds a folder for each expert this run trains and no other: resumed with
    another ``train_experts``, the weights of an expert would be missing or silently left out."""
    saved = tuple(name for name in EXPERTS if os.path.isdir(os.path.join(path, name)))
    if not saved or saved == tuple(trained):
        return  # no expert folder at all: the checkpoint's weight-file check names what the folder holds
    saved_setting = next((key for key, value in TRAIN_EXPERTS.items() if value == saved), None)
    raise CheckpointError(
        f"{path} holds the weights of the expert(s) {list(saved)} (a run with train_experts={saved_setting!r}); this "
        f"run trains {list(trained)} (train_experts={train_experts!r}). Resume with train_experts="
        f"{saved_setting!r}, or start a fresh run (a new output_dir, without resume_from_checkpoint)."
    )
