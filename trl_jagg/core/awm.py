"""AWM: Advantage Weighted Matching (pure torch; knows nothing about diffusers).

AWM (Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching) trains on the forward process like
DiffusionNFT: a clean rollout sample ``x0`` is noised to ``x_t = (1 - t) x0 + t eps`` and the flow-matching error of
the trained velocity against the conditional target ``eps - x0`` stands in for a log-likelihood,

    mse_i     = mean_d (v_theta(x_t, t)_i - (eps_i - x0_i))^2
    lp_i      = -w(mse_i, t_i)                    (``uniform``: mse, ``t``: t mse, ``t2``: t^2 mse,
                                                   ``huber``: t (sqrt(mse + 1e-10) - 1e-5),
                                                   ``ghuber``: t ((mse + 1e-10)^p - 1e-10^p) / p)
    r_i       = exp(lp_i - lp_old_i)             (lp_old: the same under the old policy, no graph)
    A_i       = clip(A_i, -adv_clip_max, adv_clip_max) [* advantage_max / adv_clip_max]
    L_policy  = mean_i max(-A_i r_i, -A_i clip(r_i, 1 - clip_range, 1 + clip_range_high))
    L         = L_policy + kl_beta mean_i mean_d (v - v_ref)^2 + ema_kl_beta mean_i mean_d (v - v_ema)^2

per trained timestep: the PPO-clipped ratio of "log-likelihoods" that are advantage-weighted matching losses.
With the old policy equal to the trained one (the authors' on-policy setting, one optimizer step per rollout) the
ratio is 1 in value and the gradient is ``-mean_i A_i grad lp_i``: flow matching weighted by the advantage.

The formulas follow ``advantage_weighted_matching/scripts/train_sd3_awm.py`` at
scxue/advantage_weighted_matching@be51372 (``compute_log_prob_awm`` L210-252: the matching log-probability in float64
and its weightings; L1292-1352: the advantage clip and scale, the ratio (``loss_type='exp_first'``, one ratio per
timestep, the authors' every config), the clipped loss and the two KL terms; L1138-1205: the timesteps) and
Flow-Factory's ``src/flow_factory/trainers/awm.py`` (``compute_weighted_log_prob``, ``optimize``) at
X-GenGroup/Flow-Factory@a0b2bc5. The noise ``eps`` is the caller's: both draw a fresh one per image and timestep.
The ``ema`` velocity is the authors' second LoRA adapter, ``old <- d old + (1 - d) current`` with
``d = min(kl_ema_decay, 0.001 global_step)`` after each rollout's update (:func:`linear_ramp_decay`, L1409-1418).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
"""The matching log-probability's weightings (the authors' ``train.weighting``: 'Uniform', 't', 't**2', 'huber',
'ghuber'; their configs use 'ghuber')."""

AWM_TIMESTEP_STRATEGIES = ("discrete", "discrete_with_init", "discrete_wo_init")
"""The authors' discrete ``time_type``s: stratified rollout-step indices from 0, from 1 with step 0 forced, or
from 1 (train_sd3_awm.py L1172-1205)."""

_MATCHING_FLOOR = 1e-10
"""The authors' offset inside the (generalised) Huber root, which keeps its gradient finite at a zero error."""


def linear_ramp_decay(global_step: int, ceiling: float, rate: float = 0.001) -> float:
    """``min(ceiling, rate * global_step)``: the decay of a reference that follows the trained weights by
    ``ref <- decay * ref + (1 - decay) * current`` (AWM's KL-EMA adapter, ``kl_ema_decay_type='linear'``,
    train_sd3_awm.py L1409-1418; DGPO's old policy, train_sd3_dgpo.py L1176). 0 at step 0: the reference is then
    the current weights."""
    if global_step < 0:
        raise ValueError(f"global_step must be >= 0, got {global_step}.")
    if not 0.0 <= ceiling < 1.0:
        raise ValueError(f"ceiling must be in [0, 1), got {ceiling!r}.")
    return min(ceiling, rate * global_step)


def awm_train_timestep_indices(
    num_inference_steps: int,
    num_train_timesteps: int,
    timestep_fraction: float,
    strategy: str = "discrete",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The rollout-step indices AWM trains on, one per stratum, the same for every image of a micro-batch.

    The candidate indices run from ``start`` (0, or 1 for ``discrete_wo_init``) to ``int(num_inference_steps *
    timestep_fraction)``, cut into ``num_train_timesteps`` strata ``[lower_k, upper_k)`` (``linspace``, truncated to
    integers); one index is drawn uniformly in each (``lower_k`` where the stratum is empty). ``discrete_with_init``
    forces index 0 first and stratifies the rest from 1 (train_sd3_awm.py L1172-1205; Flow-Factory's
    ``TimeSampler.discrete`` maps its ``timestep_range`` to the same strata)."""
    if strategy not in AWM_TIMESTEP_STRATEGIES:
        raise ValueError(f"strategy must be one of {AWM_TIMESTEP_STRATEGIES}, got {strategy!r}.")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}.")
    last = int(num_inference_steps * timestep_fraction)
    start = 0 if strategy == "discrete" else 1
    forced = strategy == "discrete_with_init"
    drawn = num_train_timesteps - 1 if forced else num_train_timesteps
    if drawn and last - start < drawn:
        raise ValueError(
            f"num_train_timesteps={num_train_timesteps} strata do not fit the rollout indices [{start}, {last}) "
            f"(num_inference_steps={num_inference_steps}, timestep_fraction={timestep_fraction}): raise "
            "timestep_fraction or lower num_train_timesteps."
        )
    boundaries = torch.linspace(start, last, drawn + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    draws = torch.rand(drawn, generator=generator)
    indices = lower + (draws * (upper - lower)).long()
    return torch.cat([torch.zeros(1, dtype=torch.long), indices]) if forced else indices


def matching_log_prob(
    velocity: torch.Tensor,
    target: torch.Tensor,
    t: torch.Tensor,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
) -> torch.Tensor:
    """AWM's per-sample "log-probability": minus the weighted flow-matching error, in float64 (``(B,)``).

    ``t`` is the noise level sigma in [0, 1] per sample; ``target`` the conditional velocity ``eps - x0``."""
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"awm_weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}.")
    dims = tuple(range(1, velocity.ndim))
    mse = ((velocity.double() - target.double()) ** 2).mean(dim=dims)
    t = t.double().reshape(-1)
    if weighting == "uniform":
        return -mse
    if weighting == "t":
        return -mse * t
    if weighting == "t2":
        return -mse * t**2
    if weighting == "huber":
        return -(torch.sqrt(mse + _MATCHING_FLOOR) - 1e-5) * t
    if ghuber_power <= 0:
        raise ValueError(f"awm_ghuber_power must be > 0, got {ghuber_power!r}.")
    floor = torch.tensor(_MATCHING_FLOOR, dtype=mse.dtype, device=mse.device)
    return -((mse + floor) ** ghuber_power - floor**ghuber_power) * t / ghuber_power


@dataclass
class AWMLossOutput:
    """One timestep's AWM loss and its diagnostics (detached), averaged over the batch."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ema_kl: torch.Tensor
    ratio: torch.Tensor
    clip_fraction: torch.Tensor
    log_prob: torch.Tensor


def _mean_squared(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over the latent dims of ``(a - b)^2``, then the batch mean."""
    return ((a - b) ** 2).mean(dim=tuple(range(1, a.ndim))).mean()


def awm_loss(
    velocity: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_velocity: torch.Tensor | None = None,
    clip_range: float = 1.0,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
    advantage_max: float | None = 1.0,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    ref_velocity: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    ema_velocity: torch.Tensor | None = None,
    ema_kl_beta: float = 0.0,
) -> AWMLossOutput:
    """The advantage weighted matching loss of one timestep of a batch (formula in the module docstring).

    Args:
        velocity: the trained policy's ``v_theta(x_t, t)`` (with graph), ``(B, ...)``, at
            ``x_t = (1 - t) x0 + t noise``.
        x0: the rollout's clean latents; ``noise`` the forward noise of this timestep (fresh per timestep in AWM).
        t: the noise level sigma per sample, ``(B,)`` (the scheduler timestep / 1000).
        advantages: the per-sample advantages (normalised by the caller; clipped and scaled here).
        old_velocity: the old (sampling) policy's velocity at the same input. None: the trained policy's own, detached
            (the authors' on-policy update, ratio 1 in value).
        clip_range, clip_range_high: the ratio's clip ``[1 - clip_range, 1 + clip_range_high]`` (high defaults to
            the low one; the authors use 1).
        adv_clip_max: advantages are clipped to ``±adv_clip_max``; ``advantage_max`` then rescales them to
            ``±advantage_max`` (the authors' ``train.advantage_max = 1``; None keeps the clipped values, as
            Flow-Factory).
        weighting, ghuber_power: the matching log-probability's weighting (:func:`matching_log_prob`).
        ref_velocity, kl_beta: the reference (base) model's velocity and the KL coefficient (the authors' ``beta``).
        ema_velocity, ema_kl_beta: the KL-EMA reference's velocity and its coefficient (the authors' ``ema_beta``).
    """
    if velocity.shape != x0.shape or noise.shape != x0.shape:
        raise ValueError(f"velocity {tuple(velocity.shape)}, x0 and noise must share one shape {tuple(x0.shape)}.")
    if advantages.shape != (x0.shape[0],) or t.reshape(-1).shape != (x0.shape[0],):
        raise ValueError(f"advantages and t must be (B,) = ({x0.shape[0]},), one per sample.")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max!r}.")
    if kl_beta > 0 and ref_velocity is None:
        raise ValueError("kl_beta > 0 needs ref_velocity, the reference model's velocity at the same input.")
    if ema_kl_beta > 0 and ema_velocity is None:
        raise ValueError("ema_kl_beta > 0 needs ema_velocity, the KL-EMA reference's velocity at the same input.")
    high = clip_range if clip_range_high is None else clip_range_high
    target = noise - x0
    log_prob = matching_log_prob(velocity, target, t, weighting, ghuber_power)
    with torch.no_grad():
        old = velocity if old_velocity is None else old_velocity
        old_log_prob = matching_log_prob(old.detach(), target, t, weighting, ghuber_power)
    ratio = torch.exp(log_prob - old_log_prob)
    adv = advantages.double().clamp(-adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        adv = adv / adv_clip_max * advantage_max
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + high)
    policy_loss = torch.maximum(unclipped, clipped).mean().to(velocity.dtype)
    zero = torch.zeros((), device=velocity.device, dtype=velocity.dtype)
    kl = _mean_squared(velocity, ref_velocity.detach()) if ref_velocity is not None else zero
    ema_kl = _mean_squared(velocity, ema_velocity.detach()) if ema_velocity is not None else zero
    loss = policy_loss + kl_beta * kl + ema_kl_beta * ema_kl
    with torch.no_grad():
        clip_fraction = ((ratio > 1.0 + high) | (ratio < 1.0 - clip_range)).double().mean()
    return AWMLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        kl=kl.detach(),
        ema_kl=ema_kl.detach(),
        ratio=ratio.detach().mean(),
        clip_fraction=clip_fraction,
        log_prob=log_prob.detach().mean(),
    )
