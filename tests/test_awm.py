"""AWM (Advantage Weighted Matching): the loss and its gradient against the paper's formula written out here on a
toy velocity in float64, its limits (on-policy, zero advantages, clipping), the timestep strata and the KL-EMA
decay."""

from __future__ import annotations

import pytest
import torch
from testing_utils import linear_velocity, linear_velocity_params

from trl_jagg.core.awm import AWM_WEIGHTINGS, awm_loss, awm_train_timestep_indices, linear_ramp_decay

SHAPE = (4, 2, 3)  # batch of 4 latents of 2 x 3


def weighted_log_prob_by_hand(v, x0, eps, t, weighting, power):
    """arXiv 2509.25050's matching log-likelihood with the authors' weightings, one sample."""
    mse = ((v - (eps - x0)) ** 2).mean()
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -t * mse
    if weighting == "t2":
        return -(t**2) * mse
    if weighting == "huber":
        return -t * ((mse + 1e-10) ** 0.5 - 1e-5)
    return -t * ((mse + 1e-10) ** power - 1e-10**power) / power


def ratios_by_hand(params, old_params, x0, eps, t, weighting, power=0.25):
    """Each sample's likelihood ratio ``exp(lp - lp_old)``."""
    ratios = []
    for b in range(x0.shape[0]):
        x_t = (1 - t[b]) * x0[b : b + 1] + t[b] * eps[b : b + 1]
        lp, lp_old = (
            weighted_log_prob_by_hand(linear_velocity(p, x_t, t[b : b + 1])[0], x0[b], eps[b], t[b], weighting, power)
            for p in (params, old_params)
        )
        ratios.append(float(torch.exp(lp - lp_old).detach()))
    return ratios


def awm_loss_by_hand(params, old_params, x0, eps, t, advantages, *, clip, clip_max, adv_max, weighting,
                     power=0.25, ref_params=None, kl_beta=0.0, ema_params=None, ema_beta=0.0):  # fmt: skip
    """PPO-clipped ratio of advantage-weighted matching likelihoods plus the two velocity KLs, sample by sample."""
    batch = x0.shape[0]
    total = 0.0
    for b in range(batch):
        x_t = (1 - t[b]) * x0[b : b + 1] + t[b] * eps[b : b + 1]
        tb = t[b : b + 1]
        v = linear_velocity(params, x_t, tb)[0]
        with torch.no_grad():
            v_old = linear_velocity(old_params, x_t, tb)[0]
        lp = weighted_log_prob_by_hand(v, x0[b], eps[b], t[b], weighting, power)
        lp_old = weighted_log_prob_by_hand(v_old, x0[b], eps[b], t[b], weighting, power)
        a = min(max(float(advantages[b]), -clip_max), clip_max)
        if adv_max is not None:
            a = a / clip_max * adv_max
        ratio = torch.exp(lp - lp_old)
        total = total + torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip)) / batch
        if ref_params is not None:
            total = total + kl_beta * ((v - linear_velocity(ref_params, x_t, tb)[0].detach()) ** 2).mean() / batch
        if ema_params is not None:
            total = total + ema_beta * ((v - linear_velocity(ema_params, x_t, tb)[0].detach()) ** 2).mean() / batch
    return total


def batch_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    x0, eps = (torch.randn(SHAPE, generator=gen, dtype=torch.float64) for _ in range(2))
    t = torch.tensor([0.95, 0.7, 0.4, 0.15], dtype=torch.float64)
    advantages = torch.tensor([6.0, -1.2, 0.5, -7.0], dtype=torch.float64)  # the first and last beyond the clip
    return gen, x0, eps, t, advantages


def perturbed(params, gen, scale):
    return tuple((p + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)).detach() for p in params)


def code_loss(params, old_params, x0, eps, t, advantages, ref_params=None, ema_params=None, **kwargs):
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    velocity = linear_velocity(params, x_t, t)
    with torch.no_grad():
        old = linear_velocity(old_params, x_t, t) if old_params is not None else None
        ref = linear_velocity(ref_params, x_t, t) if ref_params is not None else None
        ema = linear_velocity(ema_params, x_t, t) if ema_params is not None else None
    return awm_loss(velocity, x0, eps, t, advantages, old_velocity=old, ref_velocity=ref, ema_velocity=ema, **kwargs)


@pytest.mark.parametrize("weighting", AWM_WEIGHTINGS)
@pytest.mark.parametrize("with_kl", [False, True])
def test_awm_loss_and_gradient_match_the_papers_formula(weighting, with_kl):
    gen, x0, eps, t, advantages = batch_inputs(0)
    params = linear_velocity_params(gen, SHAPE[1:])
    old_params = perturbed(params, gen, 0.05)  # off-policy: ratios away from 1
    ref_params, ema_params = perturbed(params, gen, 0.2), perturbed(params, gen, 0.1)
    kl = {"ref_params": ref_params, "kl_beta": 0.3, "ema_params": ema_params, "ema_beta": 0.7} if with_kl else {}
    # A clip range between the smallest and largest |r - 1|: some samples clipped, some not.
    deviations = sorted(abs(r - 1) for r in ratios_by_hand(params, old_params, x0, eps, t, weighting))
    clip = (deviations[0] * deviations[-1]) ** 0.5
    expected = awm_loss_by_hand(params, old_params, x0, eps, t, advantages, clip=clip, clip_max=5.0, adv_max=1.0,
                                weighting=weighting, **kl)  # fmt: skip
    expected_grads = torch.autograd.grad(expected, params)
    kl_kwargs = (
        {"ref_params": ref_params, "kl_beta": 0.3, "ema_params": ema_params, "ema_kl_beta": 0.7} if with_kl else {}
    )
    out = code_loss(params, old_params, x0, eps, t, advantages, clip_range=clip, adv_clip_max=5.0,
                    advantage_max=1.0, weighting=weighting, **kl_kwargs)  # fmt: skip
    grads = torch.autograd.grad(out.loss, params)
    assert 0 < out.clip_fraction < 1, "the case must hold clipped and unclipped samples"
    # float64 on both sides, the same operations in another order: equal to rounding.
    torch.testing.assert_close(out.loss, expected, rtol=1e-11, atol=1e-15)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-13)


def test_on_policy_awm_is_advantage_weighted_matching():
    """Old policy = trained policy (the authors' one optimizer step per rollout): the ratio is 1 and the gradient is
    that of ``-mean_i A_i lp_i`` (no clipping can bite at ratio 1)."""
    gen, x0, eps, t, advantages = batch_inputs(1)
    params = linear_velocity_params(gen, SHAPE[1:])
    out = code_loss(params, None, x0, eps, t, advantages, clip_range=1e-4, adv_clip_max=5.0, advantage_max=None)
    grads = torch.autograd.grad(out.loss, params)
    weighted = 0.0
    for b in range(SHAPE[0]):
        x_t = (1 - t[b]) * x0[b : b + 1] + t[b] * eps[b : b + 1]
        v = linear_velocity(params, x_t, t[b : b + 1])[0]
        a = min(max(float(advantages[b]), -5.0), 5.0)
        weighted = weighted - a * weighted_log_prob_by_hand(v, x0[b], eps[b], t[b], "ghuber", 0.25) / SHAPE[0]
    expected_grads = torch.autograd.grad(weighted, params)
    assert float(out.ratio) == 1.0  # exp(lp - lp) with lp_old the same float64 computation: exactly 1
    assert float(out.clip_fraction) == 0.0
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_zero_advantages_give_no_policy_gradient():
    gen, x0, eps, t, _ = batch_inputs(2)
    params = linear_velocity_params(gen, SHAPE[1:])
    out = code_loss(params, perturbed(params, gen, 0.05), x0, eps, t, torch.zeros(SHAPE[0], dtype=torch.float64))
    grads = torch.autograd.grad(out.loss, params)
    assert float(out.loss.detach()) == 0.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_a_sample_clipped_on_its_advantages_side_has_no_gradient():
    """A positive advantage whose ratio passed 1 + eps and a negative one whose ratio fell under 1 - eps are clipped:
    the pessimistic max takes the constant branch and the batch has no policy gradient."""
    gen, x0, eps, t, _ = batch_inputs(3)
    params = linear_velocity_params(gen, SHAPE[1:])
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    velocity = linear_velocity(params, x_t, t)
    target = eps - x0
    with torch.no_grad():  # old velocities farther from / closer to the target than the trained one
        old = target + torch.where(
            torch.arange(SHAPE[0]).view(-1, 1, 1) % 2 == 0, 3.0 * (velocity - target), 0.2 * (velocity - target)
        )
    advantages = torch.tensor([1.0, -1.0, 2.0, -0.5], dtype=torch.float64)  # even: ratio > 1; odd: ratio < 1
    out = awm_loss(velocity, x0, eps, t, advantages, old_velocity=old, clip_range=1e-3, weighting="uniform")
    grads = torch.autograd.grad(out.loss, params)
    assert float(out.clip_fraction) == 1.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_kl_without_its_reference_is_refused():
    gen, x0, eps, t, advantages = batch_inputs(4)
    with pytest.raises(ValueError, match="ref_velocity"):
        awm_loss(torch.zeros(SHAPE, dtype=torch.float64), x0, eps, t, advantages, kl_beta=0.1)


def strata_by_hand(start, last, count, draws):
    """The authors' linspace strata [lower_k, upper_k), truncated to integers, one draw in each."""
    bounds = [start + (last - start) * k / count for k in range(count + 1)]
    return [int(bounds[k]) + int(draws[k] * (int(bounds[k + 1]) - int(bounds[k]))) for k in range(count)]


@pytest.mark.parametrize(
    ("strategy", "steps", "fraction", "count"),
    [("discrete", 14, 0.9, 6), ("discrete_wo_init", 14, 0.9, 6), ("discrete_with_init", 10, 0.7, 4)],
)
def test_timestep_indices_follow_the_authors_strata(strategy, steps, fraction, count):
    indices = awm_train_timestep_indices(steps, count, fraction, strategy, torch.Generator().manual_seed(5))
    drawn = count - 1 if strategy == "discrete_with_init" else count
    draws = torch.rand(drawn, generator=torch.Generator().manual_seed(5)).tolist()
    expected = strata_by_hand(0 if strategy == "discrete" else 1, int(steps * fraction), drawn, draws)
    if strategy == "discrete_with_init":
        expected = [0, *expected]
    assert indices.tolist() == expected


def test_timestep_strata_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="timestep_fraction"):
        awm_train_timestep_indices(4, 6, 0.9)


def test_linear_ramp_decay():
    assert [linear_ramp_decay(s, 0.3) for s in (0, 100, 300, 1000)] == [0.0, 0.1, 0.3, 0.3]
