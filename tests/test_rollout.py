"""The shared sampling loop (`trl_jagg.rollout`): a group's shared deterministic prefix runs once per group and gives
the unshared rollout's trajectories."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from trl_jagg.models import load_adapter
from trl_jagg.rollout import sample_trajectories

GROUP_SIZE, NUM_STEPS = 3, 5
PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def flux(tiny_flux_path):
    return load_adapter(FluxPipeline.from_pretrained(tiny_flux_path))


def group_batch(adapter, seed: int = 0):
    """Two GRPO groups of three rows: each group's prompt and initial noise repeated, as `same_group_noise` draws."""
    cond = adapter.condition([p for p in PROMPTS for _ in range(GROUP_SIZE)], height=32, width=32)
    noise = adapter.prepare_latents(len(PROMPTS), 32, 32, torch.Generator().manual_seed(seed))
    groups = torch.arange(len(PROMPTS)).repeat_interleave(GROUP_SIZE)
    return cond, noise[groups], groups


def rollout(adapter, cond, noise, *, groups=None, stochastic_steps=None, sampler="sde"):
    """The rollout with a fresh seeded generator, and the rows of every backbone call (forward pre-hook)."""
    rows = []
    hook = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    sigmas, timesteps = adapter.schedule(NUM_STEPS, 32, 32)
    try:
        trajectory = sample_trajectories(
            adapter, cond, noise, sigmas, timesteps, sampler=sampler, noise_level=0.9, guidance_scale=3.5,
            true_cfg_scale=1.0, stochastic_steps=stochastic_steps, generator=torch.Generator().manual_seed(7),
            record_velocities=True, noise_groups=groups,
        )  # fmt: skip
    finally:
        hook.remove()
    return trajectory, rows


@pytest.mark.parametrize(
    ("stochastic_steps", "sampler", "prefix"),
    [([2, 3], "sde", 2), ([0, 1], "sde", 0), (None, "ode", NUM_STEPS)],
    ids=["window-at-2", "window-at-0", "all-ode"],
)
def test_shared_prefix_equals_the_unshared_rollout_with_fewer_backbone_rows(flux, stochastic_steps, sampler, prefix):
    cond, noise, groups = group_batch(flux)
    expected, rows = rollout(flux, cond, noise, stochastic_steps=stochastic_steps, sampler=sampler)
    shared, shared_rows = rollout(flux, cond, noise, groups=groups, stochastic_steps=stochastic_steps, sampler=sampler)
    # The prefix runs on one row per group: (G - 1) rows fewer per group and prefix step.
    assert sum(rows) == len(groups) * NUM_STEPS
    assert sum(rows) - sum(shared_rows) == len(PROMPTS) * (GROUP_SIZE - 1) * prefix
    # Same noise draws (the prefix draws none) and the same steps; a smaller backbone batch rounds apart (CPU
    # float32: up to 5e-7, not bit-identical), so within 1e-6.
    for name in ("latents", "log_probs", "velocities"):
        torch.testing.assert_close(getattr(shared, name), getattr(expected, name), atol=1e-6, rtol=1e-6, msg=name)
    # The groups did branch at the first stochastic step: the rows of a group differ from there on.
    if prefix < NUM_STEPS:
        assert not torch.equal(shared.latents[0, prefix + 1], shared.latents[1, prefix + 1])
    assert torch.equal(shared.latents[0, : prefix + 1], shared.latents[1, : prefix + 1])


def test_noise_groups_must_share_noise_and_conditioning(flux):
    cond, noise, groups = group_batch(flux)
    with pytest.raises(ValueError, match="one group per row"):
        rollout(flux, cond, noise, groups=groups[:-1], stochastic_steps=[2])
    other_noise = noise.clone()
    other_noise[1] += 1
    with pytest.raises(ValueError, match="different `noise`"):
        rollout(flux, cond, other_noise, groups=groups, stochastic_steps=[2])
    with pytest.raises(ValueError, match="different `prompt_embeds`"):
        rollout(flux, cond, noise[:1].expand_as(noise), groups=torch.zeros_like(groups), stochastic_steps=[2])
