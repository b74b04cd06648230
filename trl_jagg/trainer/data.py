"""How the Trainer's dataloader feeds rollouts: whole prompt groups, an order a resumed run replays."""

from __future__ import annotations

from typing import Any

import torch
from trl.trainer.utils import RepeatSampler


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` whose shuffle depends only on ``(seed, epoch)``, so a resumed run sees the order an
    uninterrupted run would (the parent draws every epoch from one generator, which a restart resets)."""

    def set_epoch(self, epoch: int) -> None:
        if self.seed is not None:
            self.generator = torch.Generator().manual_seed(self.seed + epoch)


def identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dataloader's batch is the list of rows: the generation stage reads the prompts and reward columns."""
    return features
