"""JAGG: Jacobian-Aggregated Group Gradients (pure torch; knows nothing about diffusers).

The PPO loss of step ``k`` depends on the parameters only through the backbone velocity ``v_k``, so its
gradient is ``J_k^T s_k`` with ``J_k = dv_k/dtheta`` and ``s_k = dL_k/dv_k`` (cheap: no backbone involved).
For a group of ``W`` consecutive trained steps JAGG interpolates ``J_j`` linearly in time between the group's
endpoints and replaces ``W`` backward passes by one joint backward through the two endpoint forwards::

    sum_j J_j^T s_j  ~=  J_0^T s_base + J_{W-1}^T s_corr,
    s_base = sum_j (1 - alpha_j) s_j,  s_corr = sum_j alpha_j s_j,  alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}).

The engine receives the backbone call and the backward call, so one engine serves every model and every
distributed setup (``accelerator.backward`` handles grad scaling, DeepSpeed and accumulation).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

JAGG_MODES = ("exact", "jagg", "endpoints")

VelocityFn = Callable[[int], torch.Tensor]
"""Returns the backbone velocity of trained step ``k`` (index into the plan's times); runs under the ambient
grad mode, which the engine sets."""
LossFn = Callable[[int, torch.Tensor], torch.Tensor]
"""Returns the scalar loss ``L_k`` of step ``k`` as a function of its velocity."""
BackwardFn = Callable[[torch.Tensor], None]
SyncContextFn = Callable[[bool], contextlib.AbstractContextManager]
"""Given ``is_last_backward``, the context to run one forward+backward unit in (``accelerator.no_sync`` for all
but the last under DDP: two forwards and two backward calls would otherwise reduce only once, silently)."""


@dataclass(frozen=True)
class StepGroup:
    """Consecutive trained steps handled together.

    Attributes:
        steps: indices into the plan's ``times``, high noise first.
        method: ``"exact"`` (one backward per step), ``"jagg"`` (one joint backward) or ``"endpoints"`` (the
            paper's ablation: one joint backward where each endpoint keeps only its own loss).
        alphas: interpolation weights ``alpha_j`` of the steps (``0`` at the first, ``1`` at the last).
    """

    steps: tuple[int, ...]
    method: str
    alphas: tuple[float, ...]

    @property
    def is_joint(self) -> bool:
        """Whether the group takes one joint backward through its endpoints."""
        return self.method != "exact"


def _check_times(times: Sequence[float]) -> list[float]:
    times = [float(t) for t in times]
    if any(not math.isfinite(t) for t in times):
        raise ValueError(f"`times` must be finite, got {times}.")
    if any(b >= a for a, b in zip(times, times[1:])):
        raise ValueError(f"`times` must strictly decrease (high noise first), got {times}.")
    return times


def interpolation_weights(times: Sequence[float]) -> tuple[float, ...]:
    """``alpha_j = (t_0 - t_j) / (t_0 - t_{W-1})`` from the steps' actual times (``(0.0,)`` for one step)."""
    times = _check_times(times)
    if len(times) == 1:
        return (0.0,)
    span = times[0] - times[-1]
    return tuple((times[0] - t) / span for t in times)


def plan_groups(times: Sequence[float], group_size: int, jagg_frac: float, mode: str = "jagg") -> list[StepGroup]:
    """Split the trained steps into groups of ``group_size`` and route the first ``jagg_frac`` of them to JAGG.

    Groups are consecutive chunks of the trained steps, high noise first; the last one may be shorter (the
    remainder) and is always exact. ``jagg_frac * number_of_groups`` (rounded half up) of the full groups, the
    highest-noise ones, use JAGG (or the ``endpoints`` ablation); the rest use exact per-step backward.

    Args:
        times: flow times (or any monotone time) of the trained steps, strictly decreasing.
        group_size: ``W >= 1``.
        jagg_frac: fraction of groups routed to JAGG, in ``[0, 1]``.
        mode: ``"jagg"``, ``"endpoints"`` or ``"exact"`` (every group exact).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"`group_size` (jagg_group_size) must be an integer >= 1, got {group_size!r}.")
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"`jagg_frac` must be in [0, 1], got {jagg_frac!r}.")
    if mode not in JAGG_MODES:
        raise ValueError(f"`mode` (jagg_mode) must be one of {JAGG_MODES}, got {mode!r}.")
    times = _check_times(times)
    chunks = [list(range(i, min(i + group_size, len(times)))) for i in range(0, len(times), group_size)]
    num_full = sum(len(c) == group_size for c in chunks)
    num_jagg = 0 if mode == "exact" else min(num_full, math.floor(jagg_frac * len(chunks) + 0.5))
    return [
        StepGroup(
            steps=tuple(chunk),
            method=mode if g < num_jagg and len(chunk) > 1 else "exact",
            alphas=interpolation_weights([times[k] for k in chunk]),
        )
        for g, chunk in enumerate(chunks)
    ]


@dataclass
class EngineResult:
    """What one pass of the engine did.

    Attributes:
        step_losses: the true loss ``L_k`` of every trained step (never the JAGG surrogate).
        num_jagg_groups / num_exact_groups: how the groups were routed.
        num_backward: backward calls made (the cost JAGG saves).
    """

    step_losses: dict[int, float] = field(default_factory=dict)
    num_jagg_groups: int = 0
    num_exact_groups: int = 0
    num_backward: int = 0

    @property
    def loss(self) -> float:
        """Mean of the per-step losses."""
        return sum(self.step_losses.values()) / max(len(self.step_losses), 1)


def upstream_signal(loss_fn: LossFn, step: int, velocity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_k, s_k = dL_k/dv_k)`` through a detached leaf proxy of the velocity: no backbone backward."""
    proxy = velocity.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_fn(step, proxy)
        (signal,) = torch.autograd.grad(loss, proxy)
    return loss.detach(), signal


class JaggEngine:
    """Runs the update's forward/backward over the planned groups.

    Args:
        velocity_fn: backbone call for a trained step (see :data:`VelocityFn`).
        loss_fn: per-step loss as a function of the velocity (see :data:`LossFn`).
        backward_fn: how to backpropagate a scalar, e.g. ``accelerator.backward``.
        sync_context: see :data:`SyncContextFn`; defaults to no context.
        loss_weight: multiplies every step's loss in the backward (e.g. ``1 / (num_steps * grad_accum)``);
            reported losses are unweighted.
    """

    def __init__(
        self,
        velocity_fn: VelocityFn,
        loss_fn: LossFn,
        backward_fn: BackwardFn = torch.Tensor.backward,
        *,
        sync_context: SyncContextFn | None = None,
        loss_weight: float = 1.0,
    ):
        self.velocity_fn = velocity_fn
        self.loss_fn = loss_fn
        self.backward_fn = backward_fn
        self.sync_context = sync_context or (lambda is_last: contextlib.nullcontext())
        self.loss_weight = loss_weight

    def run(self, groups: Sequence[StepGroup]) -> EngineResult:
        """Forward and backward every group; gradients accumulate wherever ``backward_fn`` puts them."""
        # A unit is one forward(s)+backward: a whole joint group, or a single step of an exact group.
        units: list[tuple[StepGroup, int]] = []
        for group in groups:
            units.extend([(group, group.steps[0])] if group.is_joint else [(group, k) for k in group.steps])
        result = EngineResult()
        for i, (group, step) in enumerate(units):
            with self.sync_context(i == len(units) - 1):
                if group.is_joint:
                    self._joint_group(group, result)
                else:
                    self._exact_step(step, result)
        result.num_jagg_groups = sum(g.is_joint for g in groups)
        result.num_exact_groups = len(groups) - result.num_jagg_groups
        return result

    def _exact_step(self, step: int, result: EngineResult) -> None:
        loss = self.loss_fn(step, self.velocity_fn(step))
        self.backward_fn(loss * self.loss_weight)
        result.step_losses[step] = loss.item()
        result.num_backward += 1

    def _joint_group(self, group: StepGroup, result: EngineResult) -> None:
        first, last = group.steps[0], group.steps[-1]
        v_first = self.velocity_fn(first)
        with torch.no_grad():
            v_inner = [self.velocity_fn(k) for k in group.steps[1:-1]]
        v_last = self.velocity_fn(last) if last != first else v_first
        velocities = [v_first, *v_inner, v_last] if last != first else [v_first]
        for step, velocity in zip(group.steps, velocities):
            if velocity.shape != v_first.shape:
                raise ValueError(
                    f"`velocity_fn` returned shape {tuple(velocity.shape)} for step {step} but "
                    f"{tuple(v_first.shape)} for step {first}: a joint group needs one latent shape."
                )
        # Aggregate in at least float32 (bf16 models) but never below the model's precision (float64 models).
        dtype = torch.promote_types(v_first.dtype, torch.float32)
        s_base = torch.zeros_like(v_first, dtype=dtype)
        s_corr = torch.zeros_like(v_first, dtype=dtype)
        for j, (step, velocity) in enumerate(zip(group.steps, velocities)):
            loss, signal = upstream_signal(self.loss_fn, step, velocity)
            result.step_losses[step] = loss.item()
            alpha = group.alphas[j]
            if group.method == "endpoints":
                # Ablation: each endpoint keeps only its own loss, the intermediate signals are dropped.
                if step == first:
                    s_base += signal
                elif step == last:
                    s_corr += signal
            else:
                s_base += (1 - alpha) * signal
                s_corr += alpha * signal
        # One joint backward through both endpoint graphs; a scalar surrogate so any backward_fn works.
        surrogate = (v_first.to(dtype) * s_base).sum() + (v_last.to(dtype) * s_corr).sum()
        self.backward_fn(surrogate * self.loss_weight)
        result.num_backward += 1


def flat_grad(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Gradient of ``loss`` w.r.t. ``params`` as one flat vector (zeros for unused parameters)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])


@dataclass
class GroupDiagnostic:
    """JAGG vs exact gradient of one group."""

    group: int
    steps: tuple[int, ...]
    cosine: float
    norm_ratio: float


def gradient_diagnostic(
    groups: Sequence[StepGroup],
    velocity_fn: VelocityFn,
    loss_fn: LossFn,
    params: Sequence[torch.Tensor],
    mode: str = "jagg",
) -> list[GroupDiagnostic]:
    """Per-group cosine similarity and norm ratio ``|g_jagg| / |g_exact|`` between the JAGG gradient and the
    exact sum of per-step gradients. Every group is evaluated as if routed to ``mode`` (``"jagg"`` or
    ``"endpoints"``); ``.grad`` is untouched.
    """
    params = [p for p in params if p.requires_grad]
    diagnostics = []
    for index, group in enumerate(groups):
        exact = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=params[0].device)
        for step in group.steps:
            exact += flat_grad(loss_fn(step, velocity_fn(step)), params).double()
        jagg = torch.zeros_like(exact)

        def accumulate(loss: torch.Tensor, _buffer: torch.Tensor = jagg) -> None:
            _buffer += flat_grad(loss, params).double()

        JaggEngine(velocity_fn, loss_fn, accumulate).run([StepGroup(group.steps, mode, group.alphas)])
        denom = exact.norm() * jagg.norm()
        cosine = (exact @ jagg / denom).item() if denom > 0 else 1.0
        norm_ratio = (jagg.norm() / exact.norm()).item() if exact.norm() > 0 else float("nan")
        diagnostics.append(GroupDiagnostic(index, group.steps, cosine, norm_ratio))
    return diagnostics
