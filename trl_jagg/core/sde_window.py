"""Which steps of a rollout are stochastic, and the ODE schedule around them (pure Python and torch).

A rollout with an SDE window samples only ``size`` consecutive steps stochastically and trains exactly those; the
other steps are the deterministic ODE. Where the window sits:

- ``"random"`` (Flow-GRPO-Fast): its start is drawn uniformly in ``[0, max_start]`` at every rollout.
- ``"progressive"`` (MixGRPO): its start slides over training, ``stride`` steps later every ``shift_interval``
  *rollouts*, and rolls back to step 0 after its last position (MixGRPO's ``GRPOTrainingStates`` with
  ``sample_strategy="progressive"``, ``prog_overlap`` and ``roll_back``, whose ``update_iteration`` runs once per
  rollout). As MixGRPO's, the window never reaches the last two steps (``max_timesteps = num_steps - 2``): a window
  that would is cut short there. Its default ``max_start`` is the last start whose window is not empty (MixGRPO also
  visits the empty one at ``num_steps - 2``); a smaller ``max_start`` limits the slide to the first starts.
- ``"fixed"``: the window is held at ``max_start`` at every rollout (default 0: the high-noise steps, where a
  flow model settles the layout and colours, so the trained steps keep moving what they moved at the start).

Outside the window the ODE may take fewer, larger steps (:func:`compressed_path`), which a higher-order solver keeps
accurate (MixGRPO-Flash's DPM-Solver++ after the window, on as many steps as MixGRPO counts: :func:`mixgrpo_post_steps`).
"""

from __future__ import annotations

import math
import random

import torch

WINDOW_SCHEDULES = ("random", "progressive", "fixed")


def default_max_start(schedule: str, num_steps: int, size: int) -> int:
    """The latest window start when none is set: the first half of the schedule for ``"random"`` (Flow-GRPO-Fast),
    for ``"progressive"`` the last start before MixGRPO's end (:func:`progressive_end`; the window there may be cut
    short, but not empty), and 0 for ``"fixed"`` (the window on the first, high-noise steps)."""
    if schedule == "fixed":
        return 0
    if schedule == "progressive":
        return max(0, progressive_end(num_steps) - 1)
    return max(0, min(num_steps // 2, num_steps - size))


def progressive_end(num_steps: int) -> int:
    """The step the ``"progressive"`` window stops before: MixGRPO's ``max_timesteps = sampling_steps - 2``, so its
    windows, ``range(start, min(start + size, max_timesteps))``, never train the last two steps."""
    return num_steps - 2


def max_window_start(schedule: str, num_steps: int, size: int) -> int:
    """The largest ``max_start`` a schedule accepts: every window full (``num_steps - size``), except
    ``"progressive"``, whose windows are cut at :func:`progressive_end` and must keep at least one step."""
    if schedule == "progressive":
        return max(0, progressive_end(num_steps) - 1)
    return num_steps - size


def sde_window(
    schedule: str,
    *,
    num_steps: int,
    size: int,
    max_start: int | None = None,
    rollout: int = 0,
    stride: int = 1,
    shift_interval: int = 1,
    seed: int = 0,
) -> list[int]:
    """The ``size`` consecutive stochastic steps of a rollout of ``num_steps`` steps.

    Args:
        schedule: one of :data:`WINDOW_SCHEDULES`.
        max_start: latest window start (defaults to :func:`default_max_start`); ``"fixed"`` holds the window there.
        rollout: how many rollouts came before this one in the run (``"progressive"``: MixGRPO's counter, one
            ``update_iteration`` per rollout, whatever the optimizer steps a rollout feeds).
        stride: steps the window moves at each shift (``"progressive"``; MixGRPO's ``prog_overlap_step``).
        shift_interval: rollouts between shifts (``"progressive"``; MixGRPO's ``iters_per_group``).
        seed: seeds the draw of the start (``"random"``).
    """
    if schedule not in WINDOW_SCHEDULES:
        raise ValueError(f"`schedule` must be one of {WINDOW_SCHEDULES}, got {schedule!r}.")
    if not 1 <= size <= num_steps:
        raise ValueError(f"The window `size` must be in [1, num_steps={num_steps}], got {size}.")
    if schedule == "progressive" and progressive_end(num_steps) < 1:
        raise ValueError(
            f"A `progressive` window needs `num_steps` >= 3 (it never trains the last two), got {num_steps}."
        )
    if max_start is None:
        max_start = default_max_start(schedule, num_steps, size)
    last = max_window_start(schedule, num_steps, size)
    if not 0 <= max_start <= last:
        raise ValueError(f"`max_start` must be in [0, {last}] for a {schedule} window of {size}, got {max_start}.")
    if schedule == "random":
        start = random.Random(seed).randint(0, max_start)
    elif schedule == "fixed":
        start = max_start
    else:
        if stride < 1 or shift_interval < 1:
            raise ValueError(f"`stride` and `shift_interval` must be >= 1, got {stride} and {shift_interval}.")
        positions = max_start // stride + 1  # starts 0, stride, ..., then back to 0
        start = (rollout // shift_interval) % positions * stride
        return list(range(start, min(start + size, progressive_end(num_steps))))
    return list(range(start, start + size))


def mixgrpo_post_steps(num_steps: int, last: int, ode_step_ratio: float) -> int:
    """The ODE steps MixGRPO-Flash takes after a window whose last step is ``last`` (``dpm_apply_strategy="post"``):
    it counts ``num_steps - last`` points after the window, keeps ``int`` of their ``dpm_post_compress_ratio``
    share (at least 1) as the points of a new schedule that ends at 0, and so takes one step fewer than it keeps;
    here at least one (MixGRPO's single point leaves the sample short of sigma 0)."""
    points = int(max((num_steps - last) * ode_step_ratio, 1))
    return max(1, points - 1)


def compressed_path(
    num_steps: int, window: list[int], ode_step_ratio: float, *, mixgrpo_post: bool = False
) -> list[int]:
    """Indices into a schedule of ``num_steps + 1`` sigmas that a rollout visits: every index of the window and its
    end, and on each side of it ``max(1, round(ode_step_ratio * n))`` ODE steps instead of the side's ``n``, on
    schedule points spread evenly over the side (so the backbone sees timesteps of the pipeline's own schedule).
    With ``mixgrpo_post`` the side after the window takes MixGRPO-Flash's count (:func:`mixgrpo_post_steps`)
    instead. ``ode_step_ratio = 1`` visits every index."""
    if not 0 < ode_step_ratio <= 1:
        raise ValueError(f"`ode_step_ratio` must be in (0, 1], got {ode_step_ratio}.")
    first, end = window[0], window[-1] + 1

    def side(begin: int, stop: int, kept: int) -> list[int]:
        count = stop - begin
        if count == 0:
            return []
        kept = min(kept, count)
        return [begin + math.floor(i * count / kept) for i in range(kept)]

    after = num_steps - end
    after_kept = (
        mixgrpo_post_steps(num_steps, end - 1, ode_step_ratio) if mixgrpo_post else round(ode_step_ratio * after)
    )
    return (
        side(0, first, max(1, round(ode_step_ratio * first)))
        + list(range(first, end))
        + side(end, num_steps, max(1, after_kept))
        + [num_steps]
    )


def path_schedule(
    sigmas: torch.Tensor, timesteps: torch.Tensor, path: list[int], window: list[int]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The ``(sigmas, timesteps, stochastic_steps)`` of the rollout that visits ``path`` (see
    :func:`compressed_path`): its own step indices, the window's among them."""
    index = torch.tensor(path, device=sigmas.device)
    positions = [path.index(k) for k in window]
    return sigmas[index], timesteps[index[:-1].to(timesteps.device)], positions
