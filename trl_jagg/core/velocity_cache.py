"""The rollout's velocities reused by JAGG groups after an optimizer step (pure torch; knows nothing about diffusers).

While the parameters are those that produced the rollout, a JAGG group's intermediate velocities are exactly the
ones the sampler recorded. After an optimizer step they are the old policy's. :func:`corrected_velocity` moves each
one by the change of the group's two endpoints since the rollout (the endpoints are forwarded at the current weights
anyway), interpolated with JAGG's own weights. That is exact when the change is linear in time across the group and
otherwise leaves an error, which matters most where a loss switches: a PPO ratio near its clip edge turns its step's
signal on or off.

What is guaranteed: before the rollout's first optimizer step every mode gives the gradient with recomputed
intermediates (the cache holds exactly those velocities); after it only ``"recompute"`` (the default) does, because
nothing short of running the backbone at an intermediate's own time shows how its velocity moved. A weight change
that leaves a group's endpoints unchanged (a rank-1 change of the timestep embedder orthogonal to the endpoints'
sinusoidal features, which full fine-tuning can make) gives a zero correction while the intermediates move.

``jagg_cache_mode="checked"`` is a heuristic on top of the correction, not a bound: :func:`signal_sensitivity`
measures how far the group's aggregated loss signals (``s_base``, ``s_corr``: all a joint backward sees) move when
every corrected intermediate is moved by as much as the correction moved it, back to the rollout's velocity and as
far beyond, and a group whose signals move by more than a tolerance, relative to their norm, has its intermediates
recomputed. It probes only along the correction, so an error the correction does not see (the case above) passes
it: measured on the demo, 0 of 2 intermediates rejected and the gradient 19-50% off ``"recompute"``'s. On ordinary
Adam steps it behaved as its tolerance says (``docs/jagg.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

VELOCITY_CACHE_MODES = ("recompute", "checked", "corrected", "stale")
"""What the trainer does with the rollout's velocities after an optimizer step since the rollout: recompute the
intermediates without a graph, correct them where :func:`signal_sensitivity` allows it and recompute the others,
correct them all (:func:`corrected_velocity`), or use them as they are. Before the rollout's first optimizer step
every mode uses them as they are (they are exact)."""

SignalFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``s_k = dL_k/dv_k`` of step ``k`` at velocity ``v`` (no backbone involved)."""


def corrected_velocity(
    cached: torch.Tensor,
    alpha: float,
    first_change: torch.Tensor,
    last_change: torch.Tensor,
) -> torch.Tensor:
    """A cached intermediate velocity moved to the current parameters:
    ``v_roll(t_j) + (1 - alpha_j) (v_now(t_0) - v_roll(t_0)) + alpha_j (v_now(t_{W-1}) - v_roll(t_{W-1}))``.

    ``first_change`` / ``last_change`` are the group endpoints' velocity changes since the rollout (detached). Exact
    when the change is linear in time across the group (JAGG's own hypothesis for the Jacobian); otherwise its error
    is the change's curvature, second order in the parameter step. Computed in at least float32, returned in the
    cached velocity's dtype (the dtype a recomputed velocity has).
    """
    dtype = torch.promote_types(cached.dtype, torch.float32)
    moved = cached.to(dtype) + (1 - alpha) * first_change.to(dtype) + alpha * last_change.to(dtype)
    return moved.to(cached.dtype)


def signal_sensitivity(
    signal_fn: SignalFn,
    steps: Sequence[int],
    weights: Sequence[tuple[float, float]],
    velocities: Sequence[torch.Tensor],
    rollout_velocities: Mapping[int, torch.Tensor],
    *,
    signals: Sequence[torch.Tensor] | None = None,
) -> float:
    """How much a joint group's aggregated signals move under a velocity error as large as the correction.

    With ``S = (s_base, s_corr) = sum_j (w_j^base s_j, w_j^corr s_j)`` at ``velocities`` (the endpoints' current ones,
    the intermediates corrected), each corrected intermediate ``v_j`` in ``rollout_velocities`` (its recorded
    velocity ``r_j``) is probed at ``r_j`` (the correction undone) and at ``2 v_j - r_j`` (applied twice); returns the
    larger ``|S_probe - S| / |S|`` of the two probes (norms over both signals, in float64). ``inf`` when ``S`` is
    zero and a probe is not; ``0.0`` when nothing moves.

    Args:
        signal_fn: see :data:`SignalFn`.
        steps: the group's steps, endpoints included.
        weights: ``(w^base, w^corr)`` of each step: ``(1 - alpha_j, alpha_j)`` for JAGG.
        velocities: the velocity of each step, as the group's signals use it.
        rollout_velocities: the recorded velocity of each corrected intermediate (by step).
        signals: each step's signal at ``velocities`` when the caller has them (else computed here).
    """

    def aggregate(weighted: Sequence[tuple[tuple[float, float], torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        base = sum(w[0] * s.double() for w, s in weighted)
        corr = sum(w[1] * s.double() for w, s in weighted)
        return torch.as_tensor(base), torch.as_tensor(corr)

    def norm(pair: tuple[torch.Tensor, torch.Tensor]) -> float:
        return float(torch.sqrt(pair[0].square().sum() + pair[1].square().sum()))

    if signals is None:
        signals = [signal_fn(k, v) for k, v in zip(steps, velocities)]
    signals = dict(zip(steps, signals))
    total = norm(aggregate([(w, signals[k]) for k, w in zip(steps, weights)]))
    moved = [(k, w, v) for k, w, v in zip(steps, weights, velocities) if k in rollout_velocities]
    largest = 0.0
    for sign in (-1.0, 1.0):
        probes = []
        for k, w, v in moved:
            dtype = torch.promote_types(v.dtype, torch.float32)
            probe = v.to(dtype) + sign * (v.to(dtype) - rollout_velocities[k].to(dtype))
            probes.append((w, signal_fn(k, probe.to(v.dtype)) - signals[k]))
        largest = max(largest, norm(aggregate(probes)))
    if largest == 0.0:
        return 0.0
    return largest / total if total > 0 else float("inf")
