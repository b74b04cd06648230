"""DDPOJaggTrainer: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients.

Each optimizer step: rollout (SDE sampling under ``no_grad``, log-probs recorded) -> decode -> rewards ->
per-prompt group advantages -> update over the trained denoising steps through the JAGG engine, whose backward
is ``accelerator.backward``. Everything else (optimizer, scheduler, logging, ``report_to``, checkpoints, resume,
``push_to_hub``) is ``transformers.Trainer``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import glob
import json
import logging
import os
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import DistributedType, gather_object
from datasets import Dataset
from diffusers import DiffusionPipeline
from diffusers.configuration_utils import FrozenDict
from diffusers.training_utils import EMAModel, cast_training_params
from huggingface_hub import save_torch_state_dict
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.utils.data import Sampler
from tqdm.auto import tqdm
from transformers import TrainerCallback, set_seed
from transformers import trainer as transformers_trainer
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    HubStrategy,
    SaveStrategy,
    get_last_checkpoint,
    rotate_checkpoints,
)
from transformers.utils.hub import PushInProgress
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import RepeatSampler

from .distributed import check_backend, check_world_size, fully_shard_blocks, is_fully_sharded
from .errors import CheckpointError, NonFiniteError, TrainingError
from .grpo import PerPromptStatTracker, group_advantages, kl_to_reference, ppo_step_loss
from .grpo_jagg_config import GRPOJaggConfig
from .jagg import EngineResult, JaggEngine, gradient_diagnostic, leading_jagg_fraction, plan_groups
from .models import FlowMatchingAdapter, load_adapter
from .prompts import prompt_dataset, prompt_text
from .rewards import compute_rewards, load_reward_funcs, reward_name
from .rollout import Trajectory, generate_images, sample_trajectories
from .sampling import sampler_step
from .trainer.checkpoint_checks import check_checkpoint_dir, check_state_files, check_weights, weight_files
from .trainer.model_card import write_model_card

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
SCHEDULER_FOLDER = "scheduler"
# Never uploaded from output_dir: the Trainer's patterns plus the staging folders of `_save_checkpoint`.
HUB_IGNORE_PATTERNS = ["_*", f"{PREFIX_CHECKPOINT_DIR}-*", f"tmp-{PREFIX_CHECKPOINT_DIR}-*"]
# The trainer's own run state in a checkpoint (the Trainer saves weights, optimizer, scheduler and RNG itself).
GRPO_STATE_NAME = "grpo_state.json"
FULL_WEIGHTS_PATTERN = "diffusion_pytorch_model*.safetensors"
NON_FINITE_FIX = (
    "Resume from the checkpoint with a lower learning_rate (or max_grad_norm > 0, noise_level, guidance_scale in "
    "their usual ranges, dtype float32)."
)
logger = logging.getLogger(__name__)
EMA_DIR = "ema"
"""Subfolder of every saved model and checkpoint holding the EMA weights, in the format of the trained ones."""
# What `_save` writes and a checkpoint push carries up to the Hub (the Trainer's own list knows transformers' and
# peft's file names only): the weights in the diffusers layout, the backbone config, the scheduler, the EMA weights,
# the card.
MODEL_FILES = (
    LORA_WEIGHTS_NAME,
    "diffusion_pytorch_model*.safetensors",
    "diffusion_pytorch_model*.safetensors.index.json",
    "config.json",
    SCHEDULER_FOLDER,
    EMA_DIR,
    "README.md",
)
RewardFunc = Callable[..., list[float]]


class DDPOJaggTrainer(_BaseTrainer):
    """GRPO trainer for flow-matching text-to-image pipelines (Flux, SD3/SD3.5, Qwen-Image), with JAGG.

    Args:
        model: a Hub id, a local directory, or a loaded :class:`~diffusers.DiffusionPipeline`. Its transformer
            backbone is trained; the VAE and text encoders are frozen and stay in the pipeline's dtype.
        reward_funcs: a reward name (see :mod:`trl_jagg.rewards`), a dotted import path, a callable called with
            keywords as in TRL (``prompts=``, ``images=`` / ``completions=``, ``trainer_state=``, the dataset's
            other columns) returning a ``float`` or ``None`` (not applicable) per image, or a list mixing these.
        args: the configuration; defaults to ``GRPOJaggConfig("grpo-jagg")``.
        train_dataset: a dataset with a ``prompt`` column of non-empty strings or TRL conversations
            (``[{"role": "user", "content": ...}]``, whose last user turn is the prompt), or a list of prompts; other
            columns reach the reward functions as kwargs. It must hold one rollout's ``args.prompts_per_rollout``
            prompts. Streaming datasets are refused (the sampler needs the length).
        eval_dataset: held-out prompts (as ``train_dataset``) that :meth:`evaluate` renders with deterministic ODE
            sampling and scores every ``eval_steps`` (``eval_strategy="steps"``), as TRL's trainers take it.
        peft_config: a :class:`~peft.LoraConfig` for LoRA training; ``None`` trains the full backbone.
        callbacks, optimizers: as in :class:`~transformers.Trainer`.
    """

    _tag_names = ["trl", "trl-jagg", "grpo", "diffusers", "text-to-image"]
    _name = "GRPO-JAGG"

    def __init__(
        self,
        model: str | DiffusionPipeline,
        reward_funcs: str | RewardFunc | Sequence[str | RewardFunc],
        args: GRPOJaggConfig | None = None,
        train_dataset: Dataset | None = None,
        eval_dataset: Dataset | None = None,
        peft_config: LoraConfig | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
    ):
        args = args if args is not None else GRPOJaggConfig("grpo-jagg")
        if not isinstance(args, GRPOJaggConfig):
            raise TypeError(f"`args` must be a GRPOJaggConfig, got {type(args).__name__}.")
        # A launch that silently runs fewer processes stops here, before anything is loaded.
        check_world_size(args.world_size)
        # Seed before the adapter is created: Trainer seeds only in its own __init__, after LoRA init.
        set_seed(args.seed)
        # Cheap checks first: nothing is loaded before the inputs are known to be usable.
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: a datasets.Dataset with a 'prompt' column.")
        train_dataset = prompt_dataset(train_dataset, args.prompts_per_rollout)
        if eval_dataset is not None:
            eval_dataset = prompt_dataset(eval_dataset, 1, name="eval_dataset")
        resume = args.resume_from_checkpoint
        if isinstance(resume, str) and resume.lower() not in ("true", "last"):
            check_checkpoint_dir(resume, args.output_dir)
        self.reward_funcs = load_reward_funcs(reward_funcs, device=args.device)
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"GRPOJaggConfig.reward_weights has {len(args.reward_weights)} values for {len(self.reward_funcs)} "
                "reward functions. Give one weight per reward function."
            )

        self.base_model_id = model if isinstance(model, str) else (model.name_or_path or None)
        self.adapter: FlowMatchingAdapter = load_adapter(
            model, dtype=getattr(torch, args.dtype), revision=args.model_revision
        )
        self.scheduler_overridden = _scheduler_differs_from_base(
            self.adapter.pipeline.scheduler, self.base_model_id, args.model_revision
        )
        # For the card written at every save: what `create_model_card` was last told, the latest sample images.
        self._model_card_kwargs: dict[str, Any] = {}
        self._card_samples: list[tuple[str, str]] = []
        pipeline = self.adapter.pipeline
        pipeline.set_progress_bar_config(disable=True)
        for component in pipeline.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False).eval()

        transformer = self.adapter.transformer
        # transformers' tracker integrations read `model.config.to_json_string()` / `.to_dict()`.
        transformer._internal_dict = _TrackableConfig(transformer._internal_dict)
        self.peft_config = peft_config
        if peft_config is not None:
            _check_lora_targets(transformer, peft_config)
            transformer.add_adapter(peft_config)
            # Trainable LoRA weights live in float32 even when the backbone runs in bf16.
            cast_training_params(transformer, dtype=torch.float32)
        else:
            transformer.requires_grad_(True)
        self.ref_transformer = None
        if args.beta > 0 and peft_config is None:
            self.ref_transformer = copy.deepcopy(transformer).requires_grad_(False).eval()
        if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
            # transformers' own switch calls a transformers-only method; diffusers has its own.
            transformer.enable_gradient_checkpointing()
            args.gradient_checkpointing = args.activation_checkpointing = False

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
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._step = 0
        # Set by Trainer's loop for each accumulation window; defined here for updates run outside `train()`.
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self._buffered_inputs: list[dict[str, Any]] | None = None
        # The latest rollout's (prompts, images, scores) for `log_completions`, until the next log.
        self._completions: tuple[list[str], list, dict[str, list[float]]] | None = None

        super().__init__(
            model=transformer,
            args=args,
            data_collator=_identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=None,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        check_backend(
            self.accelerator.distributed_type,
            self.accelerator.num_processes,
            fsdp_requested=bool(args.fsdp),
            fully_shard_backbone=args.fully_shard_backbone,
        )
        offloaded = self._text_encoders + self._vae if args.offload_frozen_modules else []
        for component in pipeline.components.values():
            if isinstance(component, torch.nn.Module) and component is not transformer:
                component.to("cpu" if any(component is m for m in offloaded) else self.accelerator.device)
        self._prompt_table: dict[str, dict[str, torch.Tensor]] = {}
        if args.precompute_prompt_embeds and isinstance(train_dataset, Dataset):
            self._precompute_prompt_embeds([prompt_text(p, "train_dataset 'prompt'") for p in train_dataset["prompt"]])
        if self.ref_transformer is not None:
            self.ref_transformer.to(self.accelerator.device)
        if args.fully_shard_backbone:
            for backbone in (transformer, self.ref_transformer):
                if backbone is not None:
                    fully_shard_blocks(backbone)
            # transformers' switch for a model sharded before the Trainer sees it: no DDP wrap (DDP rejects DTensor
            # parameters), the optimizer built on the shards, every rank inside `_save` for the gathers.
            self.is_distributed_loading_by_transformers = True
        elif self.accelerator.is_fsdp2 and self.ref_transformer is not None:
            # accelerate's plugin shards the trained backbone when it prepares it; the frozen reference is ours.
            fully_shard_blocks(self.ref_transformer)
        self.adapter.refresh_placement()
        # Dropout active in training mode makes a recomputed velocity differ from the rollout's (eval mode).
        self._has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in transformer.modules())
        self._routed_frac: float | None = None
        self._last_probe_step: int | None = None
        self.ema: EMAModel | None = None
        if args.ema_decay > 0:
            if self.is_fsdp_enabled or args.fully_shard_backbone:
                raise ValueError(
                    "GRPOJaggConfig.ema_decay > 0 is not supported with FSDP yet: the EMA would average one "
                    "process's shards only. Set ema_decay=0, or train without FSDP."
                )
            # Flow-GRPO's warm-up min(decay, (1 + t) / (10 + t)) is EMAModel's; min_decay = decay turns it off.
            self.ema = EMAModel(
                self._trainable_parameters(),
                decay=args.ema_decay,
                min_decay=0.0 if args.ema_warmup else float(args.ema_decay),
            )
            # float32: a bf16 average would lose updates of (1 - decay) * difference.
            self.ema.to(device="cpu" if args.ema_offload else None, dtype=torch.float32)
            self.add_callback(EMACallback(self))
        if args.image_log_steps and args.eval_prompts:
            self.add_callback(SampleImagesCallback(self))

    # ------------------------------------------------------------------ data
    def _send_telemetry(self) -> None:
        """No telemetry: this trainer is not TRL's, and runs offline."""

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        # One dataloader batch is a whole rollout (steps_per_generation micro-batches), as in TRL's GRPOTrainer.
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self._train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, dataset: Dataset | None = None) -> Sampler:
        # Each prompt appears num_generations times in a row; the batch is repeated for every micro-batch and
        # inner iteration it feeds, so the dataloader stays aligned with the rollout buffer.
        return EpochSeededRepeatSampler(
            data_source=dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            shuffle=True,
            seed=self.args.seed,
        )

    # ------------------------------------------------------------------ training step
    def training_step(
        self, model: torch.nn.Module, inputs: list[dict[str, Any]], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        model.train()
        batch = self._prepare_inputs(inputs)
        start = time.perf_counter()
        result = self._update(model, batch)
        # Checked after the backward, before the optimizer step: the weights are still those of the last step.
        self._stop_if_non_finite("loss", result.loss)
        self._metrics["time/update_s"].append(time.perf_counter() - start)
        return torch.tensor(result.loss / self.current_gradient_accumulation_steps, device=self.accelerator.device)

    def _prepare_inputs(self, generation_batch: list[dict[str, Any]]) -> dict[str, Any]:
        generate_every = self.args.steps_per_generation * self.args.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            rollout = self._generate_and_score(generation_batch)
            self._buffered_inputs = _split_rollout(rollout, self.args.steps_per_generation)
            if self.args.drop_zero_advantages:
                self._buffered_inputs = [self._without_zero_advantages(chunk) for chunk in self._buffered_inputs]
        inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        self._step += 1
        return inputs

    def _without_zero_advantages(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The micro-batch without its zero-advantage samples (Flow-GRPO drops them before the update): their policy
        gradient is zero, so they would only cost a backward."""
        keep = chunk["advantages"] != 0
        if not keep.any() and self.accelerator.num_processes > 1:
            # Every process must run the same backward calls (DDP/FSDP collectives): keep one sample, whose zero
            # advantage adds no policy gradient.
            keep[0] = True
        kept = _select(chunk, keep.nonzero().flatten())
        kept["dropped_frac"] = 1.0 - kept["latents"].shape[0] / keep.numel()
        return kept

    def _rng_seed(self, *parts: int) -> int:
        """A seed that depends on the run seed, the optimizer step and ``parts``: resuming replays the same noise."""
        return hash((self.args.seed, self.state.global_step, *parts)) % (2**63)

    @torch.no_grad()
    def _generate_and_score(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        prompts = [prompt_text(x["prompt"], "train_dataset 'prompt'") for x in inputs]
        columns = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        transformer = self.accelerator.unwrap_model(self.model)
        was_training = transformer.training
        transformer.eval()
        self.adapter.refresh_placement()  # once per rollout, in case the backbone was moved or cast
        record_velocities = args.use_jagg and args.jagg_cache_velocities

        sigmas, timesteps = self.adapter.schedule(args.num_inference_steps, args.height, args.width)
        if args.quantize_timesteps:
            # DanceGRPO feeds the backbone int(sigma * 1000) / 1000; the sampler keeps the exact sigmas.
            timesteps = timesteps.floor()
        stochastic_steps = self._sde_window()
        # Encode every distinct prompt once; samples index into it.
        unique = list(dict.fromkeys(prompts))
        cond = self._condition(unique).select(
            torch.tensor([unique.index(p) for p in prompts], device=self.accelerator.device)
        )

        generator = torch.Generator(self.accelerator.device).manual_seed(
            self._rng_seed(self.accelerator.process_index)
        )
        initial_noise = self._group_noise(len(prompts)) if args.same_group_noise else None
        chunk = args.sample_batch_size or args.per_device_train_batch_size
        trajectories: list[Trajectory] = []
        images = []
        # Rollouts of a large model take minutes: a transient bar under the Trainer's own.
        chunks = tqdm(
            range(0, len(prompts), chunk),
            desc="rollout",
            leave=False,
            disable=args.disable_tqdm or not self.is_local_process_zero(),
        )
        for begin in chunks:
            index = slice(begin, begin + chunk)
            if initial_noise is not None:
                noise = initial_noise[index]
            else:
                noise = self.adapter.prepare_latents(len(prompts[index]), args.height, args.width, generator)
            trajectory = sample_trajectories(
                self.adapter, cond.select(index), noise, sigmas, timesteps,
                sampler=args.sampler, noise_level=args.noise_level, guidance_scale=args.guidance_scale,
                true_cfg_scale=args.true_cfg_scale, stochastic_steps=stochastic_steps, generator=generator,
                transformer=transformer, record_velocities=record_velocities,
            )  # fmt: skip
            trajectories.append(trajectory)
            with self._frozen_on_accelerator(self._vae):
                images.extend(self.adapter.decode(trajectory.latents[:, -1], args.height, args.width))
        _reshard(transformer)
        transformer.train(was_training)
        rollout_seconds = time.perf_counter() - start
        latents = torch.cat([t.latents for t in trajectories])
        # NaN latents decode to black images with finite rewards: stop here, before the rewards hide them.
        self._stop_if_non_finite("latents after the rollout", latents)

        start = time.perf_counter()
        rewards, per_reward = self._rewards(prompts, images, columns)
        rewards = rewards.to(self.accelerator.device)
        per_func = torch.stack(list(per_reward.values()), dim=1).to(self.accelerator.device)
        all_per_func = self.accelerator.gather(per_func)
        all_rewards = self.accelerator.gather(rewards)
        if self.stat_tracker is not None:
            all_prompts = gather_object(prompts)
            advantages = self.stat_tracker.update(all_prompts, all_rewards.cpu(), clip=args.adv_clip_max)
        else:
            advantages = group_advantages(
                all_rewards,
                args.num_generations,
                scale_by=args.scale_rewards,
                clip=args.adv_clip_max,
                eps=args.advantage_eps,
                ddof=args.advantage_std_ddof,
            )
        rank = self.accelerator.process_index
        local = slice(rank * len(prompts), (rank + 1) * len(prompts))

        grouped = all_rewards.view(-1, args.num_generations)
        self._metrics["reward"].append(all_rewards.mean().item())
        self._metrics["reward_std"].append(all_rewards.std().item())
        self._metrics["frac_reward_zero_std"].append((grouped.std(dim=1) < 1e-6).float().mean().item())
        for i, name in enumerate(per_reward):
            scored = all_per_func[:, i][~all_per_func[:, i].isnan()]  # None (not applicable) is NaN
            self._metrics[f"rewards/{name}/mean"].append(scored.mean().item())
            self._metrics[f"rewards/{name}/std"].append(scored.std().item())
        self._metrics["advantages/mean"].append(advantages.mean().item())
        self._metrics["advantages/abs_mean"].append(advantages.abs().mean().item())
        self._metrics["zero_advantage/frac"].append((advantages == 0).float().mean().item())
        self._metrics["latents/final_std"].append(latents[:, -1].std().item())
        self._metrics["time/rollout_s"].append(rollout_seconds)
        self._metrics["time/reward_s"].append(time.perf_counter() - start)
        if args.log_completions:
            scores = {"reward": rewards.tolist(), **{name: value.tolist() for name, value in per_reward.items()}}
            self._completions = (prompts, images, scores)
        rollout = {
            "latents": latents,
            "log_probs": torch.cat([t.log_probs for t in trajectories]),
            "advantages": advantages[local].to(self.accelerator.device),
            "cond": cond,
            "sigmas": sigmas,
            "timesteps": timesteps,
            "stochastic_steps": stochastic_steps,
        }
        if record_velocities:
            rollout["velocities"] = torch.cat([t.velocities for t in trajectories])
            # What the cached velocities are exact for: these parameters and this forward path.
            rollout["velocity_key"] = self._velocity_key()
        return rollout

    def _velocity_key(self) -> tuple[Any, ...]:
        """Identifies the policy and forward path a velocity was computed with: the optimizer steps taken, the
        backbone dtype and the autocast state (accelerate's mixed precision wraps the forward in autocast)."""
        device_type = self.accelerator.device.type
        autocast = torch.is_autocast_enabled(device_type)
        return (
            self.state.global_step,
            self.adapter.dtype,
            autocast,
            torch.get_autocast_dtype(device_type) if autocast else None,
        )

    def _cached_velocities(self, model: torch.nn.Module, batch: dict[str, Any], trained: list[int]) -> dict:
        """The rollout's velocities of the trained steps (keyed by trained index) while they are exactly what the
        backbone would return now; empty otherwise (then the engine recomputes them)."""
        if not self.args.jagg_cache_velocities or "velocities" not in batch:
            return {}
        if batch["velocity_key"] != self._velocity_key() or (model.training and self._has_dropout):
            return {}
        return {i: batch["velocities"][:, k] for i, k in enumerate(trained)}

    # ------------------------------------------------------------------ frozen components
    @property
    def _text_encoders(self) -> list[torch.nn.Module]:
        pipeline = self.adapter.pipeline
        return [c for name, c in pipeline.components.items() if name.startswith("text_encoder") and c is not None]

    @property
    def _vae(self) -> list[torch.nn.Module]:
        return [self.adapter.pipeline.vae]

    @contextlib.contextmanager
    def _frozen_on_accelerator(self, modules: list[torch.nn.Module]):
        """With ``offload_frozen_modules``, frozen ``modules`` live on the CPU and visit the accelerator only while
        they run; otherwise they stay where they are."""
        if not self.args.offload_frozen_modules:
            yield
            return
        for module in modules:
            module.to(self.accelerator.device)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")

    def _encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """One prompt's encoding (batch 1), kept on the CPU for the precomputed table."""
        encoded = self.adapter.encode_prompts([prompt], self.args.max_sequence_length)
        return {key: value.cpu() for key, value in encoded.items() if value is not None}

    def _precompute_prompt_embeds(self, prompts: Sequence[str]) -> None:
        """Encode each distinct prompt once (and the negative prompt), one at a time as DanceGRPO does: a prompt's
        encoding then never depends on the batch it lands in."""
        unique = [p for p in dict.fromkeys(prompts) if p not in self._prompt_table]
        if not unique:
            return
        with torch.no_grad(), self._frozen_on_accelerator(self._text_encoders):
            for prompt in unique:
                self._prompt_table[prompt] = self._encode_one(prompt)
            if self._negative_prompt is not None:  # the adapter encodes it once (cached per device): now
                self._condition(unique[:1])

    def _condition(self, prompts: list[str]):
        """The conditioning of distinct ``prompts``: from the precomputed table (``precompute_prompt_embeds``; a
        prompt met for the first time is added to it), else encoded now."""
        args = self.args
        if args.precompute_prompt_embeds:
            self._precompute_prompt_embeds(prompts)
            collated = self.adapter.collate([self._prompt_table[p] for p in prompts])
            encoded = {key: value.to(self.accelerator.device) for key, value in collated.items()}
            context = contextlib.nullcontext()  # the negative prompt was encoded with the table
        else:
            encoded, context = None, self._frozen_on_accelerator(self._text_encoders)
        with context:
            return self.adapter.condition(
                prompts,
                height=args.height,
                width=args.width,
                negative_prompt=self._negative_prompt,
                max_sequence_length=args.max_sequence_length,
                encoded=encoded,
            )

    def _rewards(
        self, prompts: list[str], images: list, columns: dict[str, list]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:func:`compute_rewards` with ``reward_retries``; when a reward fails on any process, every process saves
        a checkpoint (so no trained step is lost) before the error stops the run."""
        args = self.args
        failure: Exception | None = None
        try:
            result = compute_rewards(
                self.reward_funcs, prompts, images, args.reward_weights, trainer_state=self.state,
                retries=args.reward_retries, **columns,
            )  # fmt: skip
        except Exception as error:  # re-raised below, once every process has reached the save
            failure = error
        if not self._any_process(failure is not None):
            return result
        saved = self._save_after_failure()
        note = (
            f"{saved} holds the {self.state.global_step} trained steps: resume from it."
            if saved
            else "No trained step was lost (none to save)."
        )
        if failure is None:
            raise TrainingError(
                f"A reward function failed on another process at step {self.state.global_step + 1}. {note}"
            )
        logger.warning("A reward function failed at step %d. %s", self.state.global_step + 1, note)
        if hasattr(failure, "add_note"):  # Python >= 3.11: shown with the error
            failure.add_note(note)
        raise failure

    def _save_after_failure(self) -> str | None:
        """Save ``checkpoint-N`` of the steps trained so far, unless there are none or it exists; on every process."""
        step = self.state.global_step
        run_dir = self._get_output_dir(trial=None)
        path = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if not self.is_in_train or step == 0:
            return None
        if not os.path.isdir(path):
            self._save_checkpoint(self.model, trial=None)
        return path

    def _any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process: every process takes the same branch (no rank left waiting in
        a collective the others skipped)."""
        if self.accelerator.num_processes == 1:
            return flag
        value = torch.tensor(float(flag), device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, reduction="sum") > 0)

    def _stop_if_non_finite(self, quantity: str, value: torch.Tensor | float | None) -> None:
        """Raise :class:`NonFiniteError` naming the step, ``quantity`` and the last good checkpoint when ``value``
        holds a NaN or an infinity on any process."""
        if value is None:
            return
        bad = not bool(torch.isfinite(torch.as_tensor(value)).all())
        if self._any_process(bad):
            raise NonFiniteError(
                f"Non-finite {quantity} at step {self.state.global_step + 1}: training stopped before the optimizer "
                f"applied it. {self._last_checkpoint_note()} {NON_FINITE_FIX}"
            )

    def _last_checkpoint_note(self) -> str:
        run_dir = self._get_output_dir(trial=None)
        last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
        if last is None:
            return f"No checkpoint was saved before it in {run_dir}."
        return f"Last good checkpoint: {last}."

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # Trainer computes the norm after the backward and before `optimizer.step`: a NaN stops here, unapplied.
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._stop_if_non_finite("gradient norm", grad_norm)
        return grad_norm

    @property
    def _negative_prompt(self) -> str | None:
        """The negative prompt to encode, when the guidance settings use an unconditional branch."""
        args = self.args
        return (
            args.negative_prompt
            if self.adapter.needs_negative_prompt(args.guidance_scale, args.true_cfg_scale)
            else None
        )

    def _group_noise(self, num_samples: int) -> torch.Tensor:
        """Initial noise shared by each prompt group: drawn from a seed of the group's index in the global batch, so
        the processes holding parts of one group draw the same latent without communicating."""
        args = self.args
        first = self.accelerator.process_index * num_samples  # this process's rows in the gathered batch
        groups = [(first + i) // args.num_generations for i in range(num_samples)]
        noise = {}
        for group in dict.fromkeys(groups):
            generator = torch.Generator(self.accelerator.device).manual_seed(self._rng_seed(-3, group))
            noise[group] = self.adapter.prepare_latents(1, args.height, args.width, generator)
        return torch.cat([noise[group] for group in groups])

    def _sde_window(self) -> list[int] | None:
        """Flow-GRPO-Fast: the stochastic steps of this rollout (``None``: all)."""
        args = self.args
        if args.sde_window_size == 0:
            return None
        max_start = args.sde_window_max_start
        if max_start is None:
            max_start = max(0, min(args.num_inference_steps // 2, args.num_inference_steps - args.sde_window_size))
        start = random.Random(self._rng_seed(-1)).randint(0, max_start)
        return list(range(start, start + args.sde_window_size))

    def _trained_steps(self, batch: dict[str, Any]) -> list[int]:
        """Which denoising steps this update trains, identical on every process."""
        args = self.args
        num_steps = args.num_inference_steps
        if args.train_timesteps == "all":
            return list(range(num_steps))
        if args.train_timesteps == "all_but_last":
            return list(range(num_steps - 1))
        if args.train_timesteps == "sde_window":
            return list(batch["stochastic_steps"])
        # DanceGRPO never trains the last step (its Gaussian is the narrowest): `random_but_last`.
        candidates = num_steps - (args.train_timesteps == "random_but_last")
        count = max(1, round(args.train_timestep_fraction * candidates))
        return sorted(random.Random(self._rng_seed(-2, self._step)).sample(range(candidates), count))

    # ------------------------------------------------------------------ update
    def _step_functions(self, model: torch.nn.Module, batch: dict[str, Any]) -> _StepFunctions:
        """The engine's inputs for one micro-batch: the trained steps, the backbone call and the per-step loss of
        the ``i``-th trained step, the batched no-grad backbone call, and the per-step diagnostics the loss fills."""
        args = self.args
        trained = self._trained_steps(batch)
        latents, old_log_probs, advantages = batch["latents"], batch["log_probs"], batch["advantages"]
        sigmas = batch["sigmas"]
        ref_means = self._reference_means(batch, trained) if args.beta > 0 else {}
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)

        def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:
            k = trained[i]
            step = sampler_step(
                v, latents[:, k], sigmas[k], sigmas[k + 1], sampler=args.sampler, noise_level=args.noise_level,
                sigma_max=sigmas[1], prev_sample=latents[:, k + 1],
            )  # fmt: skip
            kl = None
            if k in ref_means:
                kl = kl_to_reference(step.mean, ref_means[k], step.std if args.kl_std == "step" else step.noise_scale)
            out = ppo_step_loss(
                step.log_prob, old_log_probs[:, k], advantages, args.clip_range, kl=kl, beta=args.beta,
                clip_range_high=args.epsilon_high,
            )  # fmt: skip
            for key in ("policy_loss", "kl", "ratio_mean", "clip_fraction", "approx_kl"):
                stats[key].append(getattr(out, key))
            return out.loss

        return _StepFunctions(
            trained=trained,
            velocity_fn=lambda i: self._velocities(model, batch, [trained[i]])[0],
            loss_fn=loss_fn,
            no_grad_velocities_fn=lambda steps: self._velocities(model, batch, [trained[i] for i in steps]),
            stats=stats,
        )

    def _velocities(self, transformer: torch.nn.Module, batch: dict[str, Any], steps: Sequence[int]) -> list:
        """The guided velocities of denoising steps ``steps`` of the micro-batch, under the ambient grad mode.

        Several steps run as one backbone call over their concatenated micro-batches, up to ``no_grad_batch_steps``
        steps a call (the memory cap); the results are those of one call per step up to float rounding."""
        args = self.args
        latents, timesteps, cond = batch["latents"], batch["timesteps"], batch["cond"]
        size = latents.shape[0]
        guidance = {
            "guidance_scale": args.guidance_scale,
            "true_cfg_scale": args.true_cfg_scale,
            "uncond_grad": args.cfg_gradient == "both",
        }
        per_call = args.no_grad_batch_steps or len(steps)
        velocities = []
        for begin in range(0, len(steps), per_call):
            chunk = list(steps[begin : begin + per_call])
            if len(chunk) == 1:
                k = chunk[0]
                x, t, c = latents[:, k], timesteps[k].expand(size), cond
            else:
                x = latents[:, chunk].transpose(0, 1).flatten(0, 1)  # step-major: step j is rows j*size..
                t = timesteps[chunk].repeat_interleave(size)
                c = cond.select(torch.arange(size, device=latents.device).repeat(len(chunk)))
            v = self.adapter.predict_velocity(transformer, x, t, c, **guidance)
            velocities.extend(v.unflatten(0, (len(chunk), size)).unbind(0))
        return velocities

    def _plan(self, batch: dict[str, Any], trained: list[int], *, use_jagg: bool, jagg_frac: float = 1.0) -> list:
        args = self.args
        return plan_groups(
            [float(batch["sigmas"][k]) for k in trained],
            args.jagg_group_size if use_jagg else 1,
            jagg_frac if use_jagg else 0.0,
            args.jagg_mode if use_jagg else "exact",
        )

    def _update(self, model: torch.nn.Module, batch: dict[str, Any]) -> EngineResult:
        if "dropped_frac" in batch:
            self._metrics["zero_advantage/dropped_frac"].append(batch["dropped_frac"])
            if batch["latents"].shape[0] == 0:  # every sample had a zero advantage (single process only)
                return EngineResult()
        args = self.args
        fns = self._step_functions(model, batch)
        jagg_frac = args.jagg_frac
        if args.use_jagg and jagg_frac == "auto":
            jagg_frac = self._auto_jagg_frac(batch, fns)
        engine = JaggEngine(
            fns.velocity_fn,
            fns.loss_fn,
            self._backward,
            sync_context=lambda is_last: self._backward_unit(model, is_last),
            loss_weight=1.0 / (len(fns.trained) * self.current_gradient_accumulation_steps),
            cached_velocities=self._cached_velocities(model, batch, fns.trained) if args.use_jagg else None,
            no_grad_velocities_fn=fns.no_grad_velocities_fn,
            endpoint_backward=args.jagg_endpoint_backward,
        )
        result = engine.run(self._plan(batch, fns.trained, use_jagg=args.use_jagg, jagg_frac=jagg_frac))

        # The per-step diagnostics stay on the device until here: one sync per update, not five per step. The loss
        # and diagnostics are per process: log every process's mean, averaged (as TRL's GRPOTrainer does).
        names = ["loss", *fns.stats]
        local = [torch.tensor(result.loss, device=self.accelerator.device, dtype=torch.float32)]
        local += [torch.stack(fns.stats[n]).float().mean() for n in fns.stats]
        means = self.accelerator.gather(torch.stack(local)[None]).mean(dim=0).tolist()
        for name, value in zip(names, means):
            self._metrics[name if name != "ratio_mean" else "ratio"].append(value)
        self._metrics["jagg/groups_jagg"].append(result.num_jagg_groups)
        self._metrics["jagg/groups_exact"].append(result.num_exact_groups)
        self._metrics["jagg/backward_calls"].append(result.num_backward)
        self._metrics["jagg/cached_velocities"].append(result.num_cached)
        self._metrics["jagg/no_grad_forwards"].append(result.num_no_grad_forwards)
        return result

    def _backward(self, loss: torch.Tensor) -> None:
        """``accelerator.backward``; under DeepSpeed without its own division by the accumulation steps: the engine's
        loss weight already has it (the Trainer passes ``scale_wrt_gas=False`` for the same reason)."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.accelerator.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def _backward_unit(self, model: torch.nn.Module, is_last: bool) -> contextlib.AbstractContextManager:
        """The context of one backward unit of a micro-batch: all but the last defer the gradient reduction (DDP's
        ``no_sync``) or, under DeepSpeed, the optimizer step: accelerate's DeepSpeed backward steps the engine after
        every backward call of a boundary micro-batch, which would step once per unit. ZeRO-2 reduces at every
        backward call anyway; the engine accumulates them until the single step."""
        if is_last:
            return contextlib.nullcontext()
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return _deepspeed_step_deferred(self.accelerator)
        return self.accelerator.no_sync(model)

    def _auto_jagg_frac(self, batch: dict[str, Any], fns: _StepFunctions) -> float:
        """``jagg_frac="auto"``: every ``jagg_probe_steps`` optimizer steps, the JAGG-vs-exact gradient cosine of
        every full group on this micro-batch; the leading groups with cosine >= ``jagg_cos_threshold`` are routed
        to JAGG until the next probe. Cosines are averaged over processes, so every process routes alike."""
        args = self.args
        step = self.state.global_step
        if self._last_probe_step is None or step - self._last_probe_step >= args.jagg_probe_steps:
            # The unwrapped module: autograd.grad through a DDP wrapper would leave its reducer waiting.
            unwrapped = self.accelerator.unwrap_model(self.model)
            params = [p for p in unwrapped.parameters() if p.requires_grad]
            groups = self._plan(batch, fns.trained, use_jagg=True)
            joint = [g for g in groups if g.is_joint]
            diagnostics = gradient_diagnostic(
                joint,
                lambda i: self._velocities(unwrapped, batch, [fns.trained[i]])[0],
                fns.loss_fn,
                params,
                mode=args.jagg_mode,
            )
            for values in fns.stats.values():
                values.clear()  # the probe's loss evaluations are not the update's diagnostics
            cosines = [d.cosine for d in diagnostics]
            if cosines:
                device = self.accelerator.device
                cosines = self.accelerator.reduce(torch.tensor(cosines, device=device), "mean").tolist()
            self._routed_frac = leading_jagg_fraction(cosines, len(groups), args.jagg_cos_threshold)
            self._last_probe_step = step
            for i, c in enumerate(cosines):
                self._metrics[f"jagg/probe_cosine/group_{i}"].append(c)
            self._metrics["jagg/auto_frac"].append(self._routed_frac)
        return self._routed_frac

    def calibrate_jagg(self, threshold: float = 0.7, num_batches: int = 1) -> dict[str, Any]:
        """Measure, on fresh rollouts, the cosine between the JAGG and the exact gradient of every group, and the
        ``jagg_frac`` of the paper's rule: the share of leading (high-noise) groups whose cosine is >= ``threshold``.

        Every full group is evaluated as if routed to JAGG; the parameters are not updated.
        """
        model = self.accelerator.unwrap_model(self.model)
        params = [p for p in model.parameters() if p.requires_grad]
        per_group: list[list[float]] = []
        norm_ratios: list[list[float]] = []
        batches = iter(self.get_train_dataloader())
        for _ in range(num_batches):
            batch = self._generate_and_score(next(batches))
            fns = self._step_functions(model, batch)
            groups = self._plan(batch, fns.trained, use_jagg=True)
            diagnostics = gradient_diagnostic(
                [g for g in groups if g.is_joint], fns.velocity_fn, fns.loss_fn, params, mode=self.args.jagg_mode
            )
            per_group.append([d.cosine for d in diagnostics])
            norm_ratios.append([d.norm_ratio for d in diagnostics])
        cosines = torch.tensor(per_group).mean(dim=0).tolist()
        self._metrics.clear()  # the calibration rollouts are not training steps
        return {
            "group_cosine": cosines,
            "group_norm_ratio": torch.tensor(norm_ratios).mean(dim=0).tolist(),
            "threshold": threshold,
            "jagg_frac": leading_jagg_fraction(cosines, len(groups), threshold),
            "jagg_group_size": self.args.jagg_group_size,
        }

    @torch.no_grad()
    def _reference_means(self, batch: dict[str, Any], trained: list[int]) -> dict[int, torch.Tensor]:
        """Means of the reference model's step Gaussians (base weights) for the KL term, the backbone calls of all
        trained steps batched (see :meth:`_velocities`)."""
        args = self.args
        transformer = self.accelerator.unwrap_model(self.model)
        context = contextlib.nullcontext()
        if self.ref_transformer is not None:
            transformer = self.ref_transformer
        else:
            context = _adapters_disabled(transformer)
        with context:
            velocities = self._velocities(transformer, batch, trained)
        _reshard(transformer)
        sigmas = batch["sigmas"]
        return {
            k: sampler_step(
                v,
                batch["latents"][:, k],
                sigmas[k],
                sigmas[k + 1],
                sampler=args.sampler,
                noise_level=args.noise_level,
                sigma_max=sigmas[1],
            ).mean  # fmt: skip
            for k, v in zip(trained, velocities)
        }

    # ------------------------------------------------------------------ logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update({key: sum(values) / len(values) for key, values in self._metrics.items() if values})
        super().log(logs, start_time)
        self._metrics.clear()
        if self._completions is not None:
            from .trainer.image_logging import log_completions

            prompts, images, scores = self._completions
            self._completions = None  # each rollout is logged once
            if self.is_world_process_zero():
                log_completions(self, prompts, images, scores, self.state.global_step, self.args.num_generations)

    def sample_images(self, prompts: Sequence[str] | None = None, seed: int | None = None) -> list:
        """Render prompts (default: ``eval_prompts``) with deterministic ODE sampling and the current weights."""
        args = self.args
        transformer = self.accelerator.unwrap_model(self.model)
        was_training = transformer.training
        transformer.eval()
        with self.ema_weights():
            images = self._render(prompts if prompts is not None else args.eval_prompts, seed)
        _reshard(transformer)
        transformer.train(was_training)
        return images

    def _render(self, prompts: Sequence[str], seed: int | None) -> list:
        args = self.args
        with self._frozen_on_accelerator(self._text_encoders + self._vae):
            return generate_images(
                self.adapter,
                list(prompts),
                num_steps=args.eval_num_inference_steps or args.num_inference_steps,
                height=args.height,
                width=args.width,
                guidance_scale=args.guidance_scale,
                true_cfg_scale=args.true_cfg_scale,
                negative_prompt=self._negative_prompt,
                max_sequence_length=args.max_sequence_length,
                seed=args.eval_seed if seed is None else seed,
            )

    def evaluate(
        self,
        eval_dataset: Dataset | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Render the held-out prompts with deterministic ODE sampling (``eval_num_inference_steps``, the EMA weights
        when enabled), score them with the reward functions and log the means through ``Trainer.log``.

        Metrics follow the ``Trainer`` convention, ``{metric_key_prefix}_reward``, ``..._reward_std`` and
        ``..._rewards/<name>/mean`` (W&B and the other ``report_to`` trackers show them as ``eval/...``); the first
        16 images are logged as a grid under ``eval_samples/``. Each process renders its share of the prompts.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError(
                "evaluate() needs held-out prompts: pass eval_dataset= to DDPOJaggTrainer or to evaluate()."
            )
        start = time.perf_counter()
        args = self.args
        transformer = self.accelerator.unwrap_model(self.model)
        was_training = transformer.training
        transformer.eval()
        with self.accelerator.split_between_processes(list(range(len(dataset)))) as rows:
            records = [dataset[i] for i in rows]
        prompts = [prompt_text(record["prompt"], "eval_dataset 'prompt'") for record in records]
        images = []
        with self.ema_weights():
            for begin in range(0, len(prompts), args.per_device_eval_batch_size):
                batch = prompts[begin : begin + args.per_device_eval_batch_size]
                # A seed per batch, from its first row: deterministic for a given process count and batch size.
                images.extend(self._render(batch, args.eval_seed + rows[begin]))
        _reshard(transformer)
        transformer.train(was_training)
        per_reward: dict[str, list[float]] = {}
        if prompts:
            columns = {key: [record[key] for record in records] for key in records[0] if key != "prompt"}
            total, parts = compute_rewards(
                self.reward_funcs, prompts, images, args.reward_weights, trainer_state=self.state, **columns
            )
            per_reward = {"reward": total.tolist(), **{name: value.tolist() for name, value in parts.items()}}
        gathered: dict[str, list[float]] = defaultdict(list)
        for part in gather_object([per_reward]):  # one dict per process, in rank order
            for name, values in part.items():
                gathered[name].extend(values)
        metrics = {}
        for name, values in gathered.items():
            values = torch.tensor(values, dtype=torch.float64)
            values = values[~values.isnan()]  # a reward's None (not applicable) is NaN
            key = f"{metric_key_prefix}_reward" if name == "reward" else f"{metric_key_prefix}_rewards/{name}"
            metrics[key if name == "reward" else f"{key}/mean"] = values.mean().item()
            metrics[f"{key}_std" if name == "reward" else f"{key}/std"] = values.std().item()
        metrics[f"{metric_key_prefix}_samples"] = len(gathered["reward"])
        metrics[f"{metric_key_prefix}_runtime"] = time.perf_counter() - start
        if self.is_world_process_zero() and images:
            from .trainer.image_logging import log_image_grid

            log_image_grid(
                self, images[:16], prompts[:16], self.state.global_step, name=f"{metric_key_prefix}_samples"
            )
        super().log(metrics)  # not self.log: the training metrics of the current step are not evaluation metrics
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    @contextlib.contextmanager
    def ema_weights(self):
        """The EMA weights in place of the trained ones for the duration of the block (a no-op without EMA)."""
        if self.ema is None:
            yield
            return
        params = self._trainable_parameters()
        self.ema.store(params)
        self.ema.copy_to(params)
        try:
            yield
        finally:
            self.ema.restore(params)

    # ------------------------------------------------------------------ saving
    @property
    def is_lora(self) -> bool:
        return self.peft_config is not None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """:meth:`transformers.Trainer.train`, after checking the checkpoint to resume from: its files must be
        present, readable and match the model (errors name the file and the mismatch)."""
        if resume_from_checkpoint is True:
            last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
            if last is None:
                raise CheckpointError(
                    f"resume_from_checkpoint=True, but {self.args.output_dir} holds no checkpoint-N folder. Start "
                    "without resuming, or give the path of a checkpoint."
                )
            resume_from_checkpoint = last
        if resume_from_checkpoint:
            self._check_checkpoint(resume_from_checkpoint)
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _check_checkpoint(self, path: str) -> None:
        check_checkpoint_dir(path, self.args.output_dir)
        transformer = self.accelerator.unwrap_model(self.model)
        if self.is_lora:
            files = weight_files(path, LORA_WEIGHTS_NAME, "LoRA")
            expected = get_peft_model_state_dict(transformer)
            prefix = f"{self.adapter.pipeline_class.transformer_name}."
        else:
            files = weight_files(path, FULL_WEIGHTS_PATTERN, "full fine-tuning")
            expected, prefix = transformer.state_dict(), ""
        check_weights(files, {key: tuple(value.shape) for key, value in expected.items()}, prefix)
        check_state_files(path, json_files=(TRAINER_STATE_NAME, GRPO_STATE_NAME))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """:meth:`transformers.Trainer.save_model`, refusing non-finite weights and refusing to replace existing
        weights with a model that has trained 0 steps."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        params = [_local_tensor(p) for p in self.model.parameters() if p.requires_grad]
        finite = bool(torch.stack([torch.isfinite(p).all() for p in params]).all()) if params else True
        if self._any_process(not finite):
            raise NonFiniteError(
                f"The weights hold NaN or infinite values at step {self.state.global_step}: not saved to "
                f"{output_dir}. {self._last_checkpoint_note()} {NON_FINITE_FIX}"
            )
        existing = [f for f in (LORA_WEIGHTS_NAME, FULL_WEIGHTS_PATTERN) if glob.glob(os.path.join(output_dir, f))]
        if self._any_process(self.state.global_step == 0 and bool(existing)):
            raise TrainingError(
                f"Refusing to replace the weights in {output_dir} with a model that has trained 0 steps. Train "
                "first, or save to another directory."
            )
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """LoRA in the diffusers format ``pipe.load_lora_weights`` reads; full fine-tuning as ``save_pretrained``;
        with the scheduler config (``scheduler/``) and the model card (``README.md``), as TRL writes one at every
        save."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # `state_dict` is the gathered full state dict under FSDP / DeepSpeed (Trainer.save_model passes it).
        transformer = self.accelerator.unwrap_model(self.model)
        if state_dict is None and is_fully_sharded(transformer):
            # Sharded by the trainer (fully_shard_backbone): a collective every rank joins; the main process gets
            # the full tensors (only the trainable ones for LoRA: the base weights are the base model's).
            state_dict = get_model_state_dict(
                transformer,
                options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.is_lora),
            )
        if not self.args.should_save:
            return
        self._save_weights(output_dir, state_dict)
        if self.ema is not None:
            # Beside the trained weights and in their format: `load_lora_weights(f"{output_dir}/ema")` loads them.
            with self.ema_weights():
                self._save_weights(os.path.join(output_dir, EMA_DIR), None)
        # The schedule sampled in training (a recipe may override the base model's, DanceGRPO's shift 3), so that
        # the weights plus this folder reproduce it.
        self.adapter.pipeline.scheduler.save_pretrained(os.path.join(output_dir, SCHEDULER_FOLDER))
        torch.save(_without_secrets(self.args), os.path.join(output_dir, TRAINING_ARGS_NAME))
        self._write_model_card(output_dir, **self._model_card_kwargs)

    def _save_weights(self, output_dir: str, state_dict: dict | None) -> None:
        os.makedirs(output_dir, exist_ok=True)
        transformer = self.accelerator.unwrap_model(self.model)
        if self.is_lora:
            self.adapter.pipeline_class.save_lora_weights(
                output_dir,
                transformer_lora_layers=get_peft_model_state_dict(transformer, state_dict=state_dict),
                # Without the metadata a lora_alpha != r adapter reloads with the wrong scale.
                transformer_lora_adapter_metadata=self.peft_config.to_dict(),
            )
        elif state_dict is None:
            transformer.save_pretrained(output_dir)
        else:
            transformer.save_config(output_dir)
            save_torch_state_dict(
                state_dict, output_dir, filename_pattern="diffusion_pytorch_model{suffix}.safetensors"
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        self._load_grpo_state(resume_from_checkpoint)
        transformer = self.accelerator.unwrap_model(model if model is not None else self.model)
        if self.ema is not None:
            ema_dir = os.path.join(resume_from_checkpoint, EMA_DIR)
            if not os.path.isdir(ema_dir):
                raise ValueError(
                    f"ema_decay={self.args.ema_decay} but {resume_from_checkpoint} has no {EMA_DIR}/ folder (it was "
                    "saved without EMA). Resume with ema_decay=0, or start a new run."
                )
            # Load the EMA weights through the model, take them as the average, then load the trained ones.
            self._load_checkpoint_weights(transformer, ema_dir)
            device = "cpu" if self.args.ema_offload else None
            self.ema.shadow_params = [
                p.detach().to(device=device, dtype=torch.float32).clone()
                for p in transformer.parameters()
                if p.requires_grad
            ]
        self._load_checkpoint_weights(transformer, resume_from_checkpoint)

    def _load_checkpoint_weights(self, transformer: torch.nn.Module, folder: str) -> None:
        if self.is_lora:
            (path,) = weight_files(folder, LORA_WEIGHTS_NAME, "LoRA")
            prefix = f"{self.adapter.pipeline_class.transformer_name}."
            state = {k.removeprefix(prefix): v for k, v in _load_weights(path).items()}
            # `set_peft_model_state_dict` ignores missing keys: `train` compared the keys and shapes first.
            if is_fully_sharded(transformer):
                _load_full_state_dict(transformer, _lora_state_in_model_keys(transformer, state, path), strict=False)
            else:
                result = set_peft_model_state_dict(transformer, state)
                if getattr(result, "unexpected_keys", None):
                    raise CheckpointError(f"{path} has keys the adapter lacks: {result.unexpected_keys[:5]}")
        else:
            state = {}
            for file in weight_files(folder, FULL_WEIGHTS_PATTERN, "full fine-tuning"):
                state.update(_load_weights(file))
            if is_fully_sharded(transformer):
                _load_full_state_dict(transformer, state, strict=True)
            else:
                transformer.load_state_dict(state, strict=True)

    def _save_grpo_state(self, output_dir: str) -> None:
        """The micro-batch counter (rollout buffer position, random trained steps) and the per-prompt reward
        history: identical on every process (it is updated with gathered rewards), written once."""
        state = {
            "step": self._step,
            "stat_tracker": None
            if self.stat_tracker is None
            else {prompt: list(values) for prompt, values in self.stat_tracker.history.items()},
        }
        with open(os.path.join(output_dir, GRPO_STATE_NAME), "w") as f:
            json.dump(state, f)  # floats round-trip exactly through JSON

    def _load_grpo_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, GRPO_STATE_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"No {GRPO_STATE_NAME} in {checkpoint}: not a checkpoint of this trainer.")
        with open(path) as f:
            state = json.load(f)
        self._step = state["step"]
        self._buffered_inputs = None
        if self.stat_tracker is not None:
            self.stat_tracker.history.clear()
            for prompt, values in (state["stat_tracker"] or {}).items():
                self.stat_tracker.history[prompt].extend(values)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.fully_shard_backbone:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The base class saves the main process's optimizer, which here holds only its shards: gather the full
        # state (a collective), so the checkpoint loads on any number of processes.
        state = get_optimizer_state_dict(
            self.model,
            _torch_optimizer(self.optimizer),
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.args.fully_shard_backbone or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
        set_optimizer_state_dict(
            self.model, _torch_optimizer(self.optimizer), state, options=StateDictOptions(full_state_dict=True)
        )
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # Accumulation micro-batches before the last keep unreduced gradients; the base class reads a
        # transformers-only config attribute to choose between HSDP and FSDP, and the backbone here is plain FSDP.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Write ``checkpoint-N`` atomically: into a staging folder, renamed once complete."""
        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final_dir, staging_dir = os.path.join(run_dir, name), os.path.join(run_dir, f"tmp-{name}")
        if self.args.should_save and os.path.isdir(staging_dir):
            shutil.rmtree(staging_dir)  # left by an interrupted save
        self.accelerator.wait_for_everyone()
        self.save_model(staging_dir, _internal_call=True)
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(staging_dir)
            self._save_scaler(staging_dir)
            self._save_rng_state(staging_dir)
        if self.args.should_save:
            for callback in [*self.callback_handler.callbacks, self.control]:
                if isinstance(callback, ExportableState):
                    self.state.stateful_callbacks[callback.__class__.__name__] = callback.state()
            self.state.save_to_json(os.path.join(staging_dir, TRAINER_STATE_NAME))
            self._save_grpo_state(staging_dir)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if os.path.isdir(final_dir):
                shutil.rmtree(final_dir)
            os.replace(staging_dir, final_dir)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub:
            self._push_from_checkpoint(final_dir)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's checkpoint push with this trainer's files: the weights (``MODEL_FILES``: LoRA or
        ``diffusion_pytorch_model*.safetensors`` + config), scheduler and card are copied from the checkpoint into
        ``output_dir``, which is uploaded without the checkpoint and staging folders (``HUB_IGNORE_PATTERNS``)."""
        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
            return
        if not args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return  # the previous push is still uploading
        self.callback_handler.on_push_begin(args, self.state, self.control)
        for pattern in MODEL_FILES:
            for source in glob.glob(os.path.join(checkpoint_folder, pattern)):
                target = os.path.join(args.output_dir, os.path.basename(source))
                if os.path.isdir(source):
                    shutil.copytree(source, target, dirs_exist_ok=True)
                else:
                    shutil.copy(source, target)
        torch.save(_without_secrets(args), os.path.join(args.output_dir, TRAINING_ARGS_NAME))
        if args.save_strategy == SaveStrategy.STEPS:
            message = f"Training in progress, step {self.state.global_step}"
        else:
            message = f"Training in progress, epoch {int(self.state.epoch)}"
        jobs = [self._upload(args.output_dir, message, run_as_future=True)]
        if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            path_in_repo = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else None
            jobs.append(
                self._upload(
                    checkpoint_folder, message + ", checkpoint", run_as_future=True,
                    path_in_repo=path_in_repo or os.path.basename(checkpoint_folder),
                )
            )  # fmt: skip
        if self.push_in_progress is None or self.push_in_progress.is_done():
            self.push_in_progress = PushInProgress(jobs)
        else:
            self.push_in_progress.jobs.extend(jobs)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save and upload ``output_dir`` (weights, scheduler, card) to ``hub_model_id``, as ``Trainer.push_to_hub``,
        without the checkpoint and staging folders; ``kwargs`` (``model_name``, ``dataset_name``, ``tags``) go to
        :meth:`create_model_card`."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self._model_card_kwargs.update({k: kwargs[k] for k in ("model_name", "dataset_name", "tags") if kwargs.get(k)})
        self.save_model(_internal_call=True)  # writes the card too
        if not self.is_world_process_zero():
            return None
        self._finish_current_push()
        return self._upload(
            self.args.output_dir, commit_message, run_as_future=not blocking, token=token, revision=revision
        )

    def _upload(self, folder: str, message: str | None, run_as_future: bool, **kwargs: Any) -> Any:
        """``HfApi.upload_folder`` of ``folder`` to ``hub_model_id`` (the Trainer's ``hf_api``), ignoring
        ``HUB_IGNORE_PATTERNS`` when it is ``output_dir``."""
        token = kwargs.pop("token", None) or self.args.hub_token
        revision = kwargs.pop("revision", None) or self.args.hub_revision
        ignore = HUB_IGNORE_PATTERNS if os.path.samefile(folder, self.args.output_dir) else None
        return transformers_trainer.hf_api().upload_folder(
            repo_id=self.hub_model_id, folder_path=folder, commit_message=message, token=token,
            run_as_future=run_as_future, ignore_patterns=ignore, revision=revision, **kwargs,
        )  # fmt: skip

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """Write ``README.md`` in ``output_dir`` (see :func:`~trl_jagg.trainer.model_card.write_model_card`); the
        arguments are kept for the card written at every later save."""
        self._model_card_kwargs.update(
            {k: v for k, v in {"model_name": model_name, "dataset_name": dataset_name, "tags": tags}.items() if v}
        )
        self._write_model_card(self.args.output_dir, **self._model_card_kwargs)

    def _write_model_card(
        self,
        output_dir: str,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ) -> None:
        if not self.is_world_process_zero():
            return
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        transformer = self.accelerator.unwrap_model(self.model)
        if model_name is None:
            model_name = self.args.hub_model_id or os.path.basename(os.path.normpath(self.args.output_dir))
            model_name = model_name.split("/")[-1]
        write_model_card(
            output_dir,
            base_model=self.base_model_id,
            pipeline_class=self.adapter.pipeline_class.__name__,
            transformer_class=type(transformer).__name__,
            is_lora=self.is_lora,
            args=self.args,
            reward_names=[reward_name(f) for f in self.reward_funcs],
            tags=[*self._tag_names, *extra_tags],
            guidance_is_cfg=self.adapter.guidance_is_cfg,
            embedded_guidance=bool(getattr(transformer.config, "guidance_embeds", False)),
            scheduler_class=type(self.adapter.pipeline.scheduler).__name__ if self.scheduler_overridden else None,
            samples=self._card_samples,
            model_name=model_name,
            dataset_name=dataset_name,
            hub_model_id=self.hub_model_id,
        )


@dataclass
class _StepFunctions:
    """What the engine needs for one micro-batch (see :meth:`DDPOJaggTrainer._step_functions`)."""

    trained: list[int]
    velocity_fn: Callable[[int], torch.Tensor]
    loss_fn: Callable[[int, torch.Tensor], torch.Tensor]
    no_grad_velocities_fn: Callable[[Sequence[int]], list[torch.Tensor]]
    stats: dict[str, list[torch.Tensor]]


class EMACallback(TrainerCallback):
    """Updates the trainer's EMA every ``ema_update_interval`` optimizer steps (after the step)."""

    def __init__(self, trainer: DDPOJaggTrainer):
        self.trainer = trainer

    def on_step_end(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % args.ema_update_interval == 0:
            ema = self.trainer.ema
            # EMAModel's warm-up decay at its update n is min(decay, n / (9 + n)); counting optimizer steps instead of
            # updates makes it Flow-GRPO's min(decay, (1 + t) / (10 + t)) at optimizer step t.
            ema.optimization_step = state.global_step
            params = self.trainer._trainable_parameters()
            if args.ema_offload:
                # EMAModel averages in place on the shadow's device and skips parameters without requires_grad.
                params = [p.detach().to("cpu", torch.float32).requires_grad_(True) for p in params]
            ema.step(params)


class SampleImagesCallback(TrainerCallback):
    """Renders ``eval_prompts`` every ``image_log_steps`` optimizer steps; saves a PNG grid and sends it to the
    TensorBoard / W&B / trackio trackers enabled in ``report_to``."""

    def __init__(self, trainer: DDPOJaggTrainer):
        self.trainer = trainer

    def on_step_end(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % args.image_log_steps == 0 or state.global_step == state.max_steps:
            self.log_samples(state.global_step)

    def log_samples(self, step: int) -> None:
        from .trainer.image_logging import log_image_grid, save_images

        images = self.trainer.sample_images()
        if self.trainer.is_world_process_zero():
            prompts = list(self.trainer.args.eval_prompts)
            log_image_grid(self.trainer, images, prompts, step)
            # The latest samples, one file each, are the model card's widget.
            paths = save_images(images, self.trainer.args.output_dir, os.path.join("samples", "latest"))
            self.trainer._card_samples = list(zip(prompts, paths))


class EpochSeededRepeatSampler(RepeatSampler):
    """TRL's ``RepeatSampler`` whose shuffle depends only on ``(seed, epoch)``, so a resumed run sees the order an
    uninterrupted run would (the parent draws every epoch from one generator, which a restart resets)."""

    def set_epoch(self, epoch: int) -> None:
        if self.seed is not None:
            self.generator = torch.Generator().manual_seed(self.seed + epoch)


def _scheduler_differs_from_base(scheduler: Any, base_model: str | None, revision: str | None) -> bool:
    """Whether ``scheduler``'s config differs from the base model's own (a recipe's override); ``True`` when the
    base model's cannot be read (the card then loads the saved one, which is right either way)."""
    if base_model is None:
        return True
    try:
        base = type(scheduler).load_config(base_model, subfolder=SCHEDULER_FOLDER, revision=revision)
    except Exception:  # offline without a cache, a pipeline built in memory: no reference to compare with
        return True
    return any(base.get(key) != value for key, value in scheduler.config.items() if not key.startswith("_"))


class _TrackableConfig(FrozenDict):
    """A diffusers config that also answers the transformers config API the tracker callbacks call."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)


def _check_lora_targets(transformer: torch.nn.Module, peft_config: LoraConfig) -> None:
    """Every name in a list of LoRA ``target_modules`` matches a module (peft only refuses a list matching none)."""
    targets = peft_config.target_modules
    if not isinstance(targets, (list, set, tuple)):
        return  # a regex or "all-linear": peft's own matching
    names = [name for name, _ in transformer.named_modules()]
    unmatched = sorted(t for t in targets if not any(name == t or name.endswith(f".{t}") for name in names))
    if unmatched:
        linear = sorted({n.split(".")[-1] for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})
        close = {t: difflib.get_close_matches(t, linear, n=1) for t in unmatched}
        hints = "; ".join(f"{t!r}: did you mean {c[0]!r}?" for t, c in close.items() if c)
        raise ValueError(
            f"LoraConfig.target_modules {unmatched} match no module of {type(transformer).__name__}"
            f"{' (' + hints + ')' if hints else ''}. Its linear layers are named {linear[:24]}."
        )


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({error}). Resume from an earlier checkpoint."
        ) from error


def _local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a (possibly FSDP2 DTensor) parameter."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _without_secrets(args: GRPOJaggConfig) -> GRPOJaggConfig:
    """A copy of ``args`` for ``training_args.bin`` without ``*_token`` values (the Hub token would be in clear)."""
    clean = copy.copy(args)
    for item in dataclasses.fields(args):
        if item.name.endswith("_token") and getattr(args, item.name) is not None:
            setattr(clean, item.name, None)
    return clean


def _identity_collator(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return features


def _split_rollout(rollout: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split a rollout along the batch into ``num_chunks`` micro-batches (shared entries are kept as is)."""
    size = rollout["latents"].shape[0] // num_chunks
    return [_select(rollout, slice(c * size, (c + 1) * size)) for c in range(num_chunks)]


def _select(batch: dict[str, Any], index: slice | torch.Tensor) -> dict[str, Any]:
    """The samples ``index`` of a rollout or micro-batch: its per-sample entries indexed, the shared ones kept."""
    selected = dict(batch)
    for key in ("latents", "log_probs", "advantages", "velocities"):
        if key in batch:
            selected[key] = batch[key][index]
    selected["cond"] = batch["cond"].select(index)
    return selected


@contextlib.contextmanager
def _deepspeed_step_deferred(accelerator: Any):
    """Backward calls inside are not a gradient-accumulation boundary for DeepSpeed: no engine step after them."""
    state = accelerator.gradient_state
    sync = state.sync_gradients
    state._set_sync_gradients(False)
    try:
        yield
    finally:
        state._set_sync_gradients(sync)


def _reshard(transformer: torch.nn.Module) -> None:
    """Free the gathered parameters of an FSDP2 root after forward-only (no-grad) use: FSDP2 keeps the root's
    parameters unsharded after forward, for the backward that would follow, and a no-grad pass has none."""
    if is_fully_sharded(transformer):
        transformer.reshard()


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _lora_state_in_model_keys(
    transformer: torch.nn.Module, state: dict[str, torch.Tensor], path: str
) -> dict[str, torch.Tensor]:
    """A saved diffusers LoRA (adapter name stripped, as ``get_peft_model_state_dict`` writes it) under the
    backbone's own parameter names, for loading into sharded parameters."""
    adapter = next(iter(transformer.peft_config))
    names = {name.replace(f".{adapter}.", "."): name for name, _ in transformer.named_parameters() if "lora_" in name}
    unexpected = sorted(set(state) - set(names))
    if unexpected:
        raise ValueError(f"Checkpoint {path} has keys the adapter lacks: {unexpected[:5]}")
    return {names[key]: value for key, value in state.items()}


def _load_full_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool) -> None:
    """Load full (unsharded) tensors, present on every rank, into an FSDP2-sharded backbone."""
    set_model_state_dict(transformer, state, options=StateDictOptions(full_state_dict=True, strict=strict))


@contextlib.contextmanager
def _adapters_disabled(transformer: torch.nn.Module):
    """The base weights of a LoRA-adapted diffusers backbone: the reference policy for the KL term."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


__all__ = ["EMA_DIR", "DDPOJaggTrainer", "EMACallback", "SampleImagesCallback"]
