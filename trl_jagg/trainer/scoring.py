"""Rewards scored with one outcome on every process: a failure anywhere raises :class:`RewardFailure` everywhere,
so the trainer can save the steps trained so far (a collective) before stopping; used by the rollouts and by the
evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..rewards import compute_rewards
from .guards import any_process


class RewardFailure(Exception):
    """A reward function failed on some process (a rollout, an evaluation); raised on every process alike, so the
    trainer can save the steps trained so far (a collective) before stopping. ``error`` is this process's own failure,
    ``None`` when another process failed."""

    def __init__(self, error: Exception | None):
        super().__init__(str(error) if error is not None else "a reward function failed on another process")
        self.error = error


def scored_rewards(
    reward_funcs: Sequence[Callable[..., Any]],
    accelerator: Any,
    prompts: list[str],
    images: list,
    *,
    weights: Sequence[float] | None,
    retries: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~trl_jagg.rewards.compute_rewards`, raising :class:`RewardFailure` on every process when it failed on
    any of them. A process without prompts (an evaluation split over more processes than prompts) calls no reward
    but joins the check."""
    failure: Exception | None = None
    return_value: tuple[torch.Tensor, dict[str, torch.Tensor]] = (torch.zeros(0), {})
    try:
        if prompts:
            return_value = compute_rewards(reward_funcs, prompts, images, weights, retries=retries, **kwargs)
    except Exception as error:  # raised below, once every process knows
        failure = error
    if any_process(accelerator, failure is not None):
        raise RewardFailure(failure)
    return return_value
