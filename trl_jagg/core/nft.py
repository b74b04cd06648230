"""DiffusionNFT: the negative-aware flow-matching objective (pure torch; knows nothing about diffusers).

DiffusionNFT (Zheng et al., arXiv 2509.16117; NVlabs/DiffusionNFT) trains on the forward process instead of the
reverse SDE: a clean rollout sample ``x0`` is noised to ``x_t = (1 - t) x0 + t eps`` and the current velocity
``v_theta(x_t, t)`` is combined with the sampling ("old") policy's ``v_old(x_t, t)`` into two implicit policies,

    v+ = beta v_theta + (1 - beta) v_old          (the positive policy)
    v- = (1 + beta) v_old - beta v_theta          (the implicit negative policy),

whose clean-sample predictions ``x0± = x_t - t v±`` are pulled towards ``x0`` in proportion to the sample's
optimality probability ``r`` (positive) and ``1 - r`` (negative). Each squared error is divided by its own detached
mean absolute error (the reference code's adaptive weighting), and the sum is scaled by ``adv_clip_max / beta``.
No log-probability and no SDE are involved, so rollouts may use any deterministic solver.

The formulas follow ``scripts/train_nft_sd3.py`` at NVlabs/DiffusionNFT@24af555 (lines 910-970: the optimality
probability, the implicit policies, the adaptive weights, the loss and its KL term) and ``return_decay`` (lines
169-189: how fast the sampling policy follows the trained one). ``global_step`` there and here counts optimizer
steps, so the decay follows DiffusionNFT's per image only at its batch (1152 images a step; the presets'
``diffusion_nft_batch``). The noise ``eps`` is the caller's: DiffusionNFT draws a fresh one per timestep; JAGG-NFT
shares one per group of timesteps, and its exact limits hold against that shared-noise NFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OLD_POLICY_DECAY_TYPES: dict[int, tuple[int, float, float]] = {
    0: (0, 0.0, 0.0),
    1: (0, 0.001, 0.5),
    2: (75, 0.0075, 0.999),
}
"""The reference code's ``decay_type`` -> (flat steps, rate per step, ceiling) of the old policy's decay."""

ADAPTIVE_WEIGHT_FLOOR = 1e-5
"""The adaptive weight's lower clip (the reference code's ``clip(min=0.00001)``)."""


def old_policy_decay(global_step: int, decay_type: int) -> float:
    """How much of the old (sampling) policy is kept when it follows the trained one after a rollout's updates:
    ``old <- decay * old + (1 - decay) * current``. 0 before ``flat`` steps, then ``rate * (step - flat)`` capped at
    the ceiling (type 0: always on-policy; type 1: up to 0.5 at step 500; type 2: flat for 75 steps, then up to
    0.999)."""
    if decay_type not in OLD_POLICY_DECAY_TYPES:
        raise ValueError(f"decay_type must be one of {sorted(OLD_POLICY_DECAY_TYPES)}, got {decay_type!r}.")
    flat, rate, ceiling = OLD_POLICY_DECAY_TYPES[decay_type]
    if global_step < flat:
        return 0.0
    return min((global_step - flat) * rate, ceiling)


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """The advantage mapped to ``[0, 1]``: clipped to ``±adv_clip_max``, then ``A / (2 adv_clip_max) + 1/2``."""
    clipped = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (clipped / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def forward_noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t eps`` with ``t`` per sample (broadcast over the latent dims)."""
    t = t.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - t) * x0 + t * noise


@dataclass
class NFTLossOutput:
    """One timestep's NFT loss and its diagnostics (detached), averaged over the batch."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    old_deviation: torch.Tensor


def _adaptive_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample mean squared error divided by its detached per-sample mean absolute error (float64 weight)."""
    dims = tuple(range(1, target.ndim))
    with torch.no_grad():
        weight = (prediction.double() - target.double()).abs().mean(dim=dims, keepdim=True)
        weight = weight.clamp(min=ADAPTIVE_WEIGHT_FLOOR)
    return ((prediction - target) ** 2 / weight).mean(dim=dims)


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    optimality: torch.Tensor,
    *,
    nft_beta: float,
    adv_clip_max: float,
    ref_velocity: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> NFTLossOutput:
    """The negative-aware flow-matching loss of one timestep of a batch.

    Args:
        velocity: the trained policy's ``v_theta(x_t, t)`` (with graph), ``(B, ...)``.
        old_velocity: the sampling policy's ``v_old(x_t, t)`` (no graph needed; detached here).
        x0: the rollout's clean latents; ``x_t`` their forward-noised inputs at ``t`` (``(B,)``).
        optimality: the optimality probability ``r`` per sample (:func:`optimality_probability`).
        nft_beta: the guidance strength ``beta`` of the implicit policies (the reference code's ``config.beta``).
        adv_clip_max: the advantage clip, also the loss scale (the reference code's ``train.adv_clip_max``).
        ref_velocity: the reference (base) model's velocity, for the KL term ``kl_beta * mean((v - v_ref)^2)``.
        kl_beta: the KL coefficient (the reference code's ``train.beta``).
    """
    old_velocity = old_velocity.detach()
    t_ = t.view(-1, *([1] * (x0.ndim - 1))).to(velocity.dtype)
    positive = nft_beta * velocity + (1 - nft_beta) * old_velocity
    negative = (1 + nft_beta) * old_velocity - nft_beta * velocity
    positive_loss = _adaptive_squared_error(x_t - t_ * positive, x0)
    negative_loss = _adaptive_squared_error(x_t - t_ * negative, x0)
    r = optimality.to(positive_loss.dtype)
    per_sample = (r * positive_loss + (1 - r) * negative_loss) / nft_beta
    policy_loss = (per_sample * adv_clip_max).mean()
    dims = tuple(range(1, x0.ndim))
    kl = torch.zeros((), device=velocity.device)
    if ref_velocity is not None:
        kl = ((velocity - ref_velocity.detach()) ** 2).mean(dim=dims).mean()
    loss = policy_loss + kl_beta * kl if ref_velocity is not None else policy_loss
    return NFTLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl=kl.detach(),
        old_deviation=((velocity.detach() - old_velocity) ** 2).mean(),
    )
