"""DGPO: Direct Group Preference Optimization (pure torch; knows nothing about diffusers).

DGPO (Luo, Hu and Tang, arXiv 2510.08425; Luo-Yihong/DGPO) trains on the forward process from deterministic ODE
rollouts. At a trained timestep every image ``i`` of a prompt group ``g`` (``G`` images) is noised to
``x_t = (1 - t) x0 + t eps`` and scored by its denoising (flow-matching) error against the target ``eps - x0``,

    dsm_i     = mean_d (v_theta(x_t, t)_i - (eps_i - x0_i))^2
    ref_i     = mean_d (v_ref(x_t, t)_i  - (eps_i - x0_i))^2          (the DGPO reference, no graph)
    A_i       = clip(A_i, -adv_clip_max, adv_clip_max)
    z_g       = dpo_beta / G * sum_{i in g} A_i (dsm_i - ref_i)         (detached: the group's preference logit)
    L_dgpo    = mean_i sigmoid(z_g(i)) A_i dsm_i
    L         = L_dgpo + kl_beta mean_i mean_d (v_theta - v_kl_ref)^2

The group-level DPO loss of the paper, ``mean_g -log sigmoid(-z_g)`` with ``z_g`` taken with its graph, has the
gradient ``mean_g sigmoid(z_g) dpo_beta / G sum_{i in g} A_i grad dsm_i``; ``L_dgpo``'s is that divided by ``dpo_beta``
(the authors' "gradient-equivalent" form, which needs only the detached group sums across processes, not the
group's graphs). PPO-style clipping against the old policy (an EMA of the trained weights, :func:`old_policy_decay`)
detaches ``dsm_i`` (and, with ``clip_kl``, the KL term) where ``r_i = exp(old_dsm_i - dsm_i)`` left the trust region
on the side the advantage pushes: ``r_i > 1 + clip_range`` for ``A_i > 0``, ``r_i < 1 - clip_range`` otherwise.

One timestep's loss couples the images of a group through ``z_g``: the caller hands :func:`dgpo_loss` every image
of each group at the same ``t`` (the authors' micro-batches hold whole groups across processes, and one timestep
index is shared by every image of an epoch), or the complete group logits (``group_logits``, e.g. summed over
micro-batches or processes in a no-graph pass by :func:`group_preference_logits`). ``reduce_group_sums`` is the hook
for the cross-process sum (the authors' ``dist.all_reduce`` of the per-group partial sums).

The formulas follow ``scripts/train_sd3_dgpo.py`` at Luo-Yihong/DGPO@01ceb4b (``compute_group_dgpo_loss_allreduce``
L162-193; the loop L1097-1177: shared noise, the reference and old velocities, the advantage clip, the DSM clip, the
KL and its clip, the old policy's decay) and Flow-Factory's ``src/flow_factory/trainers/dgpo.py``
(``_compute_group_dgpo_loss``, ``_maybe_clip_dsm``, ``_apply_total_loss_and_backward``) at X-GenGroup/Flow-Factory@a0b2bc5.
The noise ``eps`` is the caller's: the authors draw one per group and timestep (``use_shared_noise``: every image of
a group gets the same ``eps``, fresh at each trained timestep; Flow-Factory keeps one per group for the whole epoch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trl_jagg.core.awm import linear_ramp_decay

DGPO_OLD_POLICY_DECAY_CEILING = 0.3
"""The authors' old-policy EMA: ``decay = min(0.3, 0.001 * global_step)`` after each optimizer step (L1176)."""


def old_policy_decay(global_step: int, ceiling: float = DGPO_OLD_POLICY_DECAY_CEILING, rate: float = 0.001) -> float:
    """The decay of DGPO's old policy (``ema_ref``) at the optimizer step counted ``global_step`` (0 for the first):
    ``old <- decay * old + (1 - decay) * current`` right after that step (train_sd3_dgpo.py L1174-1177;
    Flow-Factory's ``ema_ref_max_decay``, ``ema_ref_ramp_rate``)."""
    return linear_ramp_decay(global_step, ceiling, rate)


def dgpo_train_timestep_indices(
    trunc_steps: int, num_train_timesteps: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The rollout-step indices DGPO trains in an epoch: ``num_train_timesteps`` distinct indices drawn uniformly from
    ``0..trunc_steps`` (the authors' ``random.sample(range(trunc_steps + 1), M)``, L1062-1064), shared by every
    micro-batch of the epoch and every process."""
    if not 1 <= num_train_timesteps <= trunc_steps + 1:
        raise ValueError(
            f"num_train_timesteps={num_train_timesteps} distinct indices cannot be drawn from 0..{trunc_steps}: "
            "use 1 <= num_train_timesteps <= dgpo_trunc_steps + 1."
        )
    return torch.randperm(trunc_steps + 1, generator=generator)[:num_train_timesteps]


def _per_sample_mse(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((target - velocity) ** 2).reshape(velocity.shape[0], -1).mean(dim=1)


def _check_groups(group_ids: torch.Tensor, batch: int, num_groups: int) -> None:
    if group_ids.shape != (batch,) or group_ids.dtype != torch.long:
        raise ValueError(f"group_ids must be a (B,) = ({batch},) long tensor of group labels, got {group_ids.dtype}.")
    if batch and (int(group_ids.min()) < 0 or int(group_ids.max()) >= num_groups):
        raise ValueError(f"group_ids must lie in [0, num_groups={num_groups}).")


def group_preference_logits(
    dsm: torch.Tensor,
    ref_dsm: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int,
    *,
    dpo_beta: float,
    group_size: int,
) -> torch.Tensor:
    """This batch's share of each group's preference logit, ``dpo_beta / G * sum_{i in g} A_i (dsm_i - ref_i)``,
    detached, ``(num_groups,)``. ``advantages`` are already clipped; ``group_size`` is ``G``, the images a group has
    in all (not those in this batch), so partial sums over micro-batches or processes add up to the group's logit."""
    _check_groups(group_ids, dsm.shape[0], num_groups)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}.")
    terms = (advantages * dpo_beta * (dsm.detach() - ref_dsm.detach()) / group_size).detach()
    return torch.zeros(num_groups, dtype=terms.dtype, device=terms.device).scatter_add_(0, group_ids, terms)


@dataclass
class DGPOLossOutput:
    """One timestep's DGPO loss and its diagnostics (detached), averaged over the batch."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    dsm: torch.Tensor
    group_weight: torch.Tensor
    clip_fraction: torch.Tensor


def dgpo_loss(
    velocity: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    ref_velocity: torch.Tensor,
    *,
    num_groups: int,
    group_size: int,
    dpo_beta: float,
    adv_clip_max: float = 5.0,
    old_velocity: torch.Tensor | None = None,
    clip_range: float = 5e-2,
    clip_dsm: bool = True,
    clip_kl: bool = False,
    kl_ref_velocity: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    group_logits: torch.Tensor | None = None,
    reduce_group_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> DGPOLossOutput:
    """The group-level DGPO loss of one timestep of a batch (formula in the module docstring).

    Args:
        velocity: the trained policy's ``v_theta(x_t, t)`` (with graph, no CFG), ``(B, ...)``, at
            ``x_t = (1 - t) x0 + t noise`` (``t`` enters only through the velocities).
        x0, noise: the clean latents and the forward noise (shared within a group in DGPO).
        advantages: per-sample advantages ``(B,)`` (normalised by the caller; clipped here).
        group_ids: each image's group label in ``[0, num_groups)``, ``(B,)`` long.
        ref_velocity: the DGPO reference's velocity (the frozen base; the old policy under ``use_ema_ref``).
        group_size: ``G``, the images a group has in all.
        dpo_beta: the preference scale (the authors' ``train.beta_dpo``).
        old_velocity: the old policy's velocity, for the clip; None: no clip (``clip_dsm`` and ``clip_kl`` inert).
        kl_ref_velocity, kl_beta: the KL reference's velocity (the frozen base, optionally with ``kl_cfg``) and the
            KL coefficient (the authors' ``train.beta``).
        group_logits: the groups' complete preference logits, when this batch does not hold whole groups; by
            default this batch's own (:func:`group_preference_logits`), passed through ``reduce_group_sums``.
    """
    batch = x0.shape[0]
    if velocity.shape != x0.shape or noise.shape != x0.shape or ref_velocity.shape != x0.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)}, ref_velocity, x0 and noise must share one shape {tuple(x0.shape)}."
        )
    if advantages.shape != (batch,):
        raise ValueError(f"advantages must be (B,) = ({batch},), one per sample.")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max!r}.")
    if kl_beta > 0 and kl_ref_velocity is None:
        raise ValueError("kl_beta > 0 needs kl_ref_velocity, the reference model's velocity at the same input.")
    target = noise - x0
    adv = advantages.to(velocity.dtype).clamp(-adv_clip_max, adv_clip_max)
    dsm = _per_sample_mse(velocity, target)
    should_clip = torch.zeros(batch, dtype=torch.bool, device=velocity.device)
    if old_velocity is not None:
        with torch.no_grad():
            ratio = torch.exp(_per_sample_mse(old_velocity.detach(), target) - dsm.detach())
            should_clip = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        if clip_dsm:
            dsm = torch.where(should_clip, dsm.detach(), dsm)
    if group_logits is None:
        with torch.no_grad():
            ref_dsm = _per_sample_mse(ref_velocity.detach(), target)
        group_logits = group_preference_logits(
            dsm, ref_dsm, adv, group_ids, num_groups, dpo_beta=dpo_beta, group_size=group_size
        )
        if reduce_group_sums is not None:
            group_logits = reduce_group_sums(group_logits)
    else:
        _check_groups(group_ids, batch, num_groups)
        if group_logits.shape != (num_groups,):
            raise ValueError(f"group_logits must be (num_groups,) = ({num_groups},).")
    weights = torch.sigmoid(group_logits.detach().to(dsm.dtype))[group_ids]
    policy_loss = (weights * adv * dsm).mean()
    kl = torch.zeros((), device=velocity.device, dtype=velocity.dtype)
    if kl_ref_velocity is not None:
        per_sample_kl = _per_sample_mse(velocity, kl_ref_velocity.detach())
        if clip_kl:
            per_sample_kl = torch.where(should_clip, per_sample_kl.detach(), per_sample_kl)
        kl = per_sample_kl.mean()
    loss = policy_loss + kl_beta * kl
    return DGPOLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl=kl.detach(),
        dsm=dsm.detach().mean(),
        group_weight=weights.mean(),
        clip_fraction=should_clip.double().mean(),
    )
