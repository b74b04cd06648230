"""Rewards scored with one outcome on every process: a failure anywhere raises :class:`RewardFailure` everywhere,
so the trainer can save the steps trained so far (a collective) before stopping; used by the rollouts and by the
evaluation."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from accelerate.utils import gather_object

from trl_jagg.rewards import RewardInterrupted, compute_rewards
from trl_jagg.trainer.guards import any_process, largest_over_processes
from trl_jagg.trainer.interrupts import interrupted
from trl_jagg.utils.errors import TrainingError

logger = logging.getLogger(__name__)

MAX_REPORTED_CHARS = 500
"""The start of another process's error shown in this process's error."""


class RewardFailure(Exception):
    """A reward function failed on some process (a rollout, an evaluation); raised on every process alike, so the
    trainer can save the steps trained so far (a collective) before stopping. ``error`` is this process's own failure,
    ``None`` when another process failed; ``elsewhere`` says what failed on the other processes; ``signal_number``
    is the stop signal that abandoned a reward on some process (0: none did)."""

    def __init__(self, error: Exception | None, elsewhere: str = "", signal_number: int = 0):
        super().__init__(str(error) if error is not None else "a reward function failed on another process")
        self.error, self.elsewhere, self.signal_number = error, elsewhere, signal_number

    def raise_with_note(self, saved: str | None, trained_steps: int, during: str) -> NoReturn:
        """Raise the reward's own error (or, on the processes where it did not fail, a :class:`TrainingError`) with
        a note naming ``saved``, the checkpoint of the ``trained_steps`` so far; ``during`` says when it failed. A
        stop signal that abandoned the reward raises :class:`~trl_jagg.utils.errors.TrainingInterrupted` on every
        process instead, as a signal between steps does."""
        if self.signal_number:
            output_dir = os.path.dirname(saved) if saved else ""
            raise interrupted(
                self.signal_number, output_dir, trained_steps if saved else 0, f"while a reward was scoring {during}"
            ) from self.error
        note = f"{saved} holds the {trained_steps} trained steps: resume from it." if saved else ""
        note = note or "No trained step was lost (none to save)."
        if self.error is None:
            elsewhere = f" ({self.elsewhere})" if self.elsewhere else ""
            raise TrainingError(f"A reward function failed on another process {during}{elsewhere}. {note}") from None
        logger.warning("A reward function failed %s. %s", during, note)
        if hasattr(self.error, "add_note"):  # Python >= 3.11: shown with the error
            self.error.add_note(f"The run stopped {during}. {note}")
        raise self.error from None


def scored_rewards(
    reward_funcs: Sequence[Callable[..., Any]],
    accelerator: Any,
    prompts: list[str],
    images: list,
    *,
    weights: Sequence[float] | None,
    retries: int,
    timeout: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~trl_jagg.rewards.compute_rewards` (each reward within its deadline, ``timeout`` =
    ``reward_timeout``), raising :class:`RewardFailure` on every process when it failed on any of them. A process
    without prompts (an evaluation split over more processes than prompts) calls no reward but joins the check.

    A reward that hangs on one process reaches the check at its deadline, as a failure: the other processes, waiting
    in the check, stop then too, not at the process group's timeout."""
    failure: Exception | None = None
    return_value: tuple[torch.Tensor, dict[str, torch.Tensor]] = (torch.zeros(0), {})
    try:
        if prompts:
            return_value = compute_rewards(
                reward_funcs, prompts, images, weights, retries=retries, timeout=timeout, **kwargs
            )
    except Exception as error:  # raised below, once every process knows
        failure = error
    if any_process(accelerator, failure is not None):
        signalled = failure.signal_number if isinstance(failure, RewardInterrupted) else 0
        signal_number = int(largest_over_processes(accelerator, signalled))  # every process stops alike
        raise RewardFailure(failure, _failures_elsewhere(accelerator, failure), signal_number)
    return return_value


def _failures_elsewhere(accelerator: Any, failure: Exception | None) -> str:
    """What failed on each other process, e.g. ``"process 1: RewardTimeout: Reward 'x' did not return ..."``, for the
    error of the processes where nothing failed (a collective, on every process alike)."""
    if accelerator.num_processes == 1:
        return ""
    summary = None if failure is None else f"{type(failure).__name__}: {str(failure)[:MAX_REPORTED_CHARS]}"
    reports = gather_object([summary])  # one per process, in process order
    return "; ".join(
        f"process {index}: {report}"
        for index, report in enumerate(reports)
        if report is not None and index != accelerator.process_index
    )
