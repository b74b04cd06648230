"""The JAGG engine (`trl_jagg.core.jagg`): Theorem 1, the exact limits, the diagnostic, routing and bookkeeping.

Every gradient is compared with one computed here without the engine: the exact gradient is the autograd gradient
of ``sum_k L_k`` and the reference JAGG gradient is the spec's ``autograd.grad([v_0, v_{W-1}], [s_base, s_corr])``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from trl_jagg.core.grpo import group_advantages, kl_to_reference, ppo_step_loss
from trl_jagg.core.jagg import (
    EngineResult,
    JaggEngine,
    StepFunctions,
    StepGroup,
    gradient_diagnostic,
    interpolation_weights,
    leading_jagg_fraction,
    plan_groups,
    upstream_signal,
)
from trl_jagg.core.sampling import sampler_step


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread is faster and immune to spin-waiting on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


DTYPE = torch.float64
BATCH, TOKENS, DIM = 4, 3, 5
NOISE_LEVEL = 0.7


def shifted_sigmas(num_steps: int, shift: float = 3.0) -> list[float]:
    """SD3-style shifted schedule from 1 to 0: non-uniform, so alphas from times differ from alphas from indices."""
    s = torch.linspace(1, 0, num_steps + 1, dtype=DTYPE)
    return (shift * s / (1 + (shift - 1) * s)).tolist()


class LinearVelocity(nn.Module):
    """``v = A z + b t + c``: linear in ``(z, t)``, the hypothesis of Theorem 1."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.A = nn.Parameter(torch.randn(dim, dim, dtype=DTYPE) / math.sqrt(dim))
        self.b = nn.Parameter(torch.randn(dim, dtype=DTYPE))
        self.c = nn.Parameter(torch.randn(dim, dtype=DTYPE))

    def forward(self, z: torch.Tensor, t: float) -> torch.Tensor:
        return z @ self.A.T + t * self.b + self.c


class TinyVelocity(nn.Module):
    """A small nonlinear token MLP with time conditioning (a DiT stand-in)."""

    def __init__(self, dim: int = DIM, hidden: int = 24):
        super().__init__()
        self.inp = nn.Linear(dim, hidden, dtype=DTYPE)
        self.time = nn.Linear(2, hidden, dtype=DTYPE)
        self.mid = nn.Linear(hidden, hidden, dtype=DTYPE)
        self.out = nn.Linear(hidden, dim, dtype=DTYPE)

    def forward(self, z: torch.Tensor, t: float) -> torch.Tensor:
        temb = self.time(torch.tensor([math.sin(3 * t), math.cos(3 * t)], dtype=DTYPE))
        h = torch.tanh(self.inp(z) + temb)
        h = h + torch.tanh(self.mid(h)) * torch.sigmoid(temb)
        return self.out(h)


@dataclass
class Rollout:
    """Fixed rollout data of the trained steps and the per-step loss built from the real sampler and PPO loss."""

    model: nn.Module
    sigmas: list[float]
    latents: list[torch.Tensor]
    next_latents: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    ref_means: list[torch.Tensor]
    advantages: torch.Tensor
    clip_range: float
    beta: float

    @property
    def times(self) -> list[float]:
        return self.sigmas[: len(self.latents)]

    def velocity_fn(self, k: int) -> torch.Tensor:
        return self.model(self.latents[k], self.sigmas[k])

    def step_output(self, k: int, velocity: torch.Tensor):
        return sampler_step(
            velocity, self.latents[k], self.sigmas[k], self.sigmas[k + 1], noise_level=NOISE_LEVEL,
            sigma_max=self.sigmas[1], prev_sample=self.next_latents[k],
        )  # fmt: skip

    def loss_fn(self, k: int, velocity: torch.Tensor) -> torch.Tensor:
        out = self.step_output(k, velocity)
        kl = kl_to_reference(out.mean, self.ref_means[k], out.std) if self.beta else None
        return ppo_step_loss(
            out.log_prob, self.old_log_probs[k], self.advantages, self.clip_range, kl=kl, beta=self.beta
        ).loss


def make_rollout(
    model: nn.Module,
    num_steps: int,
    *,
    linear_trajectory: bool,
    beta: float = 0.04,
    clip_range: float = 0.05,
    log_ratio_scale: float = 0.02,
    seed: int = 0,
) -> Rollout:
    """A rollout whose ratios are not 1 but inside the clip range, so every step loss is nonlinear in ``v``.

    ``linear_trajectory`` puts the latents on a line in time (Theorem 1's hypothesis); otherwise they come from
    sampling the SDE with the model.
    """
    gen = torch.Generator().manual_seed(seed)
    sigmas = shifted_sigmas(num_steps)
    shape = (BATCH, TOKENS, DIM)
    z0 = torch.randn(shape, generator=gen, dtype=DTYPE)
    direction = torch.randn(shape, generator=gen, dtype=DTYPE)
    latents, next_latents, old, ref_means = [], [], [], []
    reference = [p.detach() + 0.05 * torch.randn(p.shape, generator=gen, dtype=DTYPE) for p in model.parameters()]
    z = z0
    for k in range(num_steps):
        if linear_trajectory:
            z = z0 + (sigmas[k] - sigmas[0]) * direction
        with torch.no_grad():
            v = model(z, sigmas[k])
            out = sampler_step(
                v, z, sigmas[k], sigmas[k + 1], noise_level=NOISE_LEVEL, sigma_max=sigmas[1], generator=gen
            )
            v_ref = torch.func.functional_call(
                model, dict(zip([n for n, _ in model.named_parameters()], reference)), (z, sigmas[k])
            )
            ref_mean = sampler_step(
                v_ref, z, sigmas[k], sigmas[k + 1], noise_level=NOISE_LEVEL, sigma_max=sigmas[1]
            ).mean
        # |log ratio| in [scale / 2, scale], random sign: never 0, never clipped for a clip range above e^scale - 1.
        signs = torch.randint(0, 2, (BATCH,), generator=gen) * 2 - 1
        offsets = log_ratio_scale * signs * (1 + torch.rand(BATCH, generator=gen)) / 2
        latents.append(z)
        next_latents.append(out.prev_sample.to(DTYPE))
        old.append(out.log_prob + offsets)
        ref_means.append(ref_mean)
        z = out.prev_sample.to(DTYPE)
    advantages = group_advantages(torch.randn(BATCH, generator=gen), BATCH)
    return Rollout(model, sigmas, latents, next_latents, old, ref_means, advantages, clip_range, beta)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return list(model.parameters())


def flat(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])


def exact_gradient(rollout: Rollout, steps: Sequence[int]) -> torch.Tensor:
    """The exact gradient: autograd of the sum of the true per-step losses."""
    params = params_of(rollout.model)
    total = sum(rollout.loss_fn(k, rollout.velocity_fn(k)) for k in steps)
    return flat(torch.autograd.grad(total, params, allow_unused=True), params)


def reference_jagg_gradient(rollout: Rollout, steps: Sequence[int], *, endpoints: bool = False) -> torch.Tensor:
    """The spec's JAGG gradient of one group, written independently of the engine."""
    params = params_of(rollout.model)
    times = [rollout.sigmas[k] for k in steps]
    alphas = [(times[0] - t) / (times[0] - times[-1]) for t in times] if len(times) > 1 else [0.0]
    signals = []
    for k in steps:
        proxy = rollout.velocity_fn(k).detach().requires_grad_(True)
        (signal,) = torch.autograd.grad(rollout.loss_fn(k, proxy), proxy)
        signals.append(signal)
    if endpoints:
        s_base, s_corr = signals[0], signals[-1]
    else:
        s_base = sum((1 - a) * s for a, s in zip(alphas, signals))
        s_corr = sum(a * s for a, s in zip(alphas, signals))
    v_first, v_last = rollout.velocity_fn(steps[0]), rollout.velocity_fn(steps[-1])
    grads = torch.autograd.grad([v_first, v_last], params, grad_outputs=[s_base, s_corr], allow_unused=True)
    return flat(grads, params)


ENGINE_SETTINGS = ("backward_fn", "endpoint_backward", "cache_tolerance", "agree")
FUNCTIONS = ("no_grad_velocities_fn", "probe_loss_fn")


def run_engine(rollout: Rollout, groups: Sequence[StepGroup], **kwargs) -> EngineResult:
    """One engine pass over ``rollout``, each keyword routed to where the engine takes it: the run's settings,
    the micro-batch's functions, or the pass itself."""
    settings = {k: kwargs.pop(k) for k in ENGINE_SETTINGS if k in kwargs}
    functions = StepFunctions(
        rollout.velocity_fn, rollout.loss_fn, **{k: kwargs.pop(k) for k in FUNCTIONS if k in kwargs}
    )
    return JaggEngine(**settings).run(groups, functions, **kwargs)


def engine_gradient(
    rollout: Rollout, groups: Sequence[StepGroup], **engine_kwargs
) -> tuple[torch.Tensor, EngineResult]:
    model = rollout.model
    model.zero_grad(set_to_none=True)
    result = run_engine(rollout, groups, **engine_kwargs)
    grad = flat([p.grad for p in model.parameters()], params_of(model))
    model.zero_grad(set_to_none=True)
    return grad, result


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a @ b / (a.norm() * b.norm())).item()


# --- Theorem 1 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("group_size", [3, 4, 8])
def test_theorem1_linear_velocity_and_trajectory_make_jagg_exact(group_size, beta):
    torch.manual_seed(group_size)
    num_steps = 2 * group_size + 1  # two JAGG groups and an exact remainder step
    rollout = make_rollout(LinearVelocity(), num_steps, linear_trajectory=True, beta=beta)
    # The per-step losses are genuinely nonlinear in v: the ratios are not 1, yet none is clipped.
    for k in range(num_steps):
        log_ratio = rollout.step_output(k, rollout.velocity_fn(k).detach()).log_prob - rollout.old_log_probs[k]
        assert log_ratio.abs().min() > 1e-4 and log_ratio.exp().sub(1).abs().max() < rollout.clip_range
    groups = plan_groups(rollout.times, group_size, 1.0)
    assert [g.method for g in groups] == ["jagg", "jagg", "exact"]
    jagg, result = engine_gradient(rollout, groups)
    exact = exact_gradient(rollout, range(num_steps))
    assert result.num_backward == 3
    assert exact.norm() > 1e-2
    torch.testing.assert_close(jagg, exact, rtol=0, atol=1e-10)
    # The endpoints ablation drops the intermediate signals and is not exact, even here.
    ablation, _ = engine_gradient(rollout, plan_groups(rollout.times, group_size, 1.0, mode="endpoints"))
    assert relative_difference(ablation, exact) > 1e-3


def test_theorem1_needs_the_linear_trajectory():
    """The same linear velocity on a curved (sampled) trajectory: JAGG is an approximation again."""
    rollout = make_rollout(LinearVelocity(), 4, linear_trajectory=False)
    jagg, _ = engine_gradient(rollout, plan_groups(rollout.times, 4, 1.0))
    assert relative_difference(jagg, exact_gradient(rollout, range(4))) > 1e-4


# --- exact limits and the approximation on a nonlinear network ----------------------------------------------------


@pytest.mark.parametrize(
    ("group_size", "jagg_frac", "mode"),
    [(1, 1.0, "jagg"), (2, 1.0, "jagg"), (2, 1.0, "endpoints"), (4, 0.0, "jagg"), (8, 0.0, "jagg"), (4, 1.0, "exact")],
)
def test_exact_limits_on_a_nonlinear_network(group_size, jagg_frac, mode):
    torch.manual_seed(1)
    rollout = make_rollout(TinyVelocity(), 8, linear_trajectory=False)
    grad, result = engine_gradient(rollout, plan_groups(rollout.times, group_size, jagg_frac, mode=mode))
    torch.testing.assert_close(grad, exact_gradient(rollout, range(8)), rtol=1e-12, atol=1e-12)
    expected_joint = 8 // group_size if (group_size == 2 and mode != "exact") else 0
    assert result.num_jagg_groups == expected_joint


@pytest.mark.parametrize("group_size", [3, 4, 5])
def test_engine_is_the_spec_formula_and_differs_from_exact_on_a_nonlinear_network(group_size):
    torch.manual_seed(2)
    rollout = make_rollout(TinyVelocity(), group_size, linear_trajectory=False)
    steps = list(range(group_size))
    jagg, _ = engine_gradient(rollout, plan_groups(rollout.times, group_size, 1.0))
    endpoints, _ = engine_gradient(rollout, plan_groups(rollout.times, group_size, 1.0, mode="endpoints"))
    exact = exact_gradient(rollout, steps)
    torch.testing.assert_close(jagg, reference_jagg_gradient(rollout, steps), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        endpoints, reference_jagg_gradient(rollout, steps, endpoints=True), rtol=1e-12, atol=1e-12
    )
    assert relative_difference(jagg, exact) > 1e-4  # the approximation is real
    assert relative_difference(endpoints, jagg) > 1e-3  # the ablation is a different estimator
    # Alphas come from the actual (non-uniform) times: index-based alphas would give another gradient.
    uniform = StepGroup(tuple(steps), "jagg", tuple(j / (group_size - 1) for j in steps))
    by_index, _ = engine_gradient(rollout, [uniform])
    assert relative_difference(by_index, jagg) > 1e-6


# --- gradient diagnostic -----------------------------------------------------------------------------------------


def test_gradient_diagnostic_cosine_and_norm_ratio_match_an_independent_computation():
    torch.manual_seed(3)
    rollout = make_rollout(TinyVelocity(), 9, linear_trajectory=False)
    groups = plan_groups(rollout.times, 4, 1.0)
    report = gradient_diagnostic(groups, rollout.velocity_fn, rollout.loss_fn, params_of(rollout.model))
    assert [d.group for d in report] == [0, 1, 2] and [d.steps for d in report] == [g.steps for g in groups]
    for diag, group in zip(report, groups):
        exact = exact_gradient(rollout, group.steps)
        jagg = reference_jagg_gradient(rollout, group.steps)
        assert 0 < diag.cosine <= 1
        assert diag.cosine == pytest.approx(cosine(jagg, exact), abs=1e-9)
        assert diag.norm_ratio == pytest.approx((jagg.norm() / exact.norm()).item(), rel=1e-9)
    assert report[0].cosine < 1 - 1e-6 and report[1].cosine < 1 - 1e-6
    assert report[2].cosine == pytest.approx(1, abs=1e-12)  # the one-step remainder is exact
    assert all(p.grad is None for p in rollout.model.parameters())  # .grad untouched
    endpoints = gradient_diagnostic(
        groups, rollout.velocity_fn, rollout.loss_fn, params_of(rollout.model), "endpoints"
    )
    exact0 = exact_gradient(rollout, groups[0].steps)
    assert endpoints[0].cosine == pytest.approx(
        cosine(reference_jagg_gradient(rollout, (0, 1, 2, 3), endpoints=True), exact0)
    )


@pytest.mark.parametrize("group_size", [1, 2])
def test_gradient_diagnostic_is_one_in_the_exact_limits(group_size):
    torch.manual_seed(4)
    rollout = make_rollout(TinyVelocity(), 6, linear_trajectory=False)
    groups = plan_groups(rollout.times, group_size, 1.0)
    report = gradient_diagnostic(groups, rollout.velocity_fn, rollout.loss_fn, params_of(rollout.model))
    assert len(report) == 6 // group_size
    for diag in report:
        assert diag.cosine == pytest.approx(1.0, abs=1e-6)
        assert diag.norm_ratio == pytest.approx(1.0, abs=1e-6)


def test_gradient_diagnostic_is_one_under_theorem1():
    rollout = make_rollout(LinearVelocity(), 8, linear_trajectory=True)
    groups = plan_groups(rollout.times, 8, 1.0)
    (diag,) = gradient_diagnostic(groups, rollout.velocity_fn, rollout.loss_fn, params_of(rollout.model))
    assert diag.cosine == pytest.approx(1.0, abs=1e-12) and diag.norm_ratio == pytest.approx(1.0, abs=1e-10)


# --- engine bookkeeping ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["jagg", "endpoints", "exact"])
def test_reported_losses_are_the_true_step_losses_not_the_surrogate(mode):
    torch.manual_seed(5)
    rollout = make_rollout(TinyVelocity(), 10, linear_trajectory=False)
    surrogates: list[float] = []

    def backward(loss: torch.Tensor) -> None:
        surrogates.append(loss.item())
        loss.backward()

    _, result = engine_gradient(rollout, plan_groups(rollout.times, 4, 1.0, mode=mode), backward_fn=backward)
    with torch.no_grad():
        true_losses = {k: rollout.loss_fn(k, rollout.velocity_fn(k)).item() for k in range(10)}
    assert result.step_losses.keys() == true_losses.keys()
    for k, value in true_losses.items():
        assert result.step_losses[k] == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert result.loss == pytest.approx(sum(true_losses.values()) / 10, rel=1e-12)
    if mode != "exact":
        # The first backward is group 0's surrogate <v_0, s_base> + <v_3, s_corr>, not a loss.
        group_loss = sum(true_losses[k] for k in range(4))
        assert abs(surrogates[0] - group_loss) > 1e-6


@pytest.mark.parametrize(
    ("num_steps", "group_size", "jagg_frac", "mode", "backward_calls", "joint_groups"),
    [
        (8, 4, 0.0, "jagg", 8, 0),  # W exact steps = W backward calls
        (8, 4, 1.0, "jagg", 2, 2),  # a JAGG group = 1 backward call
        (8, 4, 1.0, "exact", 8, 0),
        (10, 4, 1.0, "jagg", 4, 2),  # 2 JAGG groups + a 2-step exact remainder
        (10, 4, 0.6, "endpoints", 4, 2),  # round(0.6 * 3) = 2 joint groups
        (12, 4, 0.6, "jagg", 6, 2),  # round(0.6 * 3) = 2 joint groups + 4 exact steps
        (12, 3, 0.5, "jagg", 8, 2),  # round(0.5 * 4) = 2 joint groups + 6 exact steps
        (6, 1, 1.0, "jagg", 6, 0),
    ],
)
def test_backward_calls_are_counted(num_steps, group_size, jagg_frac, mode, backward_calls, joint_groups):
    rollout = make_rollout(TinyVelocity(), num_steps, linear_trajectory=False)
    calls: list[torch.Tensor] = []

    def backward(loss: torch.Tensor) -> None:
        calls.append(loss)
        loss.backward()

    groups = plan_groups(rollout.times, group_size, jagg_frac, mode=mode)
    _, result = engine_gradient(rollout, groups, backward_fn=backward)
    assert len(calls) == result.num_backward == backward_calls
    assert result.num_jagg_groups == joint_groups
    assert result.num_exact_groups == len(groups) - joint_groups
    assert all(c.ndim == 0 for c in calls)  # a scalar, so accelerator.backward works


def test_loss_weight_scales_the_gradient_and_gradients_accumulate():
    torch.manual_seed(6)
    rollout = make_rollout(TinyVelocity(), 10, linear_trajectory=False)
    groups = plan_groups(rollout.times, 4, 1.0)
    plain, plain_result = engine_gradient(rollout, groups)
    weighted, weighted_result = engine_gradient(rollout, groups, loss_weight=0.25)
    torch.testing.assert_close(weighted, 0.25 * plain, rtol=1e-12, atol=1e-15)
    assert weighted_result.step_losses == plain_result.step_losses  # reported losses are unweighted
    # Two passes without zeroing add up (gradient accumulation).
    engine, functions = JaggEngine(), StepFunctions(rollout.velocity_fn, rollout.loss_fn)
    rollout.model.zero_grad(set_to_none=True)
    engine.run(groups, functions)
    engine.run(groups, functions)
    twice = flat([p.grad for p in rollout.model.parameters()], params_of(rollout.model))
    torch.testing.assert_close(twice, 2 * plain, rtol=1e-12, atol=1e-15)


class SyncRecorder:
    """A ``sync_context`` and a ``backward_fn`` that record which units were entered as the last one and under which
    flag every backward ran (each must run inside exactly one context)."""

    def __init__(self):
        self.entered: list[bool] = []
        self.backward_flags: list[bool] = []
        self._active: list[bool] = []

    @contextlib.contextmanager
    def sync_context(self, is_last: bool):
        self.entered.append(is_last)
        self._active.append(is_last)
        try:
            yield
        finally:
            self._active.pop()

    def backward(self, loss: torch.Tensor) -> None:
        assert len(self._active) == 1, "every backward runs inside exactly one sync context"
        self.backward_flags.append(self._active[-1])
        loss.backward()


def test_sync_context_marks_only_the_last_unit():
    rollout = make_rollout(TinyVelocity(), 10, linear_trajectory=False)
    recorder = SyncRecorder()
    groups = plan_groups(rollout.times, 4, 1.0)  # jagg, jagg, exact(2): four units
    _, result = engine_gradient(rollout, groups, backward_fn=recorder.backward, sync_context=recorder.sync_context)
    assert recorder.entered == [False, False, False, True]
    assert recorder.backward_flags == [False, False, False, True]
    assert result.num_backward == 4


# --- routing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_steps", "group_size", "jagg_frac", "expected"),
    [
        (10, 4, 1.0, ["jagg", "jagg", "exact"]),  # the remainder is always exact
        (10, 4, 0.6, ["jagg", "jagg", "exact"]),  # round(1.8) = 2
        (10, 4, 0.3, ["jagg", "exact", "exact"]),  # round(0.9) = 1
        (10, 4, 0.1, ["exact", "exact", "exact"]),  # round(0.3) = 0
        (12, 4, 0.6, ["jagg", "jagg", "exact"]),  # high noise first
        (12, 4, 0.2, ["jagg", "exact", "exact"]),  # round(0.6) = 1
        (15, 3, 0.6, ["jagg", "jagg", "jagg", "exact", "exact"]),
        (8, 2, 0.0, ["exact"] * 4),
        (3, 1, 1.0, ["exact"] * 3),  # one-step groups are exact
        (3, 8, 1.0, ["exact"]),  # a short group of all steps is a remainder
    ],
)
def test_plan_groups_routing(num_steps, group_size, jagg_frac, expected):
    times = shifted_sigmas(num_steps)[:num_steps]
    groups = plan_groups(times, group_size, jagg_frac)
    assert [g.method for g in groups] == expected
    assert [list(g.steps) for g in groups] == [
        list(range(i, min(i + group_size, num_steps))) for i in range(0, num_steps, group_size)
    ]
    for g in groups:
        assert g.is_joint == (g.method != "exact")
        ts = [times[k] for k in g.steps]
        expected_alphas = [(ts[0] - t) / (ts[0] - ts[-1]) for t in ts] if len(ts) > 1 else [0.0]
        assert g.alphas == pytest.approx(expected_alphas, abs=1e-15)
    endpoints = plan_groups(times, group_size, jagg_frac, mode="endpoints")
    assert [g.method for g in endpoints] == [m.replace("jagg", "endpoints") for m in expected]
    assert all(g.method == "exact" for g in plan_groups(times, group_size, jagg_frac, mode="exact"))


def test_plan_groups_never_straddle_a_break():
    """Wan2.2's expert switch as a break: 19 trained steps, the low-noise expert from step 9 (the boundary), W = 4.
    Each side is chunked on its own (written out here), no group holds steps of both experts, and the alphas of a
    group are those of its own steps."""
    times = shifted_sigmas(20)[:19]
    groups = plan_groups(times, 4, 1.0, breaks=[9])
    assert [list(g.steps) for g in groups] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18],
    ]  # fmt: skip
    assert [g.method for g in groups] == ["jagg", "jagg", "exact", "jagg", "jagg", "exact"]
    assert all(max(g.steps) < 9 or min(g.steps) >= 9 for g in groups)
    ts = [times[k] for k in (9, 10, 11, 12)]
    assert groups[3].alphas == pytest.approx([(ts[0] - t) / (ts[0] - ts[-1]) for t in ts], abs=1e-15)
    # jagg_frac counts every group: round(0.5 * 6) = 3 of the 4 full ones, highest noise first.
    assert [g.method for g in plan_groups(times, 4, 0.5, breaks=[9])][:4] == ["jagg", "jagg", "exact", "jagg"]
    for bad in ([0], [19], [2.5]):
        with pytest.raises(ValueError, match=r"`breaks` must be step indices in \[1, 18\]"):
            plan_groups(times, 4, 1.0, breaks=bad)


def test_interpolation_weights_by_hand():
    assert interpolation_weights([1.0, 0.9, 0.6, 0.5]) == pytest.approx((0.0, 0.2, 0.8, 1.0))
    assert interpolation_weights([0.7]) == (0.0,)
    assert interpolation_weights([0.7, 0.2]) == (0.0, 1.0)


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [0, -1, 2.0, "4", None])
def test_bad_group_size_raises(group_size):
    with pytest.raises(ValueError, match="group_size"):
        plan_groups([0.9, 0.5], group_size, 1.0)


@pytest.mark.parametrize("jagg_frac", [-0.1, 1.01, float("nan")])
def test_bad_jagg_frac_raises(jagg_frac):
    with pytest.raises(ValueError, match="jagg_frac"):
        plan_groups([0.9, 0.5], 2, jagg_frac)


def test_bad_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        plan_groups([0.9, 0.5], 2, 1.0, mode="fast")


@pytest.mark.parametrize("times", [[0.9, 0.9, 0.5], [0.3, 0.6], [1.0, 0.5, 0.7], [1.0, float("nan")]])
def test_times_that_do_not_strictly_decrease_raise(times):
    with pytest.raises(ValueError, match="`times`"):
        plan_groups(times, 2, 1.0)
    with pytest.raises(ValueError, match="`times`"):
        interpolation_weights(times)


def test_mismatched_velocity_shapes_in_a_joint_group_raise():
    shapes = {0: (2, 3), 1: (2, 4), 2: (2, 3)}
    weight = torch.ones((), dtype=DTYPE, requires_grad=True)

    def velocity_fn(k: int) -> torch.Tensor:
        return weight * torch.ones(shapes[k], dtype=DTYPE)

    def loss_fn(_k: int, v: torch.Tensor) -> torch.Tensor:
        return (v**2).sum()

    with pytest.raises(ValueError, match="`velocity_fn`"):
        JaggEngine().run(plan_groups([0.9, 0.6, 0.3], 3, 1.0), StepFunctions(velocity_fn, loss_fn))


def test_upstream_signal_is_the_loss_gradient_at_the_velocity():
    v = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)

    def loss_fn(_k: int, u: torch.Tensor) -> torch.Tensor:
        return (u**3).sum()

    loss, signal = upstream_signal(loss_fn, 0, v * 2)
    torch.testing.assert_close(signal, 3 * (2 * v.detach()) ** 2)
    assert loss.item() == pytest.approx(((2 * v.detach()) ** 3).sum().item())
    assert v.grad is None and not loss.requires_grad


# --- on-policy velocity cache, batched no-grad forwards, sequential endpoint backward ---------------------------


class CallCounter:
    """Counts the backbone's forwards (with and without an autograd graph) by a forward hook, and backward calls."""

    def __init__(self, model: nn.Module):
        self.graph = self.no_grad = self.backward = 0
        model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self.graph += 1
        else:
            self.no_grad += 1

    def backward_fn(self, loss: torch.Tensor) -> None:
        self.backward += 1
        loss.backward()

    @property
    def counts(self) -> tuple[int, int, int]:
        return self.graph, self.no_grad, self.backward


def recorded_velocities(rollout: Rollout, num_steps: int) -> dict[int, torch.Tensor]:
    """What a rollout records: the velocity of every step, computed without a graph."""
    with torch.no_grad():
        return {k: rollout.velocity_fn(k) for k in range(num_steps)}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("group_size", [3, 4])
def test_cached_velocities_give_the_uncached_gradient_with_two_forwards_and_one_backward_per_group(group_size, beta):
    torch.manual_seed(7)
    num_steps = 2 * group_size
    rollout = make_rollout(TinyVelocity(), num_steps, linear_trajectory=False, beta=beta)
    cache = recorded_velocities(rollout, num_steps)
    groups = plan_groups(rollout.times, group_size, 1.0)
    assert [g.method for g in groups] == ["jagg", "jagg"]
    counter = CallCounter(rollout.model)
    uncached, _ = engine_gradient(rollout, groups, backward_fn=counter.backward_fn)
    assert counter.counts == (4, 2 * (group_size - 2), 2)
    counter.graph = counter.no_grad = counter.backward = 0
    cached, result = engine_gradient(rollout, groups, backward_fn=counter.backward_fn, cached_velocities=cache)
    # Per group: the two endpoint forwards with graph, none without, one backward.
    assert counter.counts == (4, 0, 2)
    assert (result.num_graph_forwards, result.num_no_grad_forwards, result.num_cached) == (4, 0, 2 * (group_size - 2))
    torch.testing.assert_close(cached, uncached, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(cached, reference_jagg_gradient(rollout, range(group_size)) + reference_jagg_gradient(
        rollout, range(group_size, num_steps)), rtol=1e-10, atol=1e-12)  # fmt: skip


def test_the_cache_is_what_the_engine_uses():
    """A cache that differs from the backbone changes the gradient: the engine really reads it."""
    torch.manual_seed(8)
    rollout = make_rollout(TinyVelocity(), 4, linear_trajectory=False)
    groups = plan_groups(rollout.times, 4, 1.0)
    cache = {k: 1.5 * v for k, v in recorded_velocities(rollout, 4).items()}
    stale, _ = engine_gradient(rollout, groups, cached_velocities=cache)
    fresh, _ = engine_gradient(rollout, groups)
    assert relative_difference(stale, fresh) > 1e-3


def test_no_grad_velocities_are_requested_once_for_the_whole_pass():
    torch.manual_seed(9)
    rollout = make_rollout(TinyVelocity(), 14, linear_trajectory=False)
    requests: list[list[int]] = []

    def batched(steps):
        requests.append(list(steps))
        assert not torch.is_grad_enabled()
        return [rollout.velocity_fn(k) for k in steps]

    groups = plan_groups(rollout.times, 4, 1.0)  # jagg, jagg, jagg, exact(2)
    grad, result = engine_gradient(rollout, groups, no_grad_velocities_fn=batched)
    assert requests == [[1, 2, 5, 6, 9, 10]]
    assert result.num_no_grad_forwards == 6
    torch.testing.assert_close(grad, engine_gradient(rollout, groups)[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cached", [False, True], ids=["uncached", "cached"])
@pytest.mark.parametrize("mode", ["jagg", "endpoints"])
def test_sequential_endpoint_backward_equals_joint(mode, cached):
    torch.manual_seed(10)
    rollout = make_rollout(TinyVelocity(), 10, linear_trajectory=False, beta=0.04)
    groups = plan_groups(rollout.times, 4, 1.0, mode=mode)  # two joint groups + an exact 2-step remainder
    cache = recorded_velocities(rollout, 10) if cached else None
    joint, _ = engine_gradient(rollout, groups, cached_velocities=cache)
    counter = CallCounter(rollout.model)
    sequential, result = engine_gradient(
        rollout, groups, backward_fn=counter.backward_fn, cached_velocities=cache, endpoint_backward="sequential"
    )
    torch.testing.assert_close(sequential, joint, rtol=1e-12, atol=1e-14)
    # Two endpoint forwards and two backward calls per joint group, and no forward added to joint's: the last
    # endpoint's signal (weight 1 - alpha = 0 in s_base) is taken from its own graph forward in the second unit.
    assert counter.counts == (2 * 2 + 2, 0 if cached else 2 * 2, 2 * 2 + 2)
    assert result.num_backward == 6
    with torch.no_grad():
        true_losses = {k: rollout.loss_fn(k, rollout.velocity_fn(k)).item() for k in range(10)}
    assert result.step_losses == pytest.approx(true_losses, rel=1e-12)


def test_sequential_endpoints_are_two_sync_units_and_only_the_last_backward_syncs():
    rollout = make_rollout(TinyVelocity(), 8, linear_trajectory=False)
    recorder = SyncRecorder()
    groups = plan_groups(rollout.times, 4, 1.0)  # two joint groups: four backward calls
    _, result = engine_gradient(
        rollout,
        groups,
        backward_fn=recorder.backward,
        sync_context=recorder.sync_context,
        endpoint_backward="sequential",
    )
    assert recorder.entered == [False, False, False, True]
    # the last group's first endpoint still runs under no_sync
    assert recorder.backward_flags == [False, False, False, True]
    assert result.num_backward == 4


def test_bad_endpoint_backward_raises():
    with pytest.raises(ValueError, match="endpoint_backward"):
        JaggEngine(endpoint_backward="parallel")


# --- automatic routing -------------------------------------------------------------------------------------------


class LinearThenCurved(nn.Module):
    """``v = A z + b t + c`` for ``t >= t_switch``; below it a nonlinear term grows in: exactly linear in the early
    (high-noise) steps, not in the late ones."""

    def __init__(self, t_switch: float, dim: int = DIM):
        super().__init__()
        self.t_switch = t_switch
        self.linear = LinearVelocity(dim)
        self.curve = nn.Linear(dim, dim, dtype=DTYPE)

    def forward(self, z: torch.Tensor, t: float) -> torch.Tensor:
        return self.linear(z, t) + 3.0 * max(self.t_switch - t, 0.0) * torch.tanh(self.curve(z)) ** 2


@pytest.mark.parametrize("linear_groups", [1, 2])
def test_auto_routing_picks_exactly_the_linear_groups(linear_groups):
    torch.manual_seed(11)
    num_steps, group_size = 13, 4  # three full groups and a one-step remainder
    times = shifted_sigmas(num_steps)[:num_steps]
    # The switch is the first step of the first curved group: every step before it is in the linear regime.
    model = LinearThenCurved(t_switch=times[group_size * linear_groups])
    rollout = make_rollout(model, num_steps, linear_trajectory=True)
    groups = plan_groups(rollout.times, group_size, 1.0)
    joint = [g for g in groups if g.is_joint]
    report = gradient_diagnostic(joint, rollout.velocity_fn, rollout.loss_fn, params_of(model))
    cosines = [d.cosine for d in report]
    assert cosines[:linear_groups] == pytest.approx([1.0] * linear_groups, abs=1e-9)
    assert all(c < 1 - 1e-6 for c in cosines[linear_groups:])
    frac = leading_jagg_fraction(cosines, len(groups), threshold=1 - 1e-7)
    assert frac == linear_groups / 4
    routed = plan_groups(rollout.times, group_size, frac)
    assert [g.method for g in routed] == ["jagg"] * linear_groups + ["exact"] * (4 - linear_groups)


def test_leading_jagg_fraction_by_hand():
    assert leading_jagg_fraction([0.9, 0.8, 0.5], 4, 0.7) == 0.5
    assert leading_jagg_fraction([0.9, 0.5, 0.8], 3, 0.7) == pytest.approx(1 / 3)  # leading groups only
    assert leading_jagg_fraction([0.5, 0.9], 2, 0.7) == 0.0
    assert leading_jagg_fraction([0.9, float("nan")], 2, 0.7) == 0.5  # NaN never qualifies
    assert leading_jagg_fraction([], 1, 0.7) == 0.0
    for cosines, n in (([0.9, 0.9, 0.2], 4), ([0.9, 0.9, 0.9], 3)):
        frac = leading_jagg_fraction(cosines, n, 0.7)
        times = [1.0 - 0.05 * k for k in range(4 * n)]
        leading = next((i for i, c in enumerate(cosines) if c < 0.7), len(cosines))
        assert sum(g.is_joint for g in plan_groups(times, 4, frac)) == leading
