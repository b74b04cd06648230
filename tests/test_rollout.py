"""The shared sampling loop (`trl_jagg.models.rollout`) and the SDE window (`trl_jagg.core.sde_window`): a group's shared
deterministic prefix runs once per group and gives the unshared rollout's trajectories; MixGRPO's sliding window;
the ODE outside it on fewer steps with a higher-order solver, checked against the exact solution of a Gaussian flow."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from diffusers import FluxPipeline

from trl_jagg import DDPOJaggTrainer
from trl_jagg.core.sde_window import compressed_path, path_schedule, sde_window
from trl_jagg.models import Conditioning, load_adapter
from trl_jagg.models.rollout import sample_trajectories
from trl_jagg.recipes import get_recipe
from trl_jagg.trainer.generation import rollout_window

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


# ---------------------------------------------------------------- mixed ODE-SDE rollout (MixGRPO)
class MixGRPOStates:
    """MixGRPO's GRPOTrainingStates as MixGRPO-Flash runs it (grpo_states.py@e5cdd6a, read and written out here):
    ``sample_strategy="progressive"`` with ``prog_overlap`` and ``roll_back``, ``cur_timestep`` starting at 0."""

    def __init__(self, iters_per_group: int, group_size: int, max_timesteps: int, prog_overlap_step: int):
        self.iters_per_group, self.group_size = iters_per_group, group_size
        self.max_timesteps, self.prog_overlap_step = max_timesteps, prog_overlap_step
        self.cur_timestep = self.cur_iter_in_group = 0

    def get_current_timesteps(self) -> list[int]:
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))

    def update_iteration(self) -> None:
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.prog_overlap_step
        if self.cur_timestep > self.max_timesteps:  # roll_back_start
            self.cur_timestep = self.cur_iter_in_group = 0


def mixgrpo_windows(rollouts: int, *, sampling_steps: int, **states: int) -> list[list[int]]:
    """The trained timesteps of each of MixGRPO's first ``rollouts`` rollouts: its training loop takes the current
    ones, then calls ``update_iteration`` once, before each ``train_one_step`` (train_grpo_flux.py L916-951)."""
    grpo_states = MixGRPOStates(max_timesteps=sampling_steps - 2, **states)
    windows = []
    for _ in range(rollouts):
        windows.append(grpo_states.get_current_timesteps())
        grpo_states.update_iteration()
    return windows


def test_mixgrpo_flux_window_is_mixgrpo_flashs_at_every_rollout():
    """The mixgrpo-flux preset's window at each of MixGRPO-Flash's 300 rollouts (--max_train_steps 300, each one
    train_one_step: 12 samples, 4 optimizer steps) is the one MixGRPO's counters hold at that rollout; and so on for
    every non-empty window of MixGRPO's whole slide (its start 23 has an empty one, which the preset skips)."""
    preset = get_recipe("mixgrpo-flux").config
    optimizer_steps_per_rollout = preset["steps_per_generation"] // preset["gradient_accumulation_steps"]
    assert optimizer_steps_per_rollout == 4
    args = SimpleNamespace(objective="grpo", seed=0, **preset)
    # finetune_flux_grpo_MixGRPO_Flash.sh: sampling_steps 25, iters_per_group 20, group_size 4, prog_overlap_step 1.
    expected = mixgrpo_windows(480, sampling_steps=25, iters_per_group=20, group_size=4, prog_overlap_step=1)
    windows = [rollout_window(args, optimizer_steps_per_rollout * r, r) for r in range(480)]
    assert windows[:300] == expected[:300]
    assert expected[299] == [14, 15, 16, 17] and expected[300] == [15, 16, 17, 18]  # never rolled back in 300
    first_empty = expected.index([])
    assert first_empty == 460 and expected[459] == [22]
    assert windows[:first_empty] == expected[:first_empty]
    assert windows[first_empty] == [0, 1, 2, 3]  # rolled back instead of the empty window
    # The counter is the rollout, not the optimizer step: the old per-optimizer-step window moved at rollout 5.
    assert windows[5] == [0, 1, 2, 3] != rollout_window(args, 5, 4 * 5)


@pytest.mark.parametrize(("stride", "shift_interval", "num_steps"), [(1, 3, 10), (2, 2, 10), (3, 1, 11), (1, 1, 6)])
def test_progressive_window_follows_mixgrpo_training_states(stride, shift_interval, num_steps):
    """Every rollout's window equals the one MixGRPO's GRPOTrainingStates holds at that rollout, over whole
    slides: windows cut at max_timesteps = num_steps - 2 included, up to MixGRPO's first empty window (when its
    last start is max_timesteps itself), after which this slide has already rolled back."""
    size, rollouts = 4, 60
    expected = mixgrpo_windows(
        rollouts, sampling_steps=num_steps, iters_per_group=shift_interval, group_size=size, prog_overlap_step=stride
    )
    stop = expected.index([]) if [] in expected else rollouts
    for rollout in range(stop):
        window = sde_window(
            "progressive", num_steps=num_steps, size=size, rollout=rollout, stride=stride,
            shift_interval=shift_interval,
        )  # fmt: skip
        assert window == expected[rollout], rollout
    assert any(len(w) < size for w in expected[:stop])  # the cut windows were compared


def test_trainer_places_the_window_by_its_rollout_count():
    """The trainer hands the rollout its number in the run: micro-batches consumed (restored from grpo_state.json
    on resume) over the micro-batches of a rollout, not the optimizer step."""
    seen = []
    trainer = SimpleNamespace(
        update_stage=SimpleNamespace(before_rollout=lambda step: None, sampling_weights=contextlib.nullcontext),
        _step=2 * 6 * 3, state=SimpleNamespace(global_step=2 * 6 * 3 // 2),
        args=SimpleNamespace(steps_per_generation=6, num_iterations=3),
        accelerator=SimpleNamespace(unwrap_model=lambda model: model), model=None, _stop_after_reward_failure=None,
        generation=SimpleNamespace(generate=lambda inputs, transformer, **kwargs: seen.append(kwargs)),
    )  # fmt: skip
    DDPOJaggTrainer._generate_and_score(trainer, [])
    assert seen[0]["rollout"] == 2 and seen[0]["global_step"] == 18


def test_mixgrpo_flash_ode_steps_after_the_window():
    """After each window of the 300 rollouts, as many ODE steps as MixGRPO-Flash's run_sample_step takes
    (dpm_apply_strategy 'post', dpm_post_compress_ratio 0.4; sampling_utils.py L33-53: its sigma schedule of 26
    points cut after the window's last step and continued by int(max(points left x 0.4, 1)) new points): 7 after a
    window on steps 0-3, 11 backbone calls a rollout."""
    num_steps, ratio = 25, get_recipe("mixgrpo-flux").config["ode_step_ratio"]
    for window in map(list, dict.fromkeys(map(tuple, mixgrpo_windows(300, sampling_steps=25, iters_per_group=20,
                                                                       group_size=4, prog_overlap_step=1)))):  # fmt: skip
        schedule_points = num_steps + 1
        last_false_index = window[-1]
        num_post_steps = int(max((schedule_points - 1 - last_false_index) * ratio, 1))
        path = compressed_path(num_steps, window, ratio, mixgrpo_post=True)
        after = path[path.index(window[-1]) + 1 :]  # the window's end, then the ODE points, then the last sigma
        assert len(after) - 1 == num_post_steps - 1, window
        if window == [0, 1, 2, 3]:
            assert len(path) - 1 == 11
    # Without MixGRPO's count, the project's round(0.4 x 21) = 8 after steps 0-3 (jagg-fast-flux's fixed window).
    assert len(compressed_path(num_steps, [0, 1, 2, 3], ratio)) - 1 == 12


@pytest.mark.parametrize(
    ("schedule", "max_start", "window_at"),
    [
        # Held on the high-noise steps: the same start at every rollout, 0 unless set.
        ("fixed", None, lambda rollout: [0, 1, 2, 3]),
        ("fixed", 3, lambda rollout: [3, 4, 5, 6]),
        # MixGRPO's slide over 10 steps: starts 0..7 (the windows stop before step 8 = 10 - 2, the one at 7 is [7]),
        # a move every 5 rollouts, then back to 0.
        ("progressive", None, lambda rollout: list(range(rollout // 5 % 8, min(rollout // 5 % 8 + 4, 8)))),
        # The slide limited to the first 3 starts.
        ("progressive", 2, lambda rollout: list(range(rollout // 5 % 3, rollout // 5 % 3 + 4))),
    ],
)
def test_window_positions_over_rollouts(schedule, max_start, window_at):
    for rollout in range(60):
        window = sde_window(
            schedule, num_steps=10, size=4, max_start=max_start, rollout=rollout, shift_interval=5, seed=rollout
        )
        assert window == window_at(rollout), rollout
    with pytest.raises(ValueError, match="max_start"):
        sde_window("fixed", num_steps=10, size=4, max_start=7)
    with pytest.raises(ValueError, match="max_start"):
        sde_window("progressive", num_steps=10, size=4, max_start=8)  # an empty window


def test_random_window_is_seeded_and_inside_its_range():
    windows = {tuple(sde_window("random", num_steps=10, size=3, max_start=4, seed=seed)) for seed in range(40)}
    assert {w[0] for w in windows} == set(range(5))
    assert all(list(w) == list(range(w[0], w[0] + 3)) for w in windows)
    assert sde_window("random", num_steps=10, size=3, seed=5) == sde_window("random", num_steps=10, size=3, seed=5)
    with pytest.raises(ValueError, match="max_start"):
        sde_window("random", num_steps=10, size=3, max_start=8)
    with pytest.raises(ValueError, match="schedule"):
        sde_window("sliding", num_steps=10, size=3)


def test_compressed_path_keeps_the_window_and_thins_each_side():
    assert compressed_path(16, [3, 4, 5, 6], 1.0) == list(range(17))
    # 3 steps before the window -> round(1.2) = 1; 9 after -> round(3.6) = 4, spread over 7..15.
    assert compressed_path(16, [3, 4, 5, 6], 0.4) == [0, 3, 4, 5, 6, 7, 9, 11, 13, 16]
    assert compressed_path(8, [0, 1], 0.1) == [0, 1, 2, 8]


def test_first_order_full_count_mixed_rollout_is_todays_rollout(flux):
    """Euler outside the window on every step of the schedule: bit-identical to the rollout with that window (the
    same operations in the same order; exactness is the property)."""
    cond, noise, _ = group_batch(flux)
    window = sde_window("progressive", num_steps=NUM_STEPS, size=2, rollout=1, shift_interval=1)
    sigmas, timesteps = flux.schedule(NUM_STEPS, 32, 32)
    path_sigmas, path_timesteps, stochastic = path_schedule(
        sigmas, timesteps, compressed_path(NUM_STEPS, window, 1.0), window
    )
    assert stochastic == window == [1, 2]
    kwargs = dict(sampler="sde", noise_level=0.9, guidance_scale=3.5, true_cfg_scale=1.0, record_velocities=True)
    expected = sample_trajectories(
        flux, cond, noise, sigmas, timesteps, stochastic_steps=window, generator=torch.Generator().manual_seed(7),
        **kwargs,
    )  # fmt: skip
    mixed = sample_trajectories(
        flux, cond, noise, path_sigmas, path_timesteps, stochastic_steps=stochastic, ode_solver_order=1,
        generator=torch.Generator().manual_seed(7), **kwargs,
    )  # fmt: skip
    for name in ("latents", "log_probs", "velocities", "sigmas", "timesteps"):
        assert torch.equal(getattr(mixed, name), getattr(expected, name)), name


class GaussianFlow:
    """A stand-in adapter whose backbone is the exact velocity field of data ``x0 ~ N(m, s^2)`` (per dimension):
    ``x_sigma = (1 - sigma) x0 + sigma eps`` is transported by ``x(sigma) = (1 - sigma) m + std(sigma) z`` with
    ``std^2 = (1 - sigma)^2 s^2 + sigma^2``, whose derivative gives
    ``v(x, sigma) = -m + (sigma - (1 - sigma) s^2) / std^2 (x - (1 - sigma) m)``: the ODE and its exact solution."""

    transformer = torch.nn.Identity()

    def __init__(self, m: torch.Tensor, s: torch.Tensor):
        self.m, self.s = m.double(), s.double()

    def predict_velocity(self, transformer, latents, timestep, cond, **guidance):
        sigma = (timestep.double() / 1000).view(-1, 1)
        var = (1 - sigma) ** 2 * self.s**2 + sigma**2
        return -self.m + (sigma - (1 - sigma) * self.s**2) / var * (latents.double() - (1 - sigma) * self.m)

    def solution(self, z: torch.Tensor, sigma: float) -> torch.Tensor:
        return (1 - sigma) * self.m + ((1 - sigma) ** 2 * self.s**2 + sigma**2) ** 0.5 * z.double()


@pytest.mark.parametrize("order", [1, 2, 3])
def test_ode_solver_converges_to_the_exact_solution_at_its_order(order):
    """Halving the step size divides the error against the exact solution by about 2^order (Euler for order 1,
    diffusers' DPM-Solver++ for 2 and 3), on a segment between two noise levels like an ODE run before a window."""
    generator = torch.Generator().manual_seed(0)
    flow = GaussianFlow(torch.randn(1, 8, generator=generator), 0.5 + 0.5 * torch.rand(1, 8, generator=generator))
    z = torch.randn(4, 8, generator=generator)
    errors = []
    for num_steps in (16, 32, 64):
        sigmas = torch.linspace(0.9, 0.1, num_steps + 1)
        trajectory = sample_trajectories(
            flow, Conditioning({}), flow.solution(z, float(sigmas[0])).float(), sigmas, sigmas[:-1] * 1000,
            sampler="ode", noise_level=0.0, guidance_scale=1.0, true_cfg_scale=1.0, ode_solver_order=order,
        )  # fmt: skip
        errors.append((trajectory.latents[:, -1] - flow.solution(z, float(sigmas[-1]))).abs().max().item())
    # The observed order log2(error(h) / error(h / 2)) within 0.5 of the solver's (multistep warm-up steps are of lower
    # order, so order 3 approaches 3 from below: 2.7 here).
    for coarse, fine in zip(errors, errors[1:]):
        assert abs(math.log2(coarse / fine) - order) < 0.5, errors
