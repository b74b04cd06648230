"""The shared sampling loop: one implementation for every model family, driven by its adapter."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from .models.base import Conditioning, FlowMatchingAdapter
from .sampling import sampler_step


@dataclass
class Trajectory:
    """A batch of denoising trajectories.

    Attributes:
        latents: ``(batch, num_steps + 1, *latent_shape)`` float32, from pure noise to the final latent.
        log_probs: ``(batch, num_steps)`` log-prob of each transition at sampling time (0 for ODE steps).
        sigmas: ``(num_steps + 1,)`` flow times.
        timesteps: ``(num_steps,)`` scheduler timesteps the backbone was called with.
        velocities: ``(batch, num_steps, *latent_shape)`` guided velocity of every step, in the backbone's output
            dtype, when recorded (``record_velocities``): JAGG's on-policy velocity cache.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    velocities: torch.Tensor | None = None


@torch.no_grad()
def sample_trajectories(
    adapter: FlowMatchingAdapter,
    cond: Conditioning,
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    sampler: str,
    noise_level: float,
    guidance_scale: float,
    true_cfg_scale: float,
    stochastic_steps: Collection[int] | None = None,
    generator: torch.Generator | None = None,
    transformer: torch.nn.Module | None = None,
    record_velocities: bool = False,
) -> Trajectory:
    """Run the full denoising loop from ``noise`` and record every latent and transition log-prob.

    Args:
        stochastic_steps: steps sampled with ``sampler``; the others take the deterministic ODE step
            (Flow-GRPO-Fast's SDE window). ``None`` makes every step stochastic.
        transformer: the backbone to call (defaults to the pipeline's).
        record_velocities: keep every step's guided velocity in :attr:`Trajectory.velocities`.
    """
    transformer = transformer if transformer is not None else adapter.transformer
    num_steps = len(timesteps)
    latents = [noise.float()]
    log_probs = []
    velocities = []
    for k in range(num_steps):
        t = timesteps[k].expand(noise.shape[0])
        velocity = adapter.predict_velocity(
            transformer, latents[-1], t, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale
        )
        if record_velocities:
            velocities.append(velocity)
        stochastic = stochastic_steps is None or k in stochastic_steps
        step = sampler_step(
            velocity,
            latents[-1],
            sigmas[k],
            sigmas[k + 1],
            sampler=sampler if stochastic else "ode",
            noise_level=noise_level,
            sigma_max=sigmas[1],
            generator=generator,
        )
        latents.append(step.prev_sample)
        log_probs.append(step.log_prob)
    return Trajectory(
        torch.stack(latents, dim=1),
        torch.stack(log_probs, dim=1),
        sigmas,
        timesteps,
        torch.stack(velocities, dim=1) if record_velocities else None,
    )


@torch.no_grad()
def generate_images(
    adapter: FlowMatchingAdapter,
    prompts: list[str],
    *,
    num_steps: int,
    height: int,
    width: int,
    guidance_scale: float,
    true_cfg_scale: float = 1.0,
    negative_prompt: str | None = None,
    max_sequence_length: int | None = None,
    seed: int = 0,
    source_images: Sequence | None = None,
) -> list:
    """Deterministic (ODE) images for ``prompts``: the sample images logged during training and the demo grid.
    ``source_images``: one PIL image per prompt for editing families (the image each prompt edits)."""
    generator = torch.Generator(adapter.device).manual_seed(seed)
    cond = adapter.condition(
        prompts,
        height=height,
        width=width,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
        source_images=source_images,
    )
    noise = adapter.prepare_latents(len(prompts), height, width, generator)
    sigmas, timesteps = adapter.schedule(num_steps, height, width)
    trajectory = sample_trajectories(
        adapter,
        cond,
        noise,
        sigmas,
        timesteps,
        sampler="ode",
        noise_level=0.0,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
    )
    return adapter.decode(trajectory.latents[:, -1], height, width)
