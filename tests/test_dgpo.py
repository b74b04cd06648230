"""DGPO (group-level DPO on forward-noised ODE samples): the loss and its gradient against the paper's group
log-sigmoid written out here on a toy velocity in float64, its limits (zero advantages, a group of identical
samples, clipping), groups split over micro-batches, the timestep draw and the old policy's decay."""

from __future__ import annotations

import math

import pytest
import torch
from testing_utils import linear_velocity, linear_velocity_params

from trl_jagg.core.dgpo import dgpo_loss, dgpo_train_timestep_indices, group_preference_logits, old_policy_decay

SHAPE = (6, 2, 3)  # two groups of three latents of 2 x 3
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
G = 3


def perturbed(params, gen, scale):
    return tuple((p + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)).detach() for p in params)


def batch_inputs(seed):
    """Clean latents, one noise per group (DGPO's shared noise), one timestep, advantages (one beyond the clip)."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    eps = torch.randn(2, *SHAPE[1:], generator=gen, dtype=torch.float64)[GROUPS]
    t = torch.full((SHAPE[0],), 0.6, dtype=torch.float64)
    advantages = torch.tensor([1.1, -0.4, -6.0, 0.9, 0.2, -1.1], dtype=torch.float64)
    return gen, x0, eps, t, advantages


def noised(x0, eps, t):
    return (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps


def dsm_by_hand(params, x0, eps, t, b):
    x_t = (1 - t[b]) * x0[b : b + 1] + t[b] * eps[b : b + 1]
    return ((linear_velocity(params, x_t, t[b : b + 1])[0] - (eps[b] - x0[b])) ** 2).mean()


def paper_loss_by_hand(params, ref_params, x0, eps, t, advantages, beta_dpo, clip_max):
    """arXiv 2510.08425's group preference loss with the authors' advantage weights: mean over groups of
    ``-log sigmoid(-beta/G sum_i A_i (dsm_theta_i - dsm_ref_i))``, with its graph."""
    total = 0.0
    for g in GROUPS.unique().tolist():
        logit = 0.0
        for b in (GROUPS == g).nonzero().flatten().tolist():
            a = min(max(float(advantages[b]), -clip_max), clip_max)
            with torch.no_grad():
                ref = dsm_by_hand(ref_params, x0, eps, t, b)
            logit = logit + beta_dpo / G * a * (dsm_by_hand(params, x0, eps, t, b) - ref)
        total = total - torch.nn.functional.logsigmoid(-logit) / len(GROUPS.unique())
    return total


def surrogate_by_hand(params, ref_params, old_params, x0, eps, t, advantages, *, beta_dpo, clip_max, clip,
                      kl_params=None, kl_beta=0.0, clip_kl=False):  # fmt: skip
    """The authors' surrogate, sample by sample: sigmoid(detached group logit) A_i dsm_i, dsm_i detached where the
    old-policy ratio left the trust region on the advantage's side, plus the velocity KL."""
    batch = x0.shape[0]
    adv = [min(max(float(a), -clip_max), clip_max) for a in advantages]
    dsm = [dsm_by_hand(params, x0, eps, t, b) for b in range(batch)]
    with torch.no_grad():
        ref = [dsm_by_hand(ref_params, x0, eps, t, b) for b in range(batch)]
        old = [dsm_by_hand(old_params, x0, eps, t, b) for b in range(batch)]
    clipped = []
    for b in range(batch):
        ratio = math.exp(float(old[b]) - float(dsm[b].detach()))
        clipped.append(ratio > 1 + clip if adv[b] > 0 else ratio < 1 - clip)
    logits = {g: sum(beta_dpo / G * adv[b] * (float(dsm[b].detach()) - float(ref[b])) for b in range(batch) if GROUPS[b] == g)
              for g in (0, 1)}  # fmt: skip
    total = 0.0
    for b in range(batch):
        d = dsm[b].detach() if clipped[b] else dsm[b]
        total = total + torch.sigmoid(torch.tensor(logits[int(GROUPS[b])], dtype=torch.float64)) * adv[b] * d / batch
        if kl_params is not None:
            x_t = (1 - t[b]) * x0[b : b + 1] + t[b] * eps[b : b + 1]
            v = linear_velocity(params, x_t, t[b : b + 1])[0]
            kl = ((v - linear_velocity(kl_params, x_t, t[b : b + 1])[0].detach()) ** 2).mean()
            total = total + kl_beta * (kl.detach() if clip_kl and clipped[b] else kl) / batch
    return total, sum(clipped) / batch


def velocities(param_sets, x0, eps, t):
    x_t = noised(x0, eps, t)
    return [linear_velocity(p, x_t, t) for p in param_sets]


def test_the_gradient_is_the_papers_group_log_sigmoid_over_beta():
    gen, x0, eps, t, advantages = batch_inputs(0)
    params = linear_velocity_params(gen, SHAPE[1:])
    ref_params = perturbed(params, gen, 0.2)
    expected = paper_loss_by_hand(params, ref_params, x0, eps, t, advantages, beta_dpo=10.0, clip_max=5.0)
    expected_grads = torch.autograd.grad(expected, params)
    velocity, ref = velocities([params, ref_params], x0, eps, t)
    out = dgpo_loss(velocity, x0, eps, advantages, GROUPS, ref.detach(), num_groups=2, group_size=G, dpo_beta=10.0)
    grads = torch.autograd.grad(out.loss, params)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        # float64 on both sides, through sigmoid vs logsigmoid: equal to rounding.
        torch.testing.assert_close(grad, expected_grad / 10.0, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("clip_kl", [False, True])
def test_loss_with_clipping_and_kl_matches_the_authors_surrogate(clip_kl):
    gen, x0, eps, t, advantages = batch_inputs(1)
    params = linear_velocity_params(gen, SHAPE[1:])
    ref_params, old_params, kl_params = perturbed(params, gen, 0.2), perturbed(params, gen, 0.1), perturbed(params, gen, 0.3)  # fmt: skip
    # A clip range that the old policy's ratios cross on some samples, not all (checked below).
    clip = 0.05
    expected, clipped_share = surrogate_by_hand(params, ref_params, old_params, x0, eps, t, advantages, beta_dpo=10.0,
                                                clip_max=5.0, clip=clip, kl_params=kl_params, kl_beta=0.4,
                                                clip_kl=clip_kl)  # fmt: skip
    assert 0 < clipped_share < 1, "the case must hold clipped and unclipped samples"
    expected_grads = torch.autograd.grad(expected, params)
    velocity, ref, old, kl_ref = velocities([params, ref_params, old_params, kl_params], x0, eps, t)
    out = dgpo_loss(velocity, x0, eps, advantages, GROUPS, ref.detach(), num_groups=2, group_size=G, dpo_beta=10.0,
                    old_velocity=old.detach(), clip_range=clip, clip_kl=clip_kl, kl_ref_velocity=kl_ref.detach(),
                    kl_beta=0.4)  # fmt: skip
    grads = torch.autograd.grad(out.loss, params)
    torch.testing.assert_close(out.loss, expected, rtol=1e-11, atol=1e-15)
    assert float(out.clip_fraction) == pytest.approx(clipped_share, abs=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-13)


def test_zero_advantages_give_no_gradient():
    gen, x0, eps, t, _ = batch_inputs(2)
    params = linear_velocity_params(gen, SHAPE[1:])
    velocity, ref = velocities([params, perturbed(params, gen, 0.2)], x0, eps, t)
    zeros = torch.zeros(SHAPE[0], dtype=torch.float64)
    out = dgpo_loss(velocity, x0, eps, zeros, GROUPS, ref.detach(), num_groups=2, group_size=G, dpo_beta=10.0)
    grads = torch.autograd.grad(out.loss, params)
    assert float(out.loss.detach()) == 0.0
    assert float(out.group_weight) == 0.5  # sigmoid(0)
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_a_group_of_identical_samples_adds_no_gradient():
    """Identical images (same x0, same noise) with zero-sum advantages have equal DSM errors: their group logit is 0
    and their weighted gradients cancel, so the batch's gradient is the other group's alone (at its share)."""
    gen, x0, eps, t, advantages = batch_inputs(3)
    x0 = x0.clone()
    x0[:3] = x0[0]
    advantages = advantages.clone()
    advantages[:3] = torch.tensor([1.0, 0.5, -1.5], dtype=torch.float64)
    params = linear_velocity_params(gen, SHAPE[1:])
    ref_params = perturbed(params, gen, 0.2)
    velocity, ref = velocities([params, ref_params], x0, eps, t)
    out = dgpo_loss(velocity, x0, eps, advantages, GROUPS, ref.detach(), num_groups=2, group_size=G, dpo_beta=10.0)
    grads = torch.autograd.grad(out.loss, params)
    other = GROUPS == 1
    v_other = linear_velocity(params, noised(x0[other], eps[other], t[other]), t[other])
    alone = dgpo_loss(v_other, x0[other], eps[other], advantages[other], torch.zeros(3, dtype=torch.long),
                      ref[other].detach(), num_groups=1, group_size=G, dpo_beta=10.0)  # fmt: skip
    alone_grads = torch.autograd.grad(alone.loss, params)
    for grad, alone_grad in zip(grads, alone_grads, strict=True):
        torch.testing.assert_close(grad, alone_grad / 2, rtol=1e-10, atol=1e-14)


def test_clipped_samples_have_no_gradient():
    """Every sample clipped on its advantage's side (old policy farther from the target for A > 0, closer for A < 0):
    no DSM gradient flows."""
    gen, x0, eps, t, _ = batch_inputs(4)
    params = linear_velocity_params(gen, SHAPE[1:])
    velocity, ref = velocities([params, perturbed(params, gen, 0.2)], x0, eps, t)
    target = eps - x0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    with torch.no_grad():
        scale = torch.where(advantages > 0, 3.0, 0.2).view(-1, 1, 1)
        old = target + scale * (velocity - target)
    out = dgpo_loss(velocity, x0, eps, advantages, GROUPS, ref.detach(), num_groups=2, group_size=G, dpo_beta=10.0,
                    old_velocity=old, clip_range=1e-3)  # fmt: skip
    grads = torch.autograd.grad(out.loss, params)
    assert float(out.clip_fraction) == 1.0
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_groups_split_over_micro_batches_give_the_whole_batch_gradient():
    """Each micro-batch holds part of every group: the summed partial logits (the cross-process reduce) make the two
    micro-batches' losses, weighted by their sizes, the whole batch's."""
    gen, x0, eps, t, advantages = batch_inputs(5)
    params = linear_velocity_params(gen, SHAPE[1:])
    ref_params = perturbed(params, gen, 0.2)
    velocity, ref = velocities([params, ref_params], x0, eps, t)
    kwargs = {"num_groups": 2, "group_size": G, "dpo_beta": 10.0}
    whole = dgpo_loss(velocity, x0, eps, advantages, GROUPS, ref.detach(), **kwargs)
    halves = [torch.tensor([0, 1, 3]), torch.tensor([2, 4, 5])]
    target = eps - x0
    partial = [
        group_preference_logits(
            ((velocity[h] - target[h]) ** 2).mean(dim=(1, 2)), ((ref[h] - target[h]) ** 2).mean(dim=(1, 2)),
            advantages[h].clamp(-5, 5), GROUPS[h], 2, dpo_beta=10.0, group_size=G,
        )
        for h in halves
    ]  # fmt: skip
    total = 0.0
    for k, h in enumerate(halves):
        other = partial[1 - k]
        out = dgpo_loss(velocity[h], x0[h], eps[h], advantages[h], GROUPS[h], ref[h].detach(),
                        reduce_group_sums=lambda own, other=other: own + other, **kwargs)  # fmt: skip
        total = total + out.loss * len(h) / SHAPE[0]
    torch.testing.assert_close(total, whole.loss, rtol=1e-12, atol=1e-15)
    total_grads = torch.autograd.grad(total, params, retain_graph=True)
    for grad, whole_grad in zip(total_grads, torch.autograd.grad(whole.loss, params), strict=True):
        torch.testing.assert_close(grad, whole_grad, rtol=1e-10, atol=1e-14)


def test_bad_group_labels_are_refused():
    gen, x0, eps, t, advantages = batch_inputs(6)
    v = torch.zeros(SHAPE, dtype=torch.float64)
    with pytest.raises(ValueError, match="group_ids"):
        dgpo_loss(v, x0, eps, advantages, GROUPS, v, num_groups=1, group_size=G, dpo_beta=10.0)


def test_timestep_indices_are_distinct_and_within_the_truncation():
    indices = dgpo_train_timestep_indices(6, 4, torch.Generator().manual_seed(0))
    assert len(set(indices.tolist())) == 4 and all(0 <= i <= 6 for i in indices.tolist())
    with pytest.raises(ValueError, match="dgpo_trunc_steps"):
        dgpo_train_timestep_indices(2, 4)


def test_old_policy_decay_is_the_authors_ramp():
    assert [old_policy_decay(s) for s in (0, 1, 150, 300, 5000)] == [0.0, 0.001, 0.15, 0.3, 0.3]
