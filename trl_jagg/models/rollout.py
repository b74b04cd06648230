"""The shared sampling loop: one implementation for every model family, driven by its adapter."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from diffusers import DPMSolverMultistepScheduler

from trl_jagg.core.sampling import sampler_step
from trl_jagg.models.base import Conditioning, FlowMatchingAdapter


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
        predicted_x0: ``(batch, *latent_shape)`` float32, the last step's prediction of the clean latent,
            ``z - sigma v`` at its start (what DanceGRPO decodes for the reward).
        call_shapes: the shape of the latents each step's backbone call ran on (fewer rows in a shared prefix):
            another batch shape may round differently, so a recorded velocity is exact only at its own.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    velocities: torch.Tensor | None = None
    predicted_x0: torch.Tensor | None = None
    call_shapes: tuple[tuple[int, ...], ...] = ()


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
    noise_groups: Sequence[int] | torch.Tensor | None = None,
    ode_solver_order: int = 1,
) -> Trajectory:
    """Run the full denoising loop from ``noise`` and record every latent and transition log-prob.

    Args:
        stochastic_steps: steps sampled with ``sampler``; the others take the deterministic ODE step
            (Flow-GRPO-Fast's SDE window). ``None`` makes every step stochastic.
        transformer: the backbone to call (defaults to the pipeline's).
        record_velocities: keep every step's guided velocity in :attr:`Trajectory.velocities`.
        noise_groups: ``(batch,)`` group of each row: rows of one group start from the same noise with the same
            conditioning (a GRPO group under ``same_group_noise``). The deterministic steps before the first
            stochastic one are then identical within a group, so they run once per group (one row each) and the
            trajectories branch at the first stochastic step; the result is the unshared rollout's up to the
            rounding of a smaller backbone batch. Checked: rows that differ raise a ``ValueError``.
        ode_solver_order: the solver of the deterministic steps: 1 is the Euler step of ``sampler_step``; 2 or 3 is
            diffusers' multistep DPM-Solver++ (``DPMSolverMultistepScheduler`` with flow sigmas and flow
            prediction), restarted on every run of consecutive deterministic steps: MixGRPO-Flash's ODE outside the
            SDE window, accurate on the few large steps of a compressed schedule (``sde_window.compressed_path``).
    """
    if ode_solver_order not in (1, 2, 3):
        raise ValueError(f"`ode_solver_order` must be 1 (Euler), 2 or 3 (DPM-Solver++), got {ode_solver_order}.")
    transformer = transformer if transformer is not None else adapter.transformer
    num_steps = len(timesteps)

    def is_stochastic(k: int) -> bool:
        return sampler != "ode" and noise_level != 0 and (stochastic_steps is None or k in stochastic_steps)

    prefix = next((k for k in range(num_steps) if is_stochastic(k)), num_steps)
    branch = _group_rows(noise, cond, noise_groups) if noise_groups is not None and prefix > 0 else None
    full_cond = cond
    if branch is not None:  # the shared prefix runs on one row per group
        first, inverse = branch
        noise, cond = noise[first], cond.select(first)
    latents = [noise.float()]
    log_probs = []
    velocities = []
    call_shapes = []
    solver = None
    for k in range(num_steps):
        if branch is not None and k == prefix:  # every row continues from its group's state
            latents, log_probs, velocities = ([x[inverse] for x in xs] for xs in (latents, log_probs, velocities))
            cond = full_cond
        t = timesteps[k].expand(latents[-1].shape[0])
        call_shapes.append(tuple(latents[-1].shape))
        velocity = adapter.predict_velocity(
            transformer, latents[-1], t, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale
        )
        if record_velocities:
            velocities.append(velocity)
        if is_stochastic(k) or ode_solver_order == 1:
            solver = None
            step = sampler_step(
                velocity,
                latents[-1],
                sigmas[k],
                sigmas[k + 1],
                sampler=sampler if is_stochastic(k) else "ode",
                noise_level=noise_level,
                sigma_max=sigmas[1],
                generator=generator,
            )
            latents.append(step.prev_sample)
            log_probs.append(step.log_prob)
        else:
            if solver is None:  # a run of deterministic steps begins: a fresh multistep history over its sigmas
                end = next((j for j in range(k, num_steps) if is_stochastic(j)), num_steps)
                solver = _multistep_solver(sigmas[k : end + 1], ode_solver_order)
            latents.append(solver.step(velocity.float(), timesteps[k], latents[-1], return_dict=False)[0])
            log_probs.append(torch.zeros(latents[-1].shape[0], device=latents[-1].device))
    if branch is not None and prefix == num_steps:  # fully deterministic: the groups never branched
        latents, log_probs, velocities = ([x[inverse] for x in xs] for xs in (latents, log_probs, velocities))
        velocity = velocity[inverse]
    # x0-hat of the last step: free of the noise its stochastic step adds (DanceGRPO's `pred_original_sample`).
    predicted_x0 = latents[-2] - sigmas[num_steps - 1].float() * velocity.float()
    return Trajectory(
        torch.stack(latents, dim=1),
        torch.stack(log_probs, dim=1),
        sigmas,
        timesteps,
        torch.stack(velocities, dim=1) if record_velocities else None,
        predicted_x0,
        tuple(call_shapes),
    )


def _multistep_solver(sigmas: torch.Tensor, order: int) -> DPMSolverMultistepScheduler:
    """diffusers' DPM-Solver++ of ``order`` on the flow ODE (``x0 = x - sigma v``, ``alpha = 1 - sigma``) over the
    flow times ``sigmas``: the pipeline's schedule is set on it as its sigmas (its own flow-sigma schedule would
    place the steps elsewhere), and it counts steps from the first."""
    solver = DPMSolverMultistepScheduler(
        solver_order=order,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        algorithm_type="dpmsolver++",
        # A last step to sigma = 0 must be first order (its log-SNR step is infinite); one to sigma > 0 need not.
        final_sigmas_type="zero" if sigmas[-1] == 0 else "sigma_min",
    )
    solver.set_timesteps(len(sigmas) - 1)
    solver.sigmas = sigmas.detach().float().cpu()  # where the scheduler keeps them
    solver.set_begin_index(0)
    return solver


def _group_rows(
    noise: torch.Tensor, cond: Conditioning, noise_groups: Sequence[int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first, inverse)``: the first row of each group and every row's group position, so that
    ``x[first][inverse]`` rebuilds a batch ``x`` whose rows are equal within groups; ``None`` when no two rows
    share a group (nothing to share)."""
    groups = torch.as_tensor(noise_groups, device=noise.device)
    if groups.shape != (noise.shape[0],):
        raise ValueError(
            f"`noise_groups` must give one group per row: shape ({noise.shape[0]},), got {tuple(groups.shape)}."
        )
    _, inverse = torch.unique(groups, return_inverse=True)
    if inverse.max() + 1 == len(groups):
        return None
    rows = torch.arange(len(groups), device=noise.device)
    first = torch.full((int(inverse.max()) + 1,), len(groups), device=noise.device).scatter_reduce(
        0, inverse, rows, "amin"
    )
    for name, value in {"noise": noise, **cond.per_sample}.items():
        if not torch.equal(value, value[first][inverse]):
            raise ValueError(
                f"`noise_groups` puts rows with different `{name}` in one group: a group must share its initial "
                "noise and conditioning (pass `noise_groups=None` when the samples draw their own noise)."
            )
    return first, inverse


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
