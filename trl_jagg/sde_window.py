"""Which steps of a rollout are stochastic, and the ODE schedule around them (pure Python and torch).

A rollout with an SDE window samples only ``size`` consecutive steps stochastically and trains exactly those; the
other steps are the deterministic ODE. Where the window sits:

- ``"random"`` (Flow-GRPO-Fast): its start is drawn uniformly in ``[0, max_start]`` at every rollout.
- ``"progressive"`` (MixGRPO): its start slides over training, ``stride`` steps later every ``shift_interval``
  optimizer steps, and rolls back to step 0 after its last position (MixGRPO's ``GRPOTrainingStates`` with
  ``sample_strategy="progressive"``, ``prog_overlap`` and ``roll_back``). With its default ``max_start`` the window
  visits the whole schedule (MixGRPO's full slide); a smaller ``max_start`` limits the slide to the first starts.
- ``"fixed"``: the window is held at ``max_start`` at every rollout (default 0: the high-noise steps, where a
  flow model settles the layout and colours, so the trained steps keep moving what they moved at the start).

Outside the window the ODE may take fewer, larger steps (:func:`compressed_path`), which a higher-order solver keeps
accurate (MixGRPO-Flash's DPM-Solver++ after the window).
"""

from __future__ import annotations

import math
import random

import torch

WINDOW_SCHEDULES = ("random", "progressive", "fixed")


def default_max_start(schedule: str, num_steps: int, size: int) -> int:
    """The latest window start when none is set: the first half of the schedule for ``"random"`` (Flow-GRPO-Fast),
    for ``"progressive"`` every full window that ends before the last step, which is never trained (MixGRPO's
    ``max_timesteps = sampling_steps - 2``), and 0 for ``"fixed"`` (the window on the first, high-noise steps)."""
    if schedule == "fixed":
        return 0
    if schedule == "progressive":
        return max(0, num_steps - 1 - size)
    return max(0, min(num_steps // 2, num_steps - size))


def sde_window(
    schedule: str,
    *,
    num_steps: int,
    size: int,
    max_start: int | None = None,
    step: int = 0,
    stride: int = 1,
    shift_interval: int = 1,
    seed: int = 0,
) -> list[int]:
    """The ``size`` consecutive stochastic steps of a rollout of ``num_steps`` steps.

    Args:
        schedule: one of :data:`WINDOW_SCHEDULES`.
        max_start: latest window start (defaults to :func:`default_max_start`); ``"fixed"`` holds the window there.
        step: the optimizer step the rollout is taken at (``"progressive"``).
        stride: steps the window moves at each shift (``"progressive"``; MixGRPO's ``prog_overlap_step``).
        shift_interval: optimizer steps between shifts (``"progressive"``; MixGRPO's ``iters_per_group``).
        seed: seeds the draw of the start (``"random"``).
    """
    if schedule not in WINDOW_SCHEDULES:
        raise ValueError(f"`schedule` must be one of {WINDOW_SCHEDULES}, got {schedule!r}.")
    if not 1 <= size <= num_steps:
        raise ValueError(f"The window `size` must be in [1, num_steps={num_steps}], got {size}.")
    if max_start is None:
        max_start = default_max_start(schedule, num_steps, size)
    if not 0 <= max_start <= num_steps - size:
        raise ValueError(f"`max_start` must be in [0, {num_steps - size}] for a window of {size}, got {max_start}.")
    if schedule == "random":
        start = random.Random(seed).randint(0, max_start)
    elif schedule == "fixed":
        start = max_start
    else:
        if stride < 1 or shift_interval < 1:
            raise ValueError(f"`stride` and `shift_interval` must be >= 1, got {stride} and {shift_interval}.")
        positions = max_start // stride + 1  # starts 0, stride, ..., then back to 0
        start = (step // shift_interval) % positions * stride
    return list(range(start, start + size))


def compressed_path(num_steps: int, window: list[int], ode_step_ratio: float) -> list[int]:
    """Indices into a schedule of ``num_steps + 1`` sigmas that a rollout visits: every index of the window and its
    end, and on each side of it ``max(1, round(ode_step_ratio * n))`` ODE steps instead of the side's ``n``, on
    schedule points spread evenly over the side (so the backbone sees timesteps of the pipeline's own schedule).
    ``ode_step_ratio = 1`` visits every index."""
    if not 0 < ode_step_ratio <= 1:
        raise ValueError(f"`ode_step_ratio` must be in (0, 1], got {ode_step_ratio}.")
    first, end = window[0], window[-1] + 1

    def side(begin: int, stop: int) -> list[int]:
        count = stop - begin
        if count == 0:
            return []
        kept = max(1, round(ode_step_ratio * count))
        return [begin + math.floor(i * count / kept) for i in range(kept)]

    return side(0, first) + list(range(first, end)) + side(end, num_steps) + [num_steps]


def path_schedule(
    sigmas: torch.Tensor, timesteps: torch.Tensor, path: list[int], window: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The ``(sigmas, timesteps, stochastic_steps)`` of the rollout that visits ``path`` (see
    :func:`compressed_path`): its own step indices, the window's among them."""
    index = torch.tensor(path, device=sigmas.device)
    positions = [path.index(k) for k in window]
    return sigmas[index], timesteps[index[:-1].to(timesteps.device)], positions
