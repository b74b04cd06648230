"""JAGG: Jacobian-Aggregated Group Gradients (pure torch; knows nothing about diffusers).

The PPO loss of step ``k`` depends on the parameters only through the backbone velocity ``v_k``, so its
gradient is ``J_k^T s_k`` with ``J_k = dv_k/dtheta`` and ``s_k = dL_k/dv_k`` (cheap: no backbone involved).
For a group of ``W`` consecutive trained steps JAGG interpolates ``J_j`` linearly in time between the group's
endpoints and replaces ``W`` backward passes by one joint backward through the two endpoint forwards::

    sum_j J_j^T s_j  ~=  J_0^T s_base + J_{W-1}^T s_corr,
    s_base = sum_j (1 - alpha_j) s_j,  s_corr = sum_j alpha_j s_j,  alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}).

The engine receives the backbone call and the backward call, so one engine serves every model and every
distributed setup (``accelerator.backward`` handles grad scaling, DeepSpeed and accumulation).

Two things make a JAGG group cheaper still (see ``docs/jagg.md``):

- **Velocity cache.** While the parameters are those that produced the rollout, the intermediate velocities
  ``v_1 .. v_{W-2}`` are exactly the guided velocities the sampler computed; given them (``cached_velocities``) a
  group costs its two endpoint forwards and one backward (about 6 forward units instead of ``W + 4``). After an
  optimizer step they are the rollout policy's; ``correct_cached`` moves each one by the change of the group's
  endpoints since the rollout, interpolated with JAGG's own weights (:func:`corrected_velocity`); with
  ``cache_tolerance`` a group keeps them only where :func:`signal_sensitivity` stays within it (else they are
  recomputed: ``trl_jagg/core/velocity_cache.py``).
- **Batched no-grad forwards.** Velocities that must be recomputed without a graph (uncached intermediates) are
  requested all at once through ``no_grad_velocities_fn``, which can run them as a few large backbone calls.

``endpoint_backward="sequential"`` back-propagates the two endpoints one at a time, so only one endpoint graph is
alive (peak memory of an exact step) and no forward is added: ``alpha_{W-1} = 1``, so the last endpoint's signal
enters only ``s_corr``, which is needed in the second backward, after that endpoint's own graph forward.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from trl_jagg.core.velocity_cache import corrected_velocity, signal_sensitivity

JAGG_MODES = ("exact", "jagg", "endpoints")
ENDPOINT_BACKWARDS = ("joint", "sequential")
VelocityFn = Callable[[int], torch.Tensor]
"""Returns the backbone velocity of trained step ``k`` (index into the plan's times); runs under the ambient
grad mode, which the engine sets."""
LossFn = Callable[[int, torch.Tensor], torch.Tensor]
"""Returns the scalar loss ``L_k`` of step ``k`` as a function of its velocity."""
NoGradVelocitiesFn = Callable[[Sequence[int]], Sequence[torch.Tensor]]
"""Returns the velocities of several trained steps, in order, computed without a graph (the engine calls it under
``torch.no_grad``); free to batch them into fewer backbone calls."""
BackwardFn = Callable[[torch.Tensor], None]
SyncContextFn = Callable[[bool], contextlib.AbstractContextManager]
"""Given ``is_last_backward``, the context to run one forward(s)+backward unit in (``accelerator.no_sync`` for all
but the last under DDP: two forwards and two backward calls would otherwise reduce only once, silently). A unit
is one backward call: an exact step, a joint group, or one endpoint of a ``sequential`` group."""


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

    @property
    def signal_weights(self) -> list[tuple[float, float]]:
        """Each step's weights ``(w_base, w_corr)`` in ``s_base`` and ``s_corr``: ``(1 - alpha_j, alpha_j)``; in the
        ``endpoints`` ablation each endpoint keeps only its own signal and the intermediate ones are dropped."""
        if self.method != "endpoints":
            return [(1 - a, a) for a in self.alphas]
        inner = [(0.0, 0.0)] * (len(self.steps) - 2)
        return [(1.0, 0.0), *inner, (0.0, 1.0)] if len(self.steps) > 1 else [(1.0, 0.0)]


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


def plan_groups(
    times: Sequence[float], group_size: int, jagg_frac: float, mode: str = "jagg", breaks: Sequence[int] = ()
) -> list[StepGroup]:
    """Split the trained steps into groups of ``group_size`` and route the first ``jagg_frac`` of them to JAGG.

    Groups are consecutive chunks of the trained steps, high noise first; the last one may be shorter (the
    remainder) and is always exact. ``jagg_frac * number_of_groups`` (rounded half up) of the full groups, the
    highest-noise ones, use JAGG (or the ``endpoints`` ablation); the rest use exact per-step backward.

    Args:
        times: flow times (or any monotone time) of the trained steps, strictly decreasing.
        group_size: ``W >= 1``.
        jagg_frac: fraction of groups routed to JAGG, in ``[0, 1]``.
        mode: ``"jagg"``, ``"endpoints"`` or ``"exact"`` (every group exact).
        breaks: indices into ``times`` where a new group must start: the steps before and after a break are never
            grouped together. A group interpolates one network's Jacobian, so a backbone that switches networks
            between steps (Wan2.2's high- and low-noise experts) breaks at the first step of the second network. Each
            segment is chunked on its own (its last chunk may be short, and exact).
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"`group_size` (jagg_group_size) must be an integer >= 1, got {group_size!r}.")
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"`jagg_frac` must be in [0, 1], got {jagg_frac!r}.")
    if mode not in JAGG_MODES:
        raise ValueError(f"`mode` (jagg_mode) must be one of {JAGG_MODES}, got {mode!r}.")
    times = _check_times(times)
    bounds = sorted(set(breaks))
    if any(not isinstance(b, int) or not 0 < b < len(times) for b in bounds):
        raise ValueError(f"`breaks` must be step indices in [1, {len(times) - 1}], got {list(breaks)}.")
    segments = zip([0, *bounds], [*bounds, len(times)])
    chunks = [
        list(range(i, min(i + group_size, end))) for start, end in segments for i in range(start, end, group_size)
    ]
    full = [g for g, chunk in enumerate(chunks) if len(chunk) == group_size and group_size > 1]
    num_jagg = 0 if mode == "exact" else min(len(full), math.floor(jagg_frac * len(chunks) + 0.5))
    routed = set(full[:num_jagg])  # the highest-noise full groups (a break may leave a short group between them)
    return [
        StepGroup(
            steps=tuple(chunk),
            method=mode if g in routed else "exact",
            alphas=interpolation_weights([times[k] for k in chunk]),
        )
        for g, chunk in enumerate(chunks)
    ]


@dataclass
class EngineResult:
    """What one pass of the engine did.

    Attributes:
        step_losses: the true loss ``L_k`` of every trained step (never the JAGG surrogate); read from the device
            once, at the end of the pass.
        num_jagg_groups / num_exact_groups: how the groups were routed.
        num_backward: backward calls made (the cost JAGG saves).
        num_graph_forwards / num_no_grad_forwards: velocities computed with and without an autograd graph.
        num_cached: velocities taken from ``cached_velocities`` instead of a backbone call (corrected ones included).
        num_corrected: of those, the ones corrected by the endpoints' change (``correct_cached``).
        num_rejected: corrected intermediates recomputed instead because their group failed the check
            (``cache_tolerance``); counted in ``num_no_grad_forwards``, not in ``num_cached``.
        cache_sensitivity: the largest :func:`signal_sensitivity` of the checked groups (``0.0`` if none).
    """

    step_losses: dict[int, float] = field(default_factory=dict)
    num_jagg_groups: int = 0
    num_exact_groups: int = 0
    num_backward: int = 0
    num_graph_forwards: int = 0
    num_no_grad_forwards: int = 0
    num_cached: int = 0
    num_corrected: int = 0
    num_rejected: int = 0
    cache_sensitivity: float = 0.0

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


@dataclass(frozen=True)
class StepFunctions:
    """What the engine calls for one micro-batch, by trained-step index ``i`` (into the plan's times).

    Attributes:
        velocity_fn: the backbone call of step ``i`` with an autograd graph (see :data:`VelocityFn`).
        loss_fn: step ``i``'s loss as a function of its velocity (see :data:`LossFn`).
        no_grad_velocities_fn: see :data:`NoGradVelocitiesFn`; defaults to one ``velocity_fn`` call per step. The
            engine asks once per pass for every velocity it needs without a graph.
        probe_loss_fn: ``loss_fn`` without side effects (the diagnostics it records), for the velocity cache's
            probes; defaults to ``loss_fn``.
    """

    velocity_fn: VelocityFn
    loss_fn: LossFn
    no_grad_velocities_fn: NoGradVelocitiesFn | None = None
    probe_loss_fn: LossFn | None = None


class JaggEngine:
    """Runs the update's forward/backward over the planned groups: the run's settings here, once; the micro-batch's
    functions and cache in :meth:`run`.

    Args:
        backward_fn: how to backpropagate a scalar, e.g. ``accelerator.backward``.
        endpoint_backward: ``"joint"`` (one backward through both endpoint graphs) or ``"sequential"`` (one
            backward per endpoint, so only one graph is alive; two units for the sync context).
        cache_tolerance: with ``correct_cached`` (:meth:`run`), the largest :func:`signal_sensitivity` a group's
            corrected intermediates may have; a group above it has its intermediates recomputed without a graph.
            ``None`` keeps every correction unchecked.
        agree: turns a group's sensitivity into the one every process uses (the largest over processes), so that
            all of them make the same backbone calls: a sharded backbone (FSDP, ZeRO-3) gathers its weights in every
            call, so a recompute on one process only would leave the others waiting. Defaults to the identity.
    """

    def __init__(
        self,
        backward_fn: BackwardFn = torch.Tensor.backward,
        *,
        endpoint_backward: str = "joint",
        cache_tolerance: float | None = None,
        agree: Callable[[float], float] | None = None,
    ):
        if endpoint_backward not in ENDPOINT_BACKWARDS:
            raise ValueError(
                f"`endpoint_backward` (jagg_endpoint_backward) must be one of {ENDPOINT_BACKWARDS}, "
                f"got {endpoint_backward!r}."
            )
        self.backward_fn = backward_fn
        self.endpoint_backward = endpoint_backward
        self.cache_tolerance = cache_tolerance
        self.agree = agree or (lambda value: value)

    def run(
        self,
        groups: Sequence[StepGroup],
        functions: StepFunctions,
        *,
        loss_weight: float = 1.0,
        sync_context: SyncContextFn | None = None,
        cached_velocities: Mapping[int, torch.Tensor] | None = None,
        correct_cached: bool = False,
    ) -> EngineResult:
        """Forward and backward every group of one micro-batch; gradients accumulate wherever ``backward_fn`` puts
        them.

        Args:
            groups: the plan (:func:`plan_groups`).
            functions: the micro-batch's backbone calls and losses.
            loss_weight: multiplies every step's loss in the backward (e.g. ``1 / (num_steps * grad_accum)``);
                reported losses are unweighted.
            sync_context: see :data:`SyncContextFn`; defaults to no context.
            cached_velocities: the velocity of trained steps (index into the plan's times), as the rollout computed
                them, on the forward path ``velocity_fn`` takes (no active dropout, same dtype and batch shape);
                joint groups then take their intermediate velocities from them. Without ``correct_cached``, only
                pass them while they are exactly what ``velocity_fn`` would return (no optimizer step since the
                rollout), or knowingly stale.
            correct_cached: the parameters changed since the rollout: each cached intermediate of a joint group is
                corrected by its endpoints' change (:func:`corrected_velocity`), the endpoints' current velocities
                being their graph forwards, detached. An intermediate is taken from the cache only if both
                endpoints are cached too (else it is recomputed). A ``sequential`` group needs its last endpoint's
                current velocity before that endpoint's graph forward: it is requested with the no-grad velocities
                (one more no-grad forward per such group).
        """
        return _EnginePass(self, functions, loss_weight, sync_context, cached_velocities or {}, correct_cached).run(
            groups
        )


class _EnginePass:
    """One :meth:`JaggEngine.run`: the engine's settings, the micro-batch's functions, and the pass's own state (the
    intermediates to correct, the current no-grad velocity of sequential groups' last endpoints)."""

    def __init__(
        self,
        engine: JaggEngine,
        functions: StepFunctions,
        loss_weight: float,
        sync_context: SyncContextFn | None,
        cached_velocities: Mapping[int, torch.Tensor],
        correct_cached: bool,
    ):
        velocity_fn = functions.velocity_fn
        self.velocity_fn = velocity_fn
        self.loss_fn = functions.loss_fn
        self.no_grad_velocities_fn = functions.no_grad_velocities_fn or (lambda steps: [velocity_fn(k) for k in steps])
        self.probe_loss_fn = functions.probe_loss_fn or functions.loss_fn
        self.backward_fn = engine.backward_fn
        self.endpoint_backward = engine.endpoint_backward
        self.cache_tolerance = engine.cache_tolerance
        self.agree = engine.agree
        self.sync_context = sync_context or (lambda is_last: contextlib.nullcontext())
        self.loss_weight = loss_weight
        self.cached_velocities = cached_velocities
        self.correct_cached = correct_cached
        self._to_correct: set[int] = set()
        self._current: dict[int, torch.Tensor] = {}

    def run(self, groups: Sequence[StepGroup]) -> EngineResult:
        sequential = self.endpoint_backward == "sequential"
        # A unit is one backward call: an exact step, a joint group, or one endpoint of a sequential group.
        units: list[tuple[StepGroup, int]] = []
        for group in groups:
            if not group.is_joint:
                units.extend((group, k) for k in group.steps)
            elif sequential and len(group.steps) > 1:
                units.extend([(group, group.steps[0]), (group, group.steps[-1])])
            else:
                units.append((group, group.steps[0]))
        result = EngineResult()
        losses: dict[int, torch.Tensor] = {}
        known = self._no_grad_velocities(groups, result)
        pending: dict[StepGroup, torch.Tensor] = {}  # a sequential group's s_corr, between its two units
        for i, (group, step) in enumerate(units):
            with self.sync_context(i == len(units) - 1):
                if not group.is_joint:
                    loss = self.loss_fn(step, self._forward(step, result))
                    self._backward(loss, result)
                    losses[step] = loss.detach()
                elif not sequential or len(group.steps) == 1:
                    self._joint_group(group, known, losses, result)
                elif step == group.steps[0]:
                    pending[group] = self._first_endpoint(group, known, losses, result)
                else:
                    self._last_endpoint(group, pending.pop(group), losses, result)
        result.num_jagg_groups = sum(g.is_joint for g in groups)
        result.num_exact_groups = len(groups) - result.num_jagg_groups
        result.step_losses = _to_floats(losses)
        return result

    def _no_grad_velocities(self, groups: Sequence[StepGroup], result: EngineResult) -> dict[int, torch.Tensor]:
        """Every velocity the joint groups need without a graph, from the cache or from one batched request (with
        the current velocity of the sequential groups' last endpoints whose intermediates are corrected)."""
        cache = self.cached_velocities
        known: dict[int, torch.Tensor] = {}
        missing: list[int] = []
        current: list[int] = []
        self._to_correct, self._current = set(), {}
        for group in groups:
            if not group.is_joint or len(group.steps) < 3:
                continue
            first, last = group.steps[0], group.steps[-1]
            usable = not self.correct_cached or (first in cache and last in cache)
            for k in group.steps[1:-1]:
                if usable and k in cache:
                    known[k] = cache[k]
                    if self.correct_cached:
                        self._to_correct.add(k)
                else:
                    missing.append(k)
            if self.endpoint_backward == "sequential" and any(k in self._to_correct for k in group.steps[1:-1]):
                current.append(last)
        result.num_cached += len(known)
        if missing or current:
            with torch.no_grad():
                values = list(self.no_grad_velocities_fn(missing + current))
            if len(values) != len(missing) + len(current):
                raise ValueError(
                    f"`no_grad_velocities_fn` returned {len(values)} velocities for {len(missing) + len(current)} "
                    "steps."
                )
            known.update(zip(missing, values))
            self._current = dict(zip(current, values[len(missing) :]))
            result.num_no_grad_forwards += len(missing) + len(current)
        return known

    def _intermediates(
        self, group: StepGroup, known: dict[int, torch.Tensor], v_first: torch.Tensor, v_last: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """A joint group's intermediate velocities: recomputed or cached ones as they are, corrected ones moved by
        the endpoints' change since the rollout (``v_first``, ``v_last``: the endpoints' current velocities)."""
        inner = group.steps[1:-1]
        if not any(k in self._to_correct for k in inner):
            return [known[k] for k in inner]
        first, last = group.steps[0], group.steps[-1]
        dtype = torch.promote_types(v_first.dtype, torch.float32)  # a bf16 difference would lose the change
        first_change = v_first.detach().to(dtype) - self.cached_velocities[first].to(dtype)
        last_change = v_last.detach().to(dtype) - self.cached_velocities[last].to(dtype)
        return [
            corrected_velocity(known[k], group.alphas[j], first_change, last_change) if k in self._to_correct
            else known[k]
            for j, k in enumerate(inner, start=1)
        ]  # fmt: skip

    def _check_correction(
        self,
        group: StepGroup,
        velocities: list[torch.Tensor],
        signals: list[torch.Tensor],
        losses: dict[int, torch.Tensor],
        result: EngineResult,
    ) -> None:
        """The velocity cache's check of a group with corrected intermediates (``cache_tolerance``): its
        :func:`signal_sensitivity`, agreed over processes, against the tolerance. A group that fails has its
        corrected intermediates recomputed without a graph and their signals (and losses) taken again, in
        ``signals``. ``velocities`` / ``signals`` cover every step of the group."""
        corrected = [k for k in group.steps[1:-1] if k in self._to_correct]
        if self.cache_tolerance is not None:
            sensitivity = self.agree(
                signal_sensitivity(
                    lambda k, v: upstream_signal(self.probe_loss_fn, k, v)[1],
                    group.steps,
                    group.signal_weights,
                    [v.detach() for v in velocities],
                    {k: self.cached_velocities[k] for k in corrected},
                    signals=signals,
                )
            )
            result.cache_sensitivity = max(result.cache_sensitivity, sensitivity)
            if sensitivity > self.cache_tolerance:
                with torch.no_grad():
                    recomputed = dict(zip(corrected, self.no_grad_velocities_fn(corrected)))
                for j, k in enumerate(group.steps[1:-1], start=1):
                    if k in recomputed:
                        signals[j] = self._step_signal(k, recomputed[k], losses)
                result.num_cached -= len(corrected)
                result.num_no_grad_forwards += len(corrected)
                result.num_rejected += len(corrected)
                return
        result.num_corrected += len(corrected)

    def _forward(self, step: int, result: EngineResult) -> torch.Tensor:
        result.num_graph_forwards += 1
        return self.velocity_fn(step)

    def _backward(self, scalar: torch.Tensor, result: EngineResult) -> None:
        self.backward_fn(scalar * self.loss_weight)
        result.num_backward += 1

    def _signals(
        self,
        group: StepGroup,
        velocities: Sequence[torch.Tensor],
        losses: dict[int, torch.Tensor],
        result: EngineResult,
        v_last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s_base, s_corr)`` of a joint group from the velocities of its first ``len(velocities)`` steps (all of
        them, or all but the last endpoint for a sequential group's first unit, whose current velocity is then
        ``v_last``); records the step losses. Corrected intermediates go through :meth:`_check_correction`."""
        first = group.steps[0]
        for step, velocity in zip(group.steps, velocities):
            if velocity.shape != velocities[0].shape:
                raise ValueError(
                    f"`velocity_fn` returned shape {tuple(velocity.shape)} for step {step} but "
                    f"{tuple(velocities[0].shape)} for step {first}: a joint group needs one latent shape."
                )
        signals = [self._step_signal(step, v, losses) for step, v in zip(group.steps, velocities)]
        if any(k in self._to_correct for k in group.steps[1:-1]):
            # The check needs every step: a sequential first unit adds the last endpoint's, unrecorded.
            missing = len(velocities) < len(group.steps)
            every_velocity = [*velocities, v_last] if missing else list(velocities)
            every_signal = (
                [*signals, upstream_signal(self.probe_loss_fn, group.steps[-1], v_last)[1]] if missing else signals
            )
            self._check_correction(group, every_velocity, every_signal, losses, result)
            signals = every_signal[: len(velocities)]
        # Aggregate in at least float32 (bf16 models) but never below the model's precision (float64 models).
        dtype = torch.promote_types(velocities[0].dtype, torch.float32)
        s_base = torch.zeros_like(velocities[0], dtype=dtype)
        s_corr = torch.zeros_like(velocities[0], dtype=dtype)
        for (w_base, w_corr), signal in zip(group.signal_weights, signals):
            s_base += w_base * signal
            s_corr += w_corr * signal
        return s_base, s_corr

    def _step_signal(self, step: int, velocity: torch.Tensor, losses: dict[int, torch.Tensor]) -> torch.Tensor:
        """Step ``step``'s signal ``s_k`` at ``velocity``; records its loss."""
        losses[step], signal = upstream_signal(self.loss_fn, step, velocity)
        return signal

    def _joint_group(
        self, group: StepGroup, known: dict[int, torch.Tensor], losses: dict[int, torch.Tensor], result: EngineResult
    ) -> None:
        first, last = group.steps[0], group.steps[-1]
        v_first = self._forward(first, result)
        if last == first:
            s_base, _ = self._signals(group, [v_first], losses, result)
            self._backward((v_first.to(s_base.dtype) * s_base).sum(), result)
            return
        v_last = self._forward(last, result)
        s_base, s_corr = self._signals(
            group, [v_first, *self._intermediates(group, known, v_first, v_last), v_last], losses, result
        )
        # One joint backward through both endpoint graphs; a scalar surrogate so any backward_fn works.
        surrogate = (v_first.to(s_base.dtype) * s_base).sum() + (v_last.to(s_corr.dtype) * s_corr).sum()
        self._backward(surrogate, result)

    def _first_endpoint(
        self, group: StepGroup, known: dict[int, torch.Tensor], losses: dict[int, torch.Tensor], result: EngineResult
    ) -> torch.Tensor:
        """A sequential group's first unit: backward of ``<v_0, s_base>`` (``s_base`` needs every step but the last
        endpoint); returns the partial ``s_corr`` for the second unit."""
        v_first = self._forward(group.steps[0], result)
        v_last = self._current.get(group.steps[-1])  # requested only when an intermediate is corrected
        inner = self._intermediates(group, known, v_first, v_last)
        s_base, s_corr = self._signals(group, [v_first, *inner], losses, result, v_last)
        self._backward((v_first.to(s_base.dtype) * s_base).sum(), result)
        return s_corr

    def _last_endpoint(
        self, group: StepGroup, s_corr: torch.Tensor, losses: dict[int, torch.Tensor], result: EngineResult
    ) -> None:
        """A sequential group's second unit: the last endpoint's graph forward, its signal added to ``s_corr``, and
        the backward of ``<v_{W-1}, s_corr>``."""
        v_last = self._forward(group.steps[-1], result)
        w_base, w_corr = group.signal_weights[-1]
        if w_base != 0:  # alpha_{W-1} = 1 puts the last signal in s_corr only: s_base was back-propagated already
            raise AssertionError(f"step {group.steps[-1]} has an s_base weight {w_base} but s_base was already used")
        s_corr += w_corr * self._step_signal(group.steps[-1], v_last, losses)
        self._backward((v_last.to(s_corr.dtype) * s_corr).sum(), result)


def _to_floats(values: dict[int, torch.Tensor]) -> dict[int, float]:
    """Detached scalars to Python floats with one device-to-host copy (one sync instead of one per value)."""
    if not values:
        return {}
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in values.values()))
    return dict(zip(values, torch.stack([v.to(dtype) for v in values.values()]).tolist()))


def leading_jagg_fraction(cosines: Sequence[float], num_groups: int, threshold: float) -> float:
    """The paper's routing rule as a ``jagg_frac``: the leading (highest-noise) groups whose JAGG-vs-exact gradient
    cosine is at least ``threshold``, as a share of all ``num_groups`` groups of the plan (the exact remainder
    included), so that :func:`plan_groups` routes exactly those groups to JAGG.

    Args:
        cosines: per full group, high noise first (e.g. from :func:`gradient_diagnostic`); a NaN fails.
        num_groups: groups of the plan, remainder included.
        threshold: the cosine a group needs.
    """
    if num_groups < len(cosines):
        raise ValueError(f"`num_groups` ({num_groups}) is smaller than the number of cosines ({len(cosines)}).")
    leading = next((i for i, c in enumerate(cosines) if not c >= threshold), len(cosines))
    return leading / num_groups if num_groups else 0.0


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

        JaggEngine(accumulate).run([StepGroup(group.steps, mode, group.alphas)], StepFunctions(velocity_fn, loss_fn))
        denom = exact.norm() * jagg.norm()
        cosine = (exact @ jagg / denom).item() if denom > 0 else 1.0
        norm_ratio = (jagg.norm() / exact.norm()).item() if exact.norm() > 0 else float("nan")
        diagnostics.append(GroupDiagnostic(index, group.steps, cosine, norm_ratio))
    return diagnostics
