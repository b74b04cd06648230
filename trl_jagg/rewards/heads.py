"""The scoring head shared by the LAION aesthetic predictor and ImageReward."""

from __future__ import annotations

import torch
from torch import nn


class RewardMLP(nn.Module):
    """The improved-aesthetic-predictor MLP: ``in -> 1024 -> 128 -> 64 -> 16 -> 1``, linear layers only.

    The original has no activations between its layers (the "linearMSE" head), and ImageReward reuses the same
    head on BLIP features; the dropout layers are kept so that state-dict keys (``layers.0``, ``layers.2``,
    ``layers.4``, ``layers.6``, ``layers.7``) match the published checkpoints.
    """

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(in_features, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor]) -> RewardMLP:
        """Build the head with the input width found in ``state_dict`` and load it strictly, in eval mode."""
        if "layers.0.weight" not in state_dict:
            raise KeyError(f"Not a reward MLP state dict (no 'layers.0.weight'); keys: {sorted(state_dict)[:8]}...")
        head = cls(state_dict["layers.0.weight"].shape[1])
        head.load_state_dict(state_dict)
        return head.eval()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Scores of shape ``(batch,)`` for features of shape ``(batch, in_features)``."""
        return self.layers(features).squeeze(-1)
