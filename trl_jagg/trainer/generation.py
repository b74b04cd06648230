"""The generation stage: one rollout of the current policy, scored, with its group advantages.

Sampling (SDE steps under ``no_grad``, log-probs recorded) -> decode -> rewards -> per-prompt group advantages;
the result is the rollout batch (:mod:`trl_jagg.trainer.batch`) the update stage consumes.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from accelerate.utils import gather_object
from PIL import Image
from tqdm.auto import tqdm

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.config.objective_registry import get_objective
from trl_jagg.core.grpo import (
    PerPromptStatTracker,
    group_advantages,
    multi_reward_advantages,
    per_reward_group_normalize,
)
from trl_jagg.core.sde_window import compressed_path, path_schedule, sde_window
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.models.rollout import Trajectory, sample_trajectories
from trl_jagg.trainer.batch import PendingAdvantages, RolloutBatch, rng_seed, velocity_key
from trl_jagg.trainer.conditioning import PromptConditioner
from trl_jagg.trainer.guards import stop_if_non_finite
from trl_jagg.trainer.placement import FrozenModules, eval_mode
from trl_jagg.trainer.reward_overlap import ChunkAdvantages, ChunkScorer
from trl_jagg.trainer.scoring import RewardFailure, scored_rewards
from trl_jagg.utils.prompts import SOURCE_IMAGE_COLUMN, prompt_text, source_images_of


def group_keys(prompts: list[str], sources: list | None) -> list[str]:
    """What identifies a sample's group for per-prompt statistics: its prompt, and for editing also its source image
    (an instruction such as "make it red" recurs over many images)."""
    if sources is None:
        return prompts
    return [f"{p}\n{_digest(images)}" for p, images in zip(prompts, sources)]


def _digest(images: Image.Image | list[Image.Image]) -> str:
    """The hash of a sample's source image(s)."""
    digest = hashlib.sha1()
    for image in images if isinstance(images, list) else [images]:
        digest.update(image.tobytes())
    return digest.hexdigest()


def advantages_per_group(args: GRPOJaggConfig) -> bool:
    """Whether the update may resolve the advantages chunk by chunk, a micro-batch waiting only for the rollout
    chunks that hold its groups (when every reward scores chunk by chunk): a group's advantages must depend on its
    own rewards only (not ``scale_rewards="batch"``'s global std, GDPO's batch normalisation of the weighted sum,
    nor ``per_prompt_stat_tracking``, which pools a prompt's samples over groups and steps), the update must ask for
    them one micro-batch at a time (``drop_zero_advantages`` reads them all when the rollout is split), and the
    rollout must end within one optimizer step, whose logs hold its reward metrics."""
    return (
        args.scale_rewards in ("group", "none")
        and not args.per_prompt_stat_tracking
        and args.multi_objective_aggregation != "normalize_then_sum"
        and not args.drop_zero_advantages
        and args.steps_per_generation == args.gradient_accumulation_steps
    )


def rollout_window(args: GRPOJaggConfig, global_step: int, rollout: int) -> list[int] | None:
    """The SDE window, in the schedule's steps, of the run's rollout number ``rollout`` (0 for the first), taken at
    optimizer step ``global_step`` (``None``: every step stochastic): Flow-GRPO-Fast's random start (drawn from
    the step) or MixGRPO's sliding one, which moves with the rollouts (:func:`trl_jagg.core.sde_window.sde_window`).
    An objective whose rollout is a deterministic ODE (DiffusionNFT) samples every step with it: an empty window."""
    if get_objective(args.objective).deterministic_rollout:
        return []
    if args.sde_window_size == 0:
        return None
    return sde_window(
        args.sde_window_schedule,
        num_steps=args.num_inference_steps,
        size=args.sde_window_size,
        max_start=args.sde_window_max_start,
        rollout=rollout,
        stride=args.sde_window_stride,
        shift_interval=args.sde_window_shift_interval,
        seed=rng_seed(args.seed, global_step, -1),
    )


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
        self.completions: tuple[list[str], list, dict[str, list[Any]]] | None = None
        """The latest rollout's (prompts, images, scores), for the reward-hacking watch and ``log_completions``, until
        the trainer logs."""

    def groups(self, num_samples: int) -> list[int]:
        """The prompt group of each of this process's ``num_samples`` rows: its index in the gathered batch."""
        first = self.accelerator.process_index * num_samples  # this process's rows in the gathered batch
        return [(first + i) // self.args.num_generations for i in range(num_samples)]

    def group_noise(self, num_samples: int, global_step: int) -> torch.Tensor:
        """Initial noise shared by each prompt group: drawn from a seed of the group's index in the global batch, so
        the processes holding parts of one group draw the same latent without communicating."""
        args = self.args
        groups = self.groups(num_samples)
        noise = {}
        for group in dict.fromkeys(groups):
            generator = torch.Generator(self.accelerator.device).manual_seed(
                rng_seed(args.seed, global_step, -3, group)
            )
            noise[group] = self.adapter.prepare_latents(1, args.height, args.width, generator)
        return torch.cat([noise[group] for group in groups])

    @torch.no_grad()
    def generate(
        self, inputs: list[dict[str, Any]], transformer: torch.nn.Module, *, global_step: int, rollout: int,
        trainer_state: Any, on_reward_failure: Callable[[RewardFailure, str], NoReturn],
    ) -> RolloutBatch:  # fmt: skip
        """One scored rollout of ``inputs`` (a dataloader batch: one dict per sample) with ``transformer`` (the
        unwrapped backbone) at optimizer step ``global_step``, the run's rollout number ``rollout`` (it places a
        ``progressive`` window). Its ``advantages`` may be a
        :class:`~trl_jagg.trainer.batch.PendingAdvantages` (``overlap_rewards``, every reward scored chunk by chunk).
        A reward failure, now or when they are resolved, calls ``on_reward_failure(failure, when)``, which saves the
        steps trained so far and raises."""
        args, adapter, device = self.args, self.adapter, self.accelerator.device
        start = time.perf_counter()
        prompts = [prompt_text(x["prompt"], "train_dataset 'prompt'") for x in inputs]
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        # Editing: each sample's source image conditions the rollout and reaches the rewards as `source_images`.
        sources = None
        if adapter.edits_images:
            where = f"train_dataset '{SOURCE_IMAGE_COLUMN}'"
            sources = [source_images_of(v, where, adapter.max_source_images) for v in columns.pop(SOURCE_IMAGE_COLUMN)]
            columns["source_images"] = sources
        # JAGG's velocity cache, and GRPO-Guard's ratio, which needs the rollout's step means (a velocity gives one).
        record_velocities = (args.use_jagg and args.jagg_cache_velocities) or args.ratio_normalization
        with eval_mode(transformer):
            adapter.refresh_placement()  # once per rollout, in case the backbone was moved or cast
            sigmas, timesteps = adapter.schedule(args.num_inference_steps, args.height, args.width)
            if args.quantize_timesteps:
                # DanceGRPO feeds the backbone int(sigma * 1000) / 1000; the sampler keeps the exact sigmas.
                timesteps = timesteps.floor()
            stochastic_steps = rollout_window(args, global_step, rollout)
            if stochastic_steps:
                # The ODE outside the window on fewer steps (ode_step_ratio; after a MixGRPO window, as many as
                # MixGRPO-Flash takes); the rollout's own schedule from here.
                path = compressed_path(
                    args.num_inference_steps, stochastic_steps, args.ode_step_ratio,
                    mixgrpo_post=args.sde_window_schedule == "progressive",
                )  # fmt: skip
                sigmas, timesteps, stochastic_steps = path_schedule(sigmas, timesteps, path, stochastic_steps)
            if sources is not None:  # one conditioning per sample: the same text may edit different images
                cond = self.conditioner(prompts, source_images=sources)
            else:  # encode every distinct prompt once; samples index into it
                unique = list(dict.fromkeys(prompts))
                cond = self.conditioner(unique).select(torch.tensor([unique.index(p) for p in prompts], device=device))
            generator = torch.Generator(device).manual_seed(
                rng_seed(args.seed, global_step, self.accelerator.process_index)
            )
            initial_noise = self.group_noise(len(prompts), global_step) if args.same_group_noise else None
            # Rows of one group share their noise and prompt: the rollout runs their deterministic prefix once.
            groups = torch.tensor(self.groups(len(prompts)), device=device) if args.same_group_noise else None
            chunk = args.sample_batch_size or args.per_device_train_batch_size
            # Videos are scored whole, after the rollout (an image reward's per-frame mean is taken there).
            overlap = args.overlap_rewards and not adapter.makes_videos
            scorer = ChunkScorer(
                self.reward_funcs, enabled=overlap, trainer_state=trainer_state, timeout=args.reward_timeout
            )
            trajectories: list[Trajectory] = []
            images, pixel_peaks = [], []
            # Rollouts of a large model take minutes: a transient bar under the Trainer's own, on a terminal only
            # (disable=None: tqdm's "off unless a TTY"; in a log file its carriage returns leave fragments).
            chunks = tqdm(
                range(0, len(prompts), chunk),
                desc="rollout",
                leave=False,
                disable=True if args.disable_tqdm or not self.accelerator.is_local_main_process else None,
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
                    noise_groups=groups[index] if groups is not None else None, ode_solver_order=args.ode_solver_order,
                )  # fmt: skip
                trajectories.append(trajectory)
                with self.frozen.on_accelerator(self.frozen.vae):
                    scored = trajectory.predicted_x0 if args.reward_on_predicted_x0 else trajectory.latents[:, -1]
                    pixels = adapter.decode_latents(scored, args.height, args.width)
                # Kept on the device (NaN if any pixel is): one check for the whole rollout below.
                pixel_peaks.append(pixels.detach().float().abs().amax())
                decoded = adapter.to_images(pixels)
                images.extend(decoded)
                scorer.submit(prompts[index], decoded, {key: values[index] for key, values in columns.items()})
        rollout_seconds = time.perf_counter() - start
        latents = torch.cat([t.latents for t in trajectories])
        # NaN latents, or a VAE that outputs NaN from finite ones, decode to black images with finite rewards: stop
        # here, before the rewards hide them.
        for quantity, value in (("latents", latents), ("decoded images (the VAE output)", torch.stack(pixel_peaks))):
            stop_if_non_finite(
                self.accelerator, f"{quantity} after the rollout", value, step=global_step + 1, run_dir=args.output_dir
            )

        self.metrics["latents/final_std"].append(latents[:, -1].std().item())
        self.metrics["time/rollout_s"].append(rollout_seconds)

        def advantages() -> torch.Tensor:
            """This process's advantages, once every reward has scored the rollout (a failure reported alike on
            every process); outside autograd wherever they are resolved (the update's loss runs with gradients;
            autocast, accelerate's, wraps only the backbone's forward)."""
            with torch.no_grad():
                try:
                    return self._score(prompts, images, columns, sources, scorer, trainer_state)
                except RewardFailure as failure:
                    on_reward_failure(failure, f"at step {global_step + 1}")

        # With every reward still scoring the last chunk in the background, the update resolves the advantages
        # where it first needs them: the work before (the KL reference, JAGG's no-grad velocities, the first
        # step's forward; with per-group advantages, the micro-batches whose groups are scored) overlaps the last
        # answers. Anything else is scored here, after the rollout.
        rows = torch.arange(len(prompts))
        if not scorer.scores_every_reward:
            pending = advantages()
        elif advantages_per_group(args):
            fail = lambda failure: on_reward_failure(failure, f"at step {global_step + 1}")  # noqa: E731
            by_chunk = self._chunk_advantages(prompts, images, columns, scorer, chunk, trainer_state, fail)
            pending = PendingAdvantages(by_chunk, rows)
        else:
            whole = functools.cache(advantages)
            pending = PendingAdvantages(lambda rows: whole()[rows.to(device)], rows)
        rollout = RolloutBatch(
            latents=latents,
            advantages=pending,
            cond=cond,
            sigmas=sigmas,
            # The group planner reads the flow times on the host: one transfer per rollout, not one per step.
            sigma_values=sigmas.tolist(),
            timesteps=timesteps,
            stochastic_steps=stochastic_steps,
            log_probs=torch.cat([t.log_probs for t in trajectories]),
        )
        if record_velocities:
            rollout.velocities = torch.cat([t.velocities for t in trajectories])
            # What each step's cached velocities are exact for: these parameters (`velocity_step`), this forward
            # path and the batch shape its backbone call ran on, if every chunk ran that step on one shape (else
            # never reused).
            shapes = [set(step) for step in zip(*(t.call_shapes for t in trajectories))]
            rollout.velocity_keys = [
                velocity_key(adapter.dtype, device.type, *shape) if len(shape) == 1 else None for shape in shapes
            ]
            rollout.velocity_step = global_step
        return rollout

    def _score(
        self, prompts: list[str], images: list, columns: dict[str, list[Any]], sources: list | None,
        scorer: ChunkScorer, trainer_state: Any,
    ) -> torch.Tensor:  # fmt: skip
        """The rollout's rewards (the chunk-scored ones from their chunks) and this process's rows of the group
        advantages of the gathered batch; logs the reward metrics and keeps the completions for the logs."""
        args, device = self.args, self.accelerator.device
        start = time.perf_counter()
        reward_metrics: dict[str, list[float]] = defaultdict(list)
        extra_columns: dict[str, list[Any]] = defaultdict(list)
        rewards, per_reward = scored_rewards(
            scorer.reward_funcs(), self.accelerator, prompts, images, weights=args.reward_weights,
            retries=args.reward_retries, timeout=args.reward_timeout, trainer_state=trainer_state,
            # TRL's reward keywords: a scalar for the logs, a column (one value per image) for the completions table.
            log_metric=lambda name, value: reward_metrics[name].append(float(value)),
            log_extra=lambda column, values: extra_columns[column].extend(values),
            **columns,
        )  # fmt: skip
        self._log_reward_metrics(reward_metrics)
        advantages = self._advantages(group_keys(prompts, sources), rewards.to(device), per_reward)
        self.metrics["time/reward_s"].append(time.perf_counter() - start)
        # Kept whatever log_completions says: the reward-hacking watch reads every rollout's images and scores.
        scores = {"reward": rewards.tolist(), **{name: value.tolist() for name, value in per_reward.items()}}
        self.completions = (prompts, images, {**scores, **extra_columns})
        rank = self.accelerator.process_index
        return advantages[rank * len(prompts) : (rank + 1) * len(prompts)].to(device)

    def _log_reward_metrics(self, reward_metrics: dict[str, list[float]]) -> None:
        """The rewards' ``log_metric`` values, averaged over every value on every process (as TRL); the names are
        gathered and sorted first, so every process reduces the same metrics in the same order."""
        for name in sorted(set(gather_object(list(reward_metrics)))):
            values = reward_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=self.accelerator.device)
            total, count = self.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            self.metrics[name].append(total / count)

    def _advantages(self, keys: list[str], rewards: torch.Tensor, per_reward: dict[str, torch.Tensor]) -> torch.Tensor:
        """Group advantages of the gathered batch (every process computes all of them), and the reward metrics;
        ``keys`` (:func:`group_keys`) identify the samples' groups for the per-prompt statistics."""
        args = self.args
        per_func = torch.stack(list(per_reward.values()), dim=1).to(rewards.device)
        all_per_func = self.accelerator.gather(per_func)
        all_rewards = self.accelerator.gather(rewards)
        if self.stat_tracker is not None:
            advantages = self.stat_tracker.update(gather_object(keys), all_rewards.cpu(), clip=args.adv_clip_max)
        elif args.multi_objective_aggregation == "normalize_then_sum":
            common = dict(eps=args.advantage_eps, ddof=args.advantage_std_ddof)
            advantages = multi_reward_advantages(
                all_per_func, args.num_generations, args.reward_weights, clip=args.adv_clip_max, **common
            )
            # Each reward's share of the sum, before the batch normalisation: |weight * group-normalised reward|.
            shares = per_reward_group_normalize(all_per_func, args.num_generations, **common).abs()
            for i, name in enumerate(per_reward):
                weight = 1.0 if args.reward_weights is None else abs(args.reward_weights[i])
                self.metrics[f"advantages/{name}/abs_mean"].append(weight * shares[:, i].mean().item())
        else:
            advantages = self._group_advantages(all_rewards)
        self._log_scores(all_rewards, all_per_func, list(per_reward), advantages)
        return advantages

    def _group_advantages(self, all_rewards: torch.Tensor) -> torch.Tensor:
        """Per-prompt group advantages of the gathered batch's rewards (``scale_rewards``)."""
        args = self.args
        return group_advantages(
            all_rewards, args.num_generations, scale_by=args.scale_rewards, clip=args.adv_clip_max,
            eps=args.advantage_eps, ddof=args.advantage_std_ddof,
        )  # fmt: skip

    def _log_scores(
        self, all_rewards: torch.Tensor, all_per_func: torch.Tensor, names: list[str], advantages: torch.Tensor
    ) -> None:
        """The metrics of the gathered batch's rewards (in all and per reward ``names``) and advantages."""
        args = self.args
        grouped = all_rewards.view(-1, args.num_generations)
        self.metrics["reward"].append(all_rewards.mean().item())
        self.metrics["reward_std"].append(all_rewards.std().item())
        self.metrics["frac_reward_zero_std"].append((grouped.std(dim=1) < 1e-6).float().mean().item())
        for i, name in enumerate(names):
            scored = all_per_func[:, i][~all_per_func[:, i].isnan()]  # None (not applicable) is NaN
            self.metrics[f"rewards/{name}/mean"].append(scored.mean().item())
            self.metrics[f"rewards/{name}/std"].append(scored.std().item())
        self.metrics["advantages/mean"].append(advantages.mean().item())
        self.metrics["advantages/abs_mean"].append(advantages.abs().mean().item())
        self.metrics["zero_advantage/frac"].append((advantages == 0).float().mean().item())

    def _chunk_advantages(
        self, prompts: list[str], images: list, columns: dict[str, list[Any]], scorer: ChunkScorer, chunk: int,
        trainer_state: Any, fail: Callable[[RewardFailure], NoReturn],
    ) -> ChunkAdvantages:  # fmt: skip
        """The rollout's advantages resolved chunk by chunk (:func:`advantages_per_group`): each chunk's rewards are
        checked and weighted as :func:`~trl_jagg.rewards.compute_rewards` does for the whole batch, then gathered;
        the metrics and completions, those of :meth:`_score`, once the last chunk is in."""
        args, device = self.args, self.accelerator.device
        reward_metrics: dict[str, list[float]] = defaultdict(list)
        extra_columns: dict[str, list[Any]] = defaultdict(list)
        names: list[str] = []
        waited = [0.0]

        @torch.no_grad()  # a retry runs the reward itself here, maybe inside the update's loss
        def score_chunk(c: int) -> tuple[torch.Tensor, torch.Tensor]:
            start, index = time.perf_counter(), slice(c * chunk, (c + 1) * chunk)
            try:
                rewards, per_reward = scored_rewards(
                    scorer.reward_funcs(c), self.accelerator, prompts[index], images[index],
                    weights=args.reward_weights, retries=args.reward_retries, timeout=args.reward_timeout,
                    trainer_state=trainer_state,
                    first_sample=c * chunk,  # errors name the rollout's positions, not the chunk's
                    log_metric=lambda name, value: reward_metrics[name].append(float(value)),
                    log_extra=lambda column, values: extra_columns[column].extend(values),
                    **{key: values[index] for key, values in columns.items()},
                )  # fmt: skip
            except RewardFailure as failure:
                fail(failure)
            names[:] = per_reward
            per_func = torch.stack(list(per_reward.values()), dim=1).to(device)
            gathered = self.accelerator.gather(rewards.to(device)), self.accelerator.gather(per_func)
            waited[0] += time.perf_counter() - start
            return gathered

        def finish(all_rewards: torch.Tensor, all_per_func: torch.Tensor, advantages: torch.Tensor) -> None:
            self._log_reward_metrics(reward_metrics)
            self._log_scores(all_rewards, all_per_func, names, advantages)
            self.metrics["time/reward_s"].append(waited[0])
            first = self.accelerator.process_index * len(prompts)
            mine = slice(first, first + len(prompts))
            scores = {"reward": all_rewards[mine].tolist()}
            scores.update({name: all_per_func[mine, i].tolist() for i, name in enumerate(names)})
            self.completions = (prompts, images, {**scores, **extra_columns})

        return ChunkAdvantages(
            num_rows=len(prompts), chunk_size=chunk, num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index, num_generations=args.num_generations,
            score_chunk=score_chunk, advantages=self._group_advantages, finish=finish,
        )  # fmt: skip
