"""Stochastic flow-matching samplers with exact Gaussian log-probabilities (pure torch).

Flow time ``sigma`` runs from 1 (noise) to 0 (data) and one step moves a latent ``x`` from ``sigma`` to
``sigma_next < sigma`` using the backbone's velocity ``v``. Every sampler returns the next latent, its
log-probability under the step's Gaussian (averaged over latent dimensions, as Flow-GRPO and DanceGRPO do,
which is why their PPO clip ranges are tiny), and the Gaussian's mean and std.

All arithmetic is done in float32 whatever the model dtype, so that log-probability ratios of 1 are exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAMPLERS = ("sde", "cps", "dance", "ode")


@dataclass
class StepOutput:
    """Result of one sampler step.

    Attributes:
        prev_sample: the latent at ``sigma_next`` (sampled, or the one that was scored).
        log_prob: ``(batch,)`` log-density of ``prev_sample``, averaged over latent dimensions. CPS uses the
            negative squared error without the Gaussian constants (as Flow-GRPO does); the ODE step has none
            and returns zeros.
        mean: the Gaussian's mean, shaped like the latent.
        std: the Gaussian's std, broadcastable to the latent (``(batch, 1, ..., 1)``).
        noise_scale: what Flow-GRPO's sampler returns as ``std_dev_t`` (its KL divides by it): the diffusion
            coefficient ``g`` of the SDE for ``sde`` and ``dance`` (``std = g sqrt(|dt|)``; ``g = eta`` for
            ``dance``), the step's std itself for ``cps``; zeros for the ODE step. Shaped like ``std``.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    noise_scale: torch.Tensor


def _per_sample(value: float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """Broadcast a scalar or ``(batch,)`` value to ``(batch, 1, ..., 1)`` in float32."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    if value.ndim != 1 or value.shape[0] != like.shape[0]:
        raise ValueError(f"`{name}` must be a scalar or have shape ({like.shape[0]},), got {tuple(value.shape)}.")
    return value.view(-1, *([1] * (like.ndim - 1)))


def _mean_over_latent_dims(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``x`` under ``N(mean, std^2)``, averaged over all but the batch dimension."""
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return _mean_over_latent_dims(log_density)


def sampler_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    sampler: str = "sde",
    noise_level: float = 0.7,
    sigma_max: float | torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> StepOutput:
    """One step of a flow-matching sampler, with the log-probability of the next latent.

    Args:
        velocity: backbone output ``v`` at ``(sample, sigma)``, any latent rank ``(batch, ...)``.
        sample: current latent ``x_sigma``.
        sigma: current flow time, a float or a ``(batch,)`` tensor.
        sigma_next: next flow time (smaller than ``sigma``), a float or ``(batch,)``.
        sampler: ``"sde"`` (Flow-GRPO), ``"cps"`` (coefficient-preserving), ``"dance"`` (DanceGRPO, constant
            eta) or ``"ode"`` (deterministic Euler step).
        noise_level: ``a`` for ``sde`` and ``cps``, ``eta`` for ``dance``; ignored by ``ode``. ``0`` turns any
            sampler into the Euler step.
        sigma_max: for ``sde``, the value that replaces ``sigma`` in ``1 - sigma`` when ``sigma == 1`` (Flow-GRPO
            uses ``sigmas[1]``, the schedule's second value). Defaults to ``sigma_next``, which equals
            ``sigmas[1]`` on the first step.
        prev_sample: a given next latent to score instead of sampling one (the PPO update path).
        generator: random generator for the sampled noise.

    Returns:
        A :class:`StepOutput` in float32.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"`sampler` must be one of {SAMPLERS}, got {sampler!r}.")
    if velocity.shape != sample.shape:
        raise ValueError(
            f"`velocity` and `sample` must have the same shape, got {tuple(velocity.shape)} and {tuple(sample.shape)}."
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"`prev_sample` must have the shape of `sample` {tuple(sample.shape)}, got {tuple(prev_sample.shape)}."
        )
    x = sample.float()
    v = velocity.float()
    s = _per_sample(sigma, x, "sigma")
    s_next = _per_sample(sigma_next, x, "sigma_next")
    dt = s_next - s  # negative

    if sampler == "ode" or noise_level == 0:
        mean = x + v * dt
        std = torch.zeros_like(s)
        log_prob = torch.zeros(x.shape[0], device=x.device)
        return StepOutput(mean if prev_sample is None else prev_sample.float(), log_prob, mean, std, std)

    if sampler == "sde":
        s_max = _per_sample(sigma_next if sigma_max is None else sigma_max, x, "sigma_max")
        # At sigma = 1 the SDE coefficient sqrt(sigma / (1 - sigma)) is infinite; Flow-GRPO substitutes sigmas[1].
        s_tilde = torch.where(s == 1, s_max, s)
        g = noise_level * torch.sqrt(s / (1 - s_tilde))
        mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
        std = g * torch.sqrt(-dt)
        noise_scale = g
    elif sampler == "dance":
        # Euler step plus the score correction -eta^2/2 * score * dt, score from the predicted x0.
        x0 = x - s * v
        score = -(x - x0 * (1 - s)) / s**2
        mean = x + v * dt - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)
        noise_scale = torch.full_like(std, noise_level)
    else:  # cps
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        noise = x + (1 - s) * v
        mean = x0 * (1 - s_next) + noise * torch.sqrt(s_next**2 - std**2)
        noise_scale = std

    if prev_sample is None:
        noise_draw = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        next_sample = mean + std * noise_draw
    else:
        next_sample = prev_sample.float()

    if sampler == "cps":
        # Coefficient-preserving sampling scores with the squared error only (no 1/std^2, no constants).
        log_prob = _mean_over_latent_dims(-((next_sample.detach() - mean) ** 2))
    else:
        log_prob = gaussian_log_prob(next_sample.detach(), mean, std)
    return StepOutput(next_sample, log_prob, mean, std, noise_scale)
