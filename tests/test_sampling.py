"""Samplers with log-probs (`trl_jagg.core.sampling`), checked against independent float64 computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from trl_jagg.core.sampling import SAMPLERS, StepOutput, gaussian_log_prob, sampler_step


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: one intra-op thread is faster and immune to spin-waiting on a shared, busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _latent_dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _col(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or ``(batch,)`` value as a float64 ``(batch, 1, ..., 1)`` column."""
    value = torch.as_tensor(value, dtype=torch.float64)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    return value.view(-1, *([1] * (like.ndim - 1)))


def _reference_sde(x, v, sigma, sigma_next, a, sigma_max):
    """Flow-GRPO SDE step re-derived from the reverse-time SDE, in float64.

    The marginal-preserving SDE of the flow ``x_s = (1 - s) x0 + s eps`` has drift ``v - g^2/2 * score`` with the
    score of the Gaussian path ``-(x - (1 - s) x0) / s^2`` and ``x0 = x - s v``; one Euler-Maruyama step of size
    ``dt = sigma_next - sigma`` gives the mean ``x + (v - g^2/2 * score) dt`` and the std ``g sqrt(|dt|)``.
    """
    x, v = x.double(), v.double()
    s, s_next = _col(sigma, x), _col(sigma_next, x)
    s_tilde = torch.where(s == 1, _col(sigma_max, x), s)
    g = a * torch.sqrt(s / (1 - s_tilde))
    dt = s_next - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean = x + (v - 0.5 * g**2 * score) * dt
    std = g * torch.sqrt(-dt)
    return mean, std


def _reference_log_prob(x, mean, std):
    return Normal(mean.double(), std.double()).log_prob(x.double()).mean(_latent_dims(x))


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _latents(shape, gen, dtype=torch.float32):
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    nxt = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, v, nxt


# --- Gaussian log-prob -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 7), (2, 16, 8), (2, 4, 5, 6)])
def test_gaussian_log_prob_is_normal_log_prob_averaged_over_latent_dims(gen, shape):
    x, mean, _ = _latents(shape, gen, torch.float64)
    std = torch.rand(shape[0], generator=gen, dtype=torch.float64).add(0.1).view(-1, *([1] * (len(shape) - 1)))
    got = gaussian_log_prob(x, mean, std)
    assert got.shape == (shape[0],)
    torch.testing.assert_close(got, _reference_log_prob(x, mean, std), rtol=1e-12, atol=1e-12)
    # Averaged, not summed: the mean over dims is the sum divided by the number of latent elements.
    summed = Normal(mean, std).log_prob(x).sum(_latent_dims(x))
    torch.testing.assert_close(got * math.prod(shape[1:]), summed)


@pytest.mark.parametrize("sampler", ["sde", "dance"])
@pytest.mark.parametrize("shape", [(2, 16, 8), (2, 4, 6, 6)])  # packed Flux tokens and SD3 4-D latents
def test_log_prob_of_a_scored_sample_is_normal_log_prob(gen, sampler, shape):
    x, v, nxt = _latents(shape, gen)
    out = sampler_step(v, x, 0.6, 0.45, sampler=sampler, noise_level=0.8, prev_sample=nxt)
    assert isinstance(out, StepOutput)
    assert out.log_prob.shape == (shape[0],)
    assert out.std.shape == (shape[0],) + (1,) * (len(shape) - 1)
    expected = Normal(out.mean.double(), out.std.double()).log_prob(nxt.double()).mean(_latent_dims(nxt))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.prev_sample, nxt)


# --- Flow-GRPO SDE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 10), (2, 16, 8), (2, 4, 6, 6), (2, 3, 2, 4, 4)])
@pytest.mark.parametrize(("sigma", "sigma_next"), [(0.9, 0.75), (0.5, 0.3), (0.2, 0.0)])
def test_sde_mean_and_std_match_the_reverse_sde_derivation(gen, shape, sigma, sigma_next):
    x, v, nxt = _latents(shape, gen)
    out = sampler_step(v, x, sigma, sigma_next, sampler="sde", noise_level=0.7, prev_sample=nxt)
    mean, std = _reference_sde(x, v, sigma, sigma_next, 0.7, sigma_next)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().expand_as(x), std.expand_as(x), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.log_prob.double(), _reference_log_prob(nxt, mean, std), rtol=1e-5, atol=1e-5)


def test_sde_first_step_std_equals_noise_level(gen):
    sigmas = [1.0, 0.93, 0.8]
    x, v, _ = _latents((4, 8, 3), gen)
    for a in (0.7, 0.9, 1.2):
        out = sampler_step(v, x, sigmas[0], sigmas[1], sampler="sde", noise_level=a, sigma_max=sigmas[1])
        torch.testing.assert_close(out.std.flatten(), torch.full((4,), a), rtol=1e-6, atol=1e-7)
        # sigma_max defaults to sigma_next, which is sigmas[1] on the first step.
        default = sampler_step(v, x, sigmas[0], sigmas[1], sampler="sde", noise_level=a)
        torch.testing.assert_close(default.std.flatten(), torch.full((4,), a), rtol=1e-6, atol=1e-7)
        mean, _ = _reference_sde(x, v, 1.0, sigmas[1], a, sigmas[1])
        torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)


def test_sde_sigma_max_only_matters_at_sigma_one(gen):
    x, v, nxt = _latents((2, 6), gen)
    a = sampler_step(v, x, 0.8, 0.6, noise_level=0.7, sigma_max=0.95, prev_sample=nxt)
    b = sampler_step(v, x, 0.8, 0.6, noise_level=0.7, sigma_max=0.3, prev_sample=nxt)
    assert torch.equal(a.mean, b.mean) and torch.equal(a.log_prob, b.log_prob)
    c = sampler_step(v, x, 1.0, 0.6, noise_level=0.7, sigma_max=0.95, prev_sample=nxt)
    d = sampler_step(v, x, 1.0, 0.6, noise_level=0.7, sigma_max=0.3, prev_sample=nxt)
    assert not torch.allclose(c.std, d.std)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_zero_noise_is_the_euler_step(gen, sampler):
    x, v, _ = _latents((3, 4, 5, 5), gen)
    out = sampler_step(v, x, 0.7, 0.55, sampler=sampler, noise_level=0.0)
    euler = x.double() + (0.55 - 0.7) * v.double()
    torch.testing.assert_close(out.mean.double(), euler, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.prev_sample.double(), euler, rtol=1e-6, atol=1e-6)
    assert torch.all(out.std == 0)


def test_ode_step_is_euler_whatever_the_noise_level(gen):
    x, v, _ = _latents((2, 9), gen)
    out = sampler_step(v, x, torch.tensor([0.9, 0.4]), torch.tensor([0.8, 0.1]), sampler="ode", noise_level=0.7)
    euler = x.double() + torch.tensor([[-0.1], [-0.3]], dtype=torch.float64) * v.double()
    torch.testing.assert_close(out.prev_sample.double(), euler, rtol=1e-6, atol=1e-6)
    assert torch.all(out.log_prob == 0)


def test_small_noise_level_approaches_euler(gen):
    x, v, _ = _latents((2, 9), gen)
    out = sampler_step(v, x, 0.7, 0.5, sampler="sde", noise_level=1e-4)
    torch.testing.assert_close(out.mean.double(), x.double() - 0.2 * v.double(), rtol=1e-5, atol=1e-5)


# --- DanceGRPO and CPS -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 10), (2, 16, 8), (2, 4, 6, 6)])
def test_dance_mean_and_std(gen, shape):
    x, v, nxt = _latents(shape, gen)
    eta, sigma, sigma_next = 0.3, 0.6, 0.45
    out = sampler_step(v, x, sigma, sigma_next, sampler="dance", noise_level=eta, prev_sample=nxt)
    xd, vd = x.double(), v.double()
    dt = sigma_next - sigma
    # DanceGRPO is the Flow-GRPO SDE with a constant diffusion coefficient g = eta (closed form of its score term).
    mean = xd * (1 + eta**2 * dt / (2 * sigma)) + vd * (1 + eta**2 * (1 - sigma) / (2 * sigma)) * dt
    std = eta * math.sqrt(-dt)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().flatten(), torch.full((shape[0],), std, dtype=torch.float64))
    expected = Normal(mean, std).log_prob(nxt.double()).mean(_latent_dims(nxt))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 10), (2, 16, 8), (2, 4, 6, 6)])
def test_cps_preserves_coefficients(gen, shape):
    # With a perfect velocity the CPS mean is (1 - s') x0 + sqrt(s'^2 - std^2) eps: the x0 coefficient is the flow's
    # and the total noise variance std^2 + (s'^2 - std^2) is exactly s'^2.
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    eps = torch.randn(shape, generator=gen, dtype=torch.float64)
    nxt = torch.randn(shape, generator=gen, dtype=torch.float64)
    a, sigma, sigma_next = 0.6, 0.7, 0.5
    x = (1 - sigma) * x0 + sigma * eps
    v = eps - x0
    out = sampler_step(v, x, sigma, sigma_next, sampler="cps", noise_level=a, prev_sample=nxt)
    std = sigma_next * math.sin(a * math.pi / 2)
    mean = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps
    torch.testing.assert_close(out.std.double().flatten(), torch.full((shape[0],), std, dtype=torch.float64))
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    # CPS scores with the negative squared error only (no 1/std^2, no constants).
    expected = -((nxt - mean) ** 2).mean(_latent_dims(nxt))
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


# --- per-sample sigmas, dtypes, sampling vs scoring ---------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["sde", "dance", "cps", "ode"])
@pytest.mark.parametrize("shape", [(3, 12, 4), (3, 4, 5, 5)])
def test_per_sample_sigmas_equal_rowwise_scalar_calls(gen, sampler, shape):
    x, v, nxt = _latents(shape, gen)
    sigma = torch.tensor([1.0, 0.6, 0.25])
    sigma_next = torch.tensor([0.9, 0.5, 0.0])
    sigma_max = torch.tensor([0.9, 0.7, 0.3])
    kwargs = {"sampler": sampler, "noise_level": 0.7}
    batched = sampler_step(v, x, sigma, sigma_next, sigma_max=sigma_max, prev_sample=nxt, **kwargs)
    for i in range(shape[0]):
        row = sampler_step(
            v[i : i + 1], x[i : i + 1], float(sigma[i]), float(sigma_next[i]), sigma_max=float(sigma_max[i]),
            prev_sample=nxt[i : i + 1], **kwargs,
        )  # fmt: skip
        torch.testing.assert_close(batched.mean[i : i + 1], row.mean)
        torch.testing.assert_close(batched.std[i : i + 1], row.std)
        torch.testing.assert_close(batched.log_prob[i : i + 1], row.log_prob)
    if sampler == "sde":
        mean, std = _reference_sde(x, v, sigma, sigma_next, 0.7, sigma_max)
        torch.testing.assert_close(batched.mean.double(), mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched.std.double(), std, rtol=1e-6, atol=1e-7)
        assert batched.std[0].item() == pytest.approx(0.7, rel=1e-6)  # the sigma = 1 row uses its sigma_max


@pytest.mark.parametrize("sampler", ["sde", "dance", "cps"])
def test_bf16_inputs_are_computed_in_fp32(gen, sampler):
    x, v, nxt = _latents((2, 16, 8), gen, torch.bfloat16)
    out = sampler_step(v, x, 0.8, 0.65, sampler=sampler, noise_level=0.7, prev_sample=nxt)
    for tensor in (out.prev_sample, out.log_prob, out.mean, out.std):
        assert tensor.dtype == torch.float32
    ref = sampler_step(v.float(), x.float(), 0.8, 0.65, sampler=sampler, noise_level=0.7, prev_sample=nxt.float())
    assert torch.equal(out.mean, ref.mean) and torch.equal(out.log_prob, ref.log_prob)
    # A bf16 computation of the same mean would be visibly different.
    assert not torch.equal(out.mean, out.mean.bfloat16().float())


def test_sampled_step_is_mean_plus_std_times_generator_noise(gen):
    x, v, _ = _latents((3, 4, 4, 4), gen)
    out = sampler_step(v, x, 0.8, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(7))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out.prev_sample, out.mean + out.std * noise)
    torch.testing.assert_close(out.log_prob.double(), _reference_log_prob(out.prev_sample, out.mean, out.std))
    # Scoring the sampled latent reproduces its log-prob exactly: the PPO ratio of a fresh rollout is 1.
    again = sampler_step(v, x, 0.8, 0.6, noise_level=0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)


def test_scored_sample_is_returned_and_log_prob_is_differentiable_in_velocity_only(gen):
    x, v, nxt = _latents((2, 5, 3), gen)
    v.requires_grad_(True)
    nxt.requires_grad_(True)
    out = sampler_step(v, x, 0.5, 0.4, noise_level=0.7, prev_sample=nxt)
    assert torch.equal(out.prev_sample, nxt)
    out.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert nxt.grad is None  # the rollout's next latent is data, not a function of the parameters


# --- bad input ---------------------------------------------------------------------------------------------------


def test_bad_shapes_raise_value_error_naming_the_argument(gen):
    x, v, nxt = _latents((3, 4, 5), gen)
    with pytest.raises(ValueError, match="`velocity`"):
        sampler_step(v[:, :2], x, 0.5, 0.4)
    with pytest.raises(ValueError, match="`prev_sample`"):
        sampler_step(v, x, 0.5, 0.4, prev_sample=nxt[:2])
    with pytest.raises(ValueError, match="`sigma`"):
        sampler_step(v, x, torch.tensor([0.5, 0.4]), 0.3)
    with pytest.raises(ValueError, match="`sigma_next`"):
        sampler_step(v, x, 0.5, torch.full((3, 1), 0.3))
    with pytest.raises(ValueError, match="`sigma_max`"):
        sampler_step(v, x, 1.0, 0.9, sigma_max=torch.tensor([0.9, 0.9]))
    with pytest.raises(ValueError, match="`sampler`"):
        sampler_step(v, x, 0.5, 0.4, sampler="ddim")


def test_noise_scale_is_flow_grpo_std_dev_t_and_its_kl_formula():
    """Flow-GRPO's sampler returns std_dev_t = a sqrt(sigma / (1 - sigma)) (sigma = 1 replaced by sigmas[1]), without
    the sqrt(|dt|) of the step std; its KL is mean((mu - mu_ref)^2) / (2 std_dev_t^2) (scripts/train_sd3.py)."""
    from trl_jagg.core.grpo import kl_to_reference

    gen = torch.Generator().manual_seed(7)
    x, v, v_ref = (torch.randn(3, 4, 5, generator=gen, dtype=torch.float64) for _ in range(3))
    a = 0.7
    for sigma, sigma_next in ((1.0, 0.9), (0.6, 0.45)):
        out = sampler_step(v, x, sigma, sigma_next, noise_level=a, sigma_max=0.9)
        ref = sampler_step(v_ref, x, sigma, sigma_next, noise_level=a, sigma_max=0.9)
        g = a * math.sqrt(sigma / (1 - (0.9 if sigma == 1 else sigma)))
        torch.testing.assert_close(out.noise_scale.flatten(), torch.full((3,), g), rtol=1e-6, atol=0)
        torch.testing.assert_close(
            out.std.flatten(), torch.full((3,), g * math.sqrt(sigma - sigma_next)), rtol=1e-6, atol=0
        )
        hand = [((out.mean[b] - ref.mean[b]) ** 2).mean().item() / (2 * g**2) for b in range(3)]
        kl = kl_to_reference(out.mean, ref.mean, out.noise_scale)
        torch.testing.assert_close(kl.double(), torch.tensor(hand, dtype=torch.float64), rtol=1e-5, atol=0)
        # ... which is the exact step KL times |dt|.
        exact = kl_to_reference(out.mean, ref.mean, out.std)
        torch.testing.assert_close(kl, exact * (sigma - sigma_next), rtol=1e-5, atol=0)
    dance = sampler_step(v, x, 0.6, 0.45, sampler="dance", noise_level=0.3)
    assert torch.all(dance.noise_scale == 0.3)
    cps = sampler_step(v, x, 0.6, 0.45, sampler="cps", noise_level=0.8)
    torch.testing.assert_close(cps.noise_scale, cps.std)  # Flow-GRPO's CPS std_dev_t is the step std itself
