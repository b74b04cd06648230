"""The generation stage: one rollout of the current policy, scored, with its group advantages.

Sampling (SDE steps under ``no_grad``, log-probs recorded) -> decode -> rewards -> per-prompt group advantages;
the result is the rollout batch (:mod:`trl_jagg.trainer.batch`) the update stage consumes.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from ..grpo import PerPromptStatTracker, group_advantages
from ..grpo_jagg_config import GRPOJaggConfig
from ..models import FlowMatchingAdapter
from ..prompts import SOURCE_IMAGE_COLUMN, prompt_text, source_image
from ..rewards import compute_rewards
from ..rollout import Trajectory, sample_trajectories
from .batch import rng_seed, velocity_key
from .conditioning import PromptConditioner
from .guards import any_process, stop_if_non_finite
from .placement import FrozenModules, eval_mode


class RewardFailure(Exception):
    """A reward function failed on some process during a rollout; raised on every process alike, so the trainer
    can save the steps trained so far (a collective) before stopping. ``error`` is this process's own failure,
    ``None`` when another process failed."""

    def __init__(self, error: Exception | None):
        super().__init__(str(error) if error is not None else "a reward function failed on another process")
        self.error = error


def group_keys(prompts: list[str], sources: list | None) -> list[str]:
    """What identifies a sample's group for per-prompt statistics: its prompt, and for editing also its source image
    (an instruction such as "make it red" recurs over many images)."""
    if sources is None:
        return prompts
    return [f"{p}\n{hashlib.sha1(image.tobytes()).hexdigest()}" for p, image in zip(prompts, sources)]


def sde_window(args: GRPOJaggConfig, global_step: int) -> list[int] | None:
    """Flow-GRPO-Fast: the stochastic steps of the rollout at ``global_step`` (``None``: all)."""
    if args.sde_window_size == 0:
        return None
    max_start = args.sde_window_max_start
    if max_start is None:
        max_start = max(0, min(args.num_inference_steps // 2, args.num_inference_steps - args.sde_window_size))
    start = random.Random(rng_seed(args.seed, global_step, -1)).randint(0, max_start)
    return list(range(start, start + args.sde_window_size))


def scored_rewards(
    reward_funcs: Sequence[Callable[..., Any]],
    accelerator: Any,
    prompts: list[str],
    images: list,
    *,
    weights: Sequence[float] | None,
    retries: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`~trl_jagg.rewards.compute_rewards`, raising :class:`RewardFailure` on every process when it failed on
    any of them."""
    failure: Exception | None = None
    try:
        return_value = compute_rewards(reward_funcs, prompts, images, weights, retries=retries, **kwargs)
    except Exception as error:  # raised below, once every process knows
        failure = error
    if any_process(accelerator, failure is not None):
        raise RewardFailure(failure)
    return return_value


class RolloutGenerator:
    """Generates and scores rollouts; writes its metrics (means over the gathered batch) into ``metrics``.

    Args:
        adapter: the model family's adapter (sampling, decoding).
        args: the run's configuration.
        accelerator: the Trainer's accelerator (device, process index, gathers).
        reward_funcs: the loaded reward functions.
        conditioner: the prompts' conditioning.
        frozen: where the VAE runs.
        metrics: the trainer's metric lists, averaged at each log.
    """

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        reward_funcs: Sequence[Callable[..., Any]],
        conditioner: PromptConditioner,
        frozen: FrozenModules,
        metrics: dict[str, list[float]],
    ):
        self.adapter = adapter
        self.args = args
        self.accelerator = accelerator
        self.reward_funcs = reward_funcs
        self.conditioner = conditioner
        self.frozen = frozen
        self.metrics = metrics
        self.stat_tracker = (
            PerPromptStatTracker(
                args.stat_tracking_buffer_size,
                global_std=args.scale_rewards == "batch",
                eps=args.advantage_eps,
                ddof=args.advantage_std_ddof,
            )
            if args.per_prompt_stat_tracking
            else None
        )
        self.completions: tuple[list[str], list, dict[str, list[float]]] | None = None
        """The latest rollout's (prompts, images, scores) for ``log_completions``, until the trainer logs them."""

    def group_noise(self, num_samples: int, global_step: int) -> torch.Tensor:
        """Initial noise shared by each prompt group: drawn from a seed of the group's index in the global batch, so
        the processes holding parts of one group draw the same latent without communicating."""
        args = self.args
        first = self.accelerator.process_index * num_samples  # this process's rows in the gathered batch
        groups = [(first + i) // args.num_generations for i in range(num_samples)]
        noise = {}
        for group in dict.fromkeys(groups):
            generator = torch.Generator(self.accelerator.device).manual_seed(
                rng_seed(args.seed, global_step, -3, group)
            )
            noise[group] = self.adapter.prepare_latents(1, args.height, args.width, generator)
        return torch.cat([noise[group] for group in groups])

    @torch.no_grad()
    def generate(
        self, inputs: list[dict[str, Any]], transformer: torch.nn.Module, *, global_step: int, trainer_state: Any
    ) -> dict[str, Any]:
        """One scored rollout of ``inputs`` (a dataloader batch: one dict per sample) with ``transformer`` (the
        unwrapped backbone) at optimizer step ``global_step``."""
        args, adapter, device = self.args, self.adapter, self.accelerator.device
        start = time.perf_counter()
        prompts = [prompt_text(x["prompt"], "train_dataset 'prompt'") for x in inputs]
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        # Editing: each sample's source image conditions the rollout and reaches the rewards as `source_images`.
        sources = None
        if adapter.edits_images:
            where = f"train_dataset '{SOURCE_IMAGE_COLUMN}'"
            sources = [source_image(value, where) for value in columns.pop(SOURCE_IMAGE_COLUMN)]
            columns["source_images"] = sources
        record_velocities = args.use_jagg and args.jagg_cache_velocities
        with eval_mode(transformer):
            adapter.refresh_placement()  # once per rollout, in case the backbone was moved or cast
            sigmas, timesteps = adapter.schedule(args.num_inference_steps, args.height, args.width)
            if args.quantize_timesteps:
                # DanceGRPO feeds the backbone int(sigma * 1000) / 1000; the sampler keeps the exact sigmas.
                timesteps = timesteps.floor()
            stochastic_steps = sde_window(args, global_step)
            if sources is not None:  # one conditioning per sample: the same text may edit different images
                cond = self.conditioner(prompts, source_images=sources)
            else:  # encode every distinct prompt once; samples index into it
                unique = list(dict.fromkeys(prompts))
                cond = self.conditioner(unique).select(torch.tensor([unique.index(p) for p in prompts], device=device))
            generator = torch.Generator(device).manual_seed(
                rng_seed(args.seed, global_step, self.accelerator.process_index)
            )
            initial_noise = self.group_noise(len(prompts), global_step) if args.same_group_noise else None
            chunk = args.sample_batch_size or args.per_device_train_batch_size
            trajectories: list[Trajectory] = []
            images = []
            # Rollouts of a large model take minutes: a transient bar under the Trainer's own.
            chunks = tqdm(
                range(0, len(prompts), chunk),
                desc="rollout",
                leave=False,
                disable=args.disable_tqdm or not self.accelerator.is_local_main_process,
            )
            for begin in chunks:
                index = slice(begin, begin + chunk)
                if initial_noise is not None:
                    noise = initial_noise[index]
                else:
                    noise = adapter.prepare_latents(len(prompts[index]), args.height, args.width, generator)
                trajectory = sample_trajectories(
                    adapter, cond.select(index), noise, sigmas, timesteps,
                    sampler=args.sampler, noise_level=args.noise_level, guidance_scale=args.guidance_scale,
                    true_cfg_scale=args.true_cfg_scale, stochastic_steps=stochastic_steps, generator=generator,
                    transformer=transformer, record_velocities=record_velocities,
                )  # fmt: skip
                trajectories.append(trajectory)
                with self.frozen.on_accelerator(self.frozen.vae):
                    images.extend(adapter.decode(trajectory.latents[:, -1], args.height, args.width))
        rollout_seconds = time.perf_counter() - start
        latents = torch.cat([t.latents for t in trajectories])
        # NaN latents decode to black images with finite rewards: stop here, before the rewards hide them.
        stop_if_non_finite(
            self.accelerator, "latents after the rollout", latents, step=global_step + 1, run_dir=args.output_dir
        )

        start = time.perf_counter()
        rewards, per_reward = scored_rewards(
            self.reward_funcs, self.accelerator, prompts, images, weights=args.reward_weights,
            retries=args.reward_retries, trainer_state=trainer_state, **columns,
        )  # fmt: skip
        advantages = self._advantages(group_keys(prompts, sources), rewards.to(device), per_reward)
        self.metrics["latents/final_std"].append(latents[:, -1].std().item())
        self.metrics["time/rollout_s"].append(rollout_seconds)
        self.metrics["time/reward_s"].append(time.perf_counter() - start)
        if args.log_completions:
            scores = {"reward": rewards.tolist(), **{name: value.tolist() for name, value in per_reward.items()}}
            self.completions = (prompts, images, scores)
        rank = self.accelerator.process_index
        rollout = {
            "latents": latents,
            "log_probs": torch.cat([t.log_probs for t in trajectories]),
            "advantages": advantages[rank * len(prompts) : (rank + 1) * len(prompts)].to(device),
            "cond": cond,
            "sigmas": sigmas,
            # The group planner reads the flow times on the host: one transfer per rollout, not one per step.
            "sigma_values": sigmas.tolist(),
            "timesteps": timesteps,
            "stochastic_steps": stochastic_steps,
        }
        if record_velocities:
            rollout["velocities"] = torch.cat([t.velocities for t in trajectories])
            # What the cached velocities are exact for: these parameters and this forward path.
            rollout["velocity_key"] = velocity_key(global_step, adapter.dtype, device.type)
        return rollout

    def _advantages(self, keys: list[str], rewards: torch.Tensor, per_reward: dict[str, torch.Tensor]) -> torch.Tensor:
        """Group advantages of the gathered batch (every process computes all of them), and the reward metrics;
        ``keys`` (:func:`group_keys`) identify the samples' groups for the per-prompt statistics."""
        args = self.args
        per_func = torch.stack(list(per_reward.values()), dim=1).to(rewards.device)
        all_per_func = self.accelerator.gather(per_func)
        all_rewards = self.accelerator.gather(rewards)
        if self.stat_tracker is not None:
            advantages = self.stat_tracker.update(gather_object(keys), all_rewards.cpu(), clip=args.adv_clip_max)
        else:
            advantages = group_advantages(
                all_rewards,
                args.num_generations,
                scale_by=args.scale_rewards,
                clip=args.adv_clip_max,
                eps=args.advantage_eps,
                ddof=args.advantage_std_ddof,
            )
        grouped = all_rewards.view(-1, args.num_generations)
        self.metrics["reward"].append(all_rewards.mean().item())
        self.metrics["reward_std"].append(all_rewards.std().item())
        self.metrics["frac_reward_zero_std"].append((grouped.std(dim=1) < 1e-6).float().mean().item())
        for i, name in enumerate(per_reward):
            scored = all_per_func[:, i][~all_per_func[:, i].isnan()]  # None (not applicable) is NaN
            self.metrics[f"rewards/{name}/mean"].append(scored.mean().item())
            self.metrics[f"rewards/{name}/std"].append(scored.std().item())
        self.metrics["advantages/mean"].append(advantages.mean().item())
        self.metrics["advantages/abs_mean"].append(advantages.abs().mean().item())
        self.metrics["zero_advantage/frac"].append((advantages == 0).float().mean().item())
        return advantages
