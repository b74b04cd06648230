"""DDPOJaggTrainer: GRPO for text-to-image flow models on the TRL trainer API, with JAGG group gradients.

The GRPO loop in TRL's terms: prepare inputs (a rollout every ``steps_per_generation x num_iterations``
micro-batches) -> generate and score (:mod:`trl_jagg.trainer.generation`) -> update each micro-batch
(the objective's update stage, :mod:`trl_jagg.objectives`) -> log, evaluate (:mod:`~trl_jagg.trainer.evaluation`), save
(:mod:`~trl_jagg.trainer.checkpointing`), push (:mod:`~trl_jagg.trainer.hub`). Everything else (optimizer,
scheduler, logging, ``report_to``, checkpoints, resume, ``push_to_hub``) is ``transformers.Trainer``.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from torch.utils.data import Sampler
from transformers import TrainerCallback, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy
from transformers.utils.hub import PushInProgress
from trl.trainer.base_trainer import _BaseTrainer

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.config.objective_registry import get_objective
from trl_jagg.models import load_adapter
from trl_jagg.objectives.update import StageInputs
from trl_jagg.rewards import reward_name
from trl_jagg.trainer import checkpointing, hub
from trl_jagg.trainer.backbone import has_active_dropout, prepare_backbone
from trl_jagg.trainer.batch import RolloutBatch, without_zero_advantages
from trl_jagg.trainer.conditioning import PromptConditioner
from trl_jagg.trainer.data import EpochSeededRepeatSampler, identity_collator
from trl_jagg.trainer.ema import EMACallback, EMAWeights, ema_swapped_in
from trl_jagg.trainer.evaluation import Evaluator, SampleImagesCallback
from trl_jagg.trainer.files import EMA_DIR
from trl_jagg.trainer.generation import RolloutGenerator
from trl_jagg.trainer.guards import stop_if_non_finite
from trl_jagg.trainer.hacking_watch import RewardHackingWatch
from trl_jagg.trainer.image_logging import eval_images_key, log_completions, log_image_grid, save_images
from trl_jagg.trainer.inputs import checked_inputs, checked_model_inputs
from trl_jagg.trainer.interrupts import InterruptCallback, interrupted
from trl_jagg.trainer.metrics import first_completions, logged_means
from trl_jagg.trainer.peer_watch import peers_watched
from trl_jagg.trainer.placement import FrozenModules
from trl_jagg.trainer.scoring import RewardFailure
from trl_jagg.utils import distributed
from trl_jagg.utils.hub_access import check_hub_file
from trl_jagg.utils.prompts import prompt_text
from trl_jagg.utils.quiet import quiet_deepspeed_cpu_notice

RewardFunc = Callable[..., list[float]]


class DDPOJaggTrainer(_BaseTrainer):
    """GRPO trainer for flow-matching pipelines (``trl_jagg.MODEL_FAMILIES``), with JAGG.

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

    _tag_names = ["trl", "trl-jagg", "grpo", "diffusers"]  # the card adds the task's (text-to-image, ...)
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
        quiet_deepspeed_cpu_notice()  # accelerate imports DeepSpeed (when installed) to unwrap the model
        args = args if args is not None else GRPOJaggConfig("grpo-jagg")
        if not isinstance(args, GRPOJaggConfig):
            raise TypeError(f"`args` must be a GRPOJaggConfig, got {type(args).__name__}.")
        # The config is the user's data: the trainer settles some fields for transformers.Trainer (the checkpointing
        # switches it enables itself, DDP's unused parameters), on its own copy, so one config serves many trainers.
        args = copy.copy(args)
        # A launch that silently runs fewer processes stops here, before anything is loaded.
        distributed.check_world_size(args.world_size)
        # Seed before the adapter is created: Trainer seeds only in its own __init__, after LoRA init.
        set_seed(args.seed)
        # Cheap checks first: nothing is loaded before the inputs are known to be usable. The model is named before
        # a reward's weights when both are unreachable: it is the first thing a user gives.
        if isinstance(model, str):
            check_hub_file(model, "model_index.json", what="model", revision=args.model_revision)
        train_dataset, eval_dataset, self.reward_funcs = checked_inputs(
            args, train_dataset, eval_dataset, reward_funcs
        )
        self.base_model_id = model if isinstance(model, str) else (model.name_or_path or None)
        # The frozen encoders stay whole: they run outside the DeepSpeed engine.
        with distributed.zero3_init_disabled(args):
            self.adapter = load_adapter(model, dtype=getattr(torch, args.dtype), revision=args.model_revision)
        self.train_buckets = checked_model_inputs(self.adapter, args, train_dataset, eval_dataset, self.reward_funcs)
        self.scheduler_overridden = hub.scheduler_differs_from_base(
            self.adapter.pipeline.scheduler, self.base_model_id, args.model_revision
        )
        # For the card written at every save: what `create_model_card` was last told, the latest sample images.
        self._model_card_kwargs: dict[str, Any] = {}
        self._card_samples: list[tuple[str, str]] = []
        self.peft_config = peft_config
        transformer, self.ref_transformer = prepare_backbone(self.adapter, args, peft_config)
        self.weights = checkpointing.WeightsIO(self.adapter, peft_config)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._step = 0  # micro-batches consumed: the rollout buffer position
        # Set by Trainer's loop for each accumulation window; defined here for updates run outside `train()`.
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self._buffered_inputs: list[dict[str, Any]] | None = None

        super().__init__(
            model=transformer,
            args=args,
            data_collator=identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=None,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        accelerator = self.accelerator
        distributed.check_backend(
            accelerator.distributed_type, accelerator.num_processes, fsdp_requested=bool(args.fsdp),
            fully_shard_backbone=args.fully_shard_backbone, deepspeed_plugin=accelerator.state.deepspeed_plugin,
            fsdp_plugin=getattr(accelerator.state, "fsdp_plugin", None),
        )  # fmt: skip
        self.frozen = FrozenModules(self.adapter, self.accelerator.device, offload=args.offload_frozen_modules)
        self.frozen.place(transformer)
        self.conditioner = PromptConditioner(self.adapter, args, self.frozen)
        if args.precompute_prompt_embeds and isinstance(train_dataset, Dataset):
            self.conditioner.precompute([prompt_text(p, "train_dataset 'prompt'") for p in train_dataset["prompt"]])
        if self.ref_transformer is not None:
            self.ref_transformer.to(self.accelerator.device)
        self.ref_transformer = distributed.shard_backbones(
            transformer, self.ref_transformer, args.fully_shard_backbone, self.accelerator.is_fsdp2,
            deepspeed_plugin=accelerator.state.deepspeed_plugin,
        )  # fmt: skip
        if args.fully_shard_backbone:
            # transformers' switch for a model sharded before the Trainer sees it: no DDP wrap (DDP rejects DTensor
            # parameters), the optimizer built on the shards, every rank inside `_save` for the gathers.
            self.is_distributed_loading_by_transformers = True
        self.adapter.refresh_placement()
        self.generation = RolloutGenerator(
            self.adapter, args, self.accelerator, self.reward_funcs, self.conditioner, self.frozen, self._metrics
        )
        # The objective's update stage, which also keeps its state (DiffusionNFT's old policy).
        stage_class = get_objective(args.objective).update_stage_class()
        self.update_stage = stage_class(
            self.adapter, args, self.accelerator, self._metrics,
            StageInputs(self.ref_transformer, has_active_dropout(transformer), self._trainable_parameters),
        )  # fmt: skip
        self.evaluator = Evaluator(self.adapter, args, self.accelerator, self.frozen, self.reward_funcs, eval_dataset)
        self.ema: EMAWeights | None = None
        if args.ema_decay > 0:
            self.ema = EMAWeights(args, self._trainable_parameters, accelerator=self.accelerator)
            self.add_callback(EMACallback(self.ema))
        if args.image_log_steps and args.eval_prompts:
            self.add_callback(SampleImagesCallback(self._log_samples))
        self.interrupts = InterruptCallback(self.accelerator)
        self.add_callback(self.interrupts)
        self.add_callback(RewardHackingWatch(self._metrics, lambda: self.generation.completions, self.accelerator))

    @property
    def is_lora(self) -> bool:
        return self.peft_config is not None

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

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
            sampler_fn=self._rollout_sampler,  # passed here: Trainer's private `_get_train_sampler` is not overridden
            is_training=True,
        )

    def _rollout_sampler(self, dataset: Dataset | None = None) -> Sampler:
        # Each prompt appears num_generations times in a row; the batch is repeated for every micro-batch and
        # inner iteration it feeds, so the dataloader stays aligned with the rollout buffer.
        return EpochSeededRepeatSampler(
            data_source=dataset if dataset is not None else self.train_dataset,
            mini_repeat_count=self.args.num_generations,
            batch_size=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation,
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed,
            buckets=self.train_buckets,  # a rollout's rows share their source images' grids (Qwen-Image-Edit)
        )

    # ------------------------------------------------------------------ the GRPO loop
    def training_step(
        self, model: torch.nn.Module, inputs: list[dict[str, Any]], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        model.train()
        batch = self._prepare_inputs(inputs)
        start = time.perf_counter()
        result = self.update_stage.run(
            model, batch, micro_step=self._step, global_step=self.state.global_step,
            accumulation_steps=self.current_gradient_accumulation_steps,
        )  # fmt: skip
        # Checked after the backward, before the optimizer step: the weights are still those of the last step.
        self._stop_if_non_finite("loss", result.loss)
        self._metrics["time/update_s"].append(time.perf_counter() - start)
        return torch.tensor(result.loss / self.current_gradient_accumulation_steps, device=self.accelerator.device)

    def _prepare_inputs(self, generation_batch: list[dict[str, Any]]) -> RolloutBatch:
        generate_every = self.args.steps_per_generation * self.args.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            rollout = self._generate_and_score(generation_batch)
            self._buffered_inputs = rollout.split(self.args.steps_per_generation)
            if self.args.drop_zero_advantages:
                world = self.accelerator.num_processes
                self._buffered_inputs = [without_zero_advantages(c, world) for c in self._buffered_inputs]
        inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        self._step += 1
        return inputs

    def _generate_and_score(self, inputs: list[dict[str, Any]]) -> RolloutBatch:
        """One scored rollout of a dataloader batch; when a reward fails on any process (in the rollout, or in the
        update that awaits the last rewards), every process saves a checkpoint before the error stops the run."""
        self.update_stage.before_rollout(self.state.global_step)
        with self.update_stage.sampling_weights():
            # The rollouts before this one: the micro-batch counter (saved in grpo_state.json, so it survives a
            # resume) over the micro-batches each rollout feeds.
            rollout = self._step // (self.args.steps_per_generation * self.args.num_iterations)
            return self.generation.generate(
                inputs, self.accelerator.unwrap_model(self.model), global_step=self.state.global_step,
                rollout=rollout, trainer_state=self.state, on_reward_failure=self._stop_after_reward_failure,
            )  # fmt: skip

    def _stop_after_reward_failure(self, failure: RewardFailure, during: str) -> NoReturn:
        """Save ``checkpoint-N`` of the steps trained so far (every process), then raise the error naming it."""
        step = self.state.global_step
        saved = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}") if self.is_in_train else None
        if saved and step and not os.path.isdir(saved):
            self._save_checkpoint(self.model, trial=None)
        failure.raise_with_note(saved if step else None, step, during)

    def _stop_if_non_finite(self, quantity: str, value: torch.Tensor | float | None) -> None:
        stop_if_non_finite(
            self.accelerator, quantity, value, step=self.state.global_step + 1, run_dir=self.args.output_dir
        )

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        # Trainer computes the norm after the backward and before `optimizer.step`: a NaN stops here, unapplied.
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._stop_if_non_finite("gradient norm", grad_norm)
        return grad_norm

    def calibrate_jagg(self, threshold: float = 0.7, num_batches: int = 1) -> dict[str, Any]:
        """On fresh rollouts, the JAGG-vs-exact gradient cosine of every group (each evaluated as if routed to JAGG;
        nothing is updated) and the ``jagg_frac`` of the paper's rule: the share of leading (high-noise) groups
        whose cosine is >= ``threshold``."""
        batches = iter(self.get_train_dataloader())
        rollouts = [self._generate_and_score(next(batches)) for _ in range(num_batches)]
        result = self.update_stage.calibrate(
            self.accelerator.unwrap_model(self.model), rollouts, threshold, micro_step=self._step,
            global_step=self.state.global_step,
        )  # fmt: skip
        self._metrics.clear()  # the calibration rollouts are not training steps
        return result

    # ------------------------------------------------------------------ logging and evaluation
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(logged_means(self._metrics))
        super().log(logs, start_time)
        self._metrics.clear()
        completions, self.generation.completions = self.generation.completions, None  # each rollout logged once
        if completions is not None and self.args.log_completions and self.is_world_process_zero():
            prompts, images, scores = first_completions(completions, self.args.num_completions_to_print)
            # After Trainer.log: the tracker callbacks are set up and the step's scalars went first.
            log_completions(
                self.callback_handler.callbacks, self.args.output_dir, prompts, images, scores,
                self.state.global_step, self.args.num_generations,
            )  # fmt: skip

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """The EMA weights in place of the trained ones for the duration of the block (a no-op without EMA)."""
        return ema_swapped_in(self.ema)

    def sample_images(self, prompts: Sequence[str] | None = None, seed: int | None = None, source_images=None) -> list:
        """Render prompts (default: ``eval_prompts``, with ``eval_source_images``) with deterministic ODE sampling
        and the current weights; an editing model needs ``source_images``, one per prompt (PIL images or paths)."""
        transformer = self.accelerator.unwrap_model(self.model)
        return self.evaluator.sample_images(transformer, self.ema, prompts, seed, source_images)

    def _log_samples(self, step: int) -> None:
        """Render ``eval_prompts``, log the grid, and keep the images as the model card's widget."""
        images = self.sample_images()
        if self.is_world_process_zero():
            prompts = list(self.args.eval_prompts)
            log_image_grid(self.callback_handler.callbacks, self.args.output_dir, images, prompts, step)
            paths = save_images(images, self.args.output_dir, os.path.join("samples", "latest"))
            self._card_samples = list(zip(prompts, paths))

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
        16 images are saved as a grid in ``output_dir/eval_samples/`` and sent to the trackers as
        ``eval/sample_images``. Each process renders its share of the prompts.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        try:
            metrics, images, prompts = self.evaluator.evaluate(
                self.accelerator.unwrap_model(self.model), self.ema, dataset, metric_key_prefix=metric_key_prefix,
                trainer_state=self.state,
            )  # fmt: skip
        except RewardFailure as failure:
            self._stop_after_reward_failure(failure, f"in the evaluation at step {self.state.global_step}")
        super().log(metrics)  # not self.log: the training metrics of the current step are not evaluation metrics
        if self.is_world_process_zero() and images:  # after the scalars, which set the tracker callbacks up
            log_image_grid(
                self.callback_handler.callbacks, self.args.output_dir, images[:16], prompts[:16],
                self.state.global_step, folder=f"{metric_key_prefix}_samples", key=eval_images_key(metric_key_prefix),
            )  # fmt: skip
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------ saving and resuming
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """:meth:`transformers.Trainer.train` (``True`` / ``"latest"``: the last checkpoint), checking its files first.

        SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) stops it after the optimizer step in progress with a
        checkpoint of every trained step, then raises :class:`~trl_jagg.utils.errors.TrainingInterrupted` naming it; a
        second signal stops at once (:mod:`trl_jagg.trainer.interrupts`)."""
        resume_from_checkpoint = checkpointing.resume_path(resume_from_checkpoint, self.args.output_dir)
        if resume_from_checkpoint:
            transformer = self.accelerator.unwrap_model(self.model)
            plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)  # resumes from optimizer.pt
            self.weights.check(resume_from_checkpoint, transformer, self.args, ema=self.ema, optimizer_files=plain)
        try:  # a process lost on another node raises PeerLost, naming it (trainer/peer_watch.py)
            with peers_watched(self.args, lambda: self.state.global_step):
                output = super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)
        finally:
            self.interrupts.restore()  # also when training raised: Ctrl-C must work again after train()
        if self.interrupts.signal_number is not None:
            raise interrupted(self.interrupts.signal_number, self.args.output_dir, self.state.global_step)
        return output

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """:meth:`transformers.Trainer.save_model`, refusing non-finite weights, and a model that has trained 0 steps
        over existing weights or beside a run's checkpoints."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        params = [p for p in self.model.parameters() if p.requires_grad]
        checkpointing.check_saveable(
            self.accelerator, params, output_dir, global_step=self.state.global_step, run_dir=self.args.output_dir,
            ema=self.ema,
        )  # fmt: skip
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """LoRA in the diffusers format ``pipe.load_lora_weights`` reads; full fine-tuning as ``save_pretrained``;
        with the EMA, the scheduler config and the model card (``README.md``), as TRL writes one at every save."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        transformer = self.accelerator.unwrap_model(self.model)
        # `state_dict` is the gathered full state dict under FSDP / DeepSpeed (Trainer.save_model passes it).
        states = self.weights.gathered_state_dicts(transformer, state_dict, self.ema)  # weights, EMA weights
        if not self.args.should_save:
            return
        self.weights.save_model_folder(output_dir, transformer, states, self.ema, self.args, self.state.global_step)
        self._write_model_card(output_dir, **self._model_card_kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        self._step = checkpointing.load_grpo_state(resume_from_checkpoint, self.generation.stat_tracker)
        self._buffered_inputs = None
        transformer = self.accelerator.unwrap_model(model if model is not None else self.model)
        self.weights.load_resumed(transformer, resume_from_checkpoint, self.ema, trained=not self.is_deepspeed_enabled)
        self.update_stage.load_state(resume_from_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not distributed.is_fully_sharded(self.model):  # FSDP2 writes the full state, not the plugin's files
            with checkpointing.optimizer_write_named(output_dir):  # torch's error names no file
                return super()._save_optimizer_and_scheduler(output_dir)
        checkpointing.save_full_optimizer_state(
            self.model, self.optimizer, self.lr_scheduler, output_dir, self.args.should_save
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.is_deepspeed_enabled:  # the Trainer skips _load_from_checkpoint then
            self._load_from_checkpoint(checkpoint)
        if not distributed.is_fully_sharded(self.model) or checkpoint is None:
            if checkpoint is not None and not (self.is_deepspeed_enabled or self.is_fsdp_enabled):
                checkpointing.check_optimizer_state(checkpoint, self.optimizer)
            return super()._load_optimizer_and_scheduler(checkpoint)
        checkpointing.load_full_optimizer_state(self.model, self.optimizer, self.lr_scheduler, checkpoint)

    def _defer_fsdp_gradient_reduction(self) -> contextlib.AbstractContextManager:
        # The base class reads a transformers-only config attribute to choose between HSDP and FSDP.
        return distributed.gradient_sync_deferred(self.model)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Write ``checkpoint-N`` atomically (a staging folder, renamed once complete), push it, rotate."""
        args, run_dir = self.args, self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # Trainer's best-model bookkeeping (its `_save_checkpoint`, replaced here), before trainer_state.json.
        self.state.best_model_checkpoint = checkpointing.best_checkpoint(run_dir, self.state, args.save_strategy)
        with checkpointing.atomic_checkpoint(
            run_dir, name, should_save=args.should_save, wait_for_everyone=self.accelerator.wait_for_everyone
        ) as staging_dir:
            self.save_model(staging_dir, _internal_call=True)
            if not args.save_only_model:
                self._save_optimizer_and_scheduler(staging_dir)
                self._save_scaler(staging_dir)
                self._save_rng_state(staging_dir)
            # The objective's state (every process: sharded weights are gathered).
            self.update_stage.save_state(staging_dir, checkpoint_step=self.state.global_step, write=args.should_save)
            if args.should_save:
                stateful = [*self.callback_handler.callbacks, self.control]
                checkpointing.save_run_state(
                    staging_dir, self.state, stateful, self._step, self.generation.stat_tracker, args
                )
        final_dir = os.path.join(run_dir, name)
        if args.push_to_hub:
            self._push_from_checkpoint(final_dir)
        if args.should_save:
            checkpointing.rotate_checkpoints(run_dir, args.save_total_limit, self.state.best_model_checkpoint)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the weights and EMA of ``best_model_checkpoint`` (Trainer reads its own names)."""
        transformer = self.accelerator.unwrap_model(self.model)
        self.weights.load_resumed(transformer, self.state.best_model_checkpoint, self.ema)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a text-to-image policy has no predictions to gather against labels."""
        raise NotImplementedError(
            "DDPOJaggTrainer.predict() is not supported: there are no labels to predict for prompts. Use "
            "evaluate(eval_dataset) for reward scores of held-out prompts, or sample_images(prompts) for the images."
        )

    # ------------------------------------------------------------------ the Hub
    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's checkpoint push with this trainer's files: the weights, scheduler and card are copied from the
        checkpoint into ``output_dir``, which is uploaded without the checkpoint and staging folders."""
        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
            return
        if not args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return  # the previous push is still uploading
        self.callback_handler.on_push_begin(args, self.state, self.control)
        jobs = hub.push_checkpoint(self.hub_model_id, checkpoint_folder, args, self.state)
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
        return hub.upload_folder(
            self.hub_model_id, self.args.output_dir, commit_message, args=self.args, run_as_future=not blocking,
            token=token, revision=revision,
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
        given = {"model_name": model_name, "dataset_name": dataset_name, "tags": tags}
        self._model_card_kwargs.update({k: v for k, v in given.items() if v})
        self._write_model_card(self.args.output_dir, **self._model_card_kwargs)

    def _write_model_card(self, output_dir: str, tags: str | list[str] | None = None, **kwargs: Any) -> None:
        if not self.is_world_process_zero():
            return
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        hub.write_trainer_card(
            output_dir, adapter=self.adapter, transformer=self.accelerator.unwrap_model(self.model), args=self.args,
            base_model=self.base_model_id, is_lora=self.is_lora, reward_names=[reward_name(f) for f in self.reward_funcs],
            tags=[*self._tag_names, *extra_tags], scheduler_overridden=self.scheduler_overridden,
            samples=self._card_samples, hub_model_id=self.hub_model_id, **kwargs,
        )  # fmt: skip


__all__ = ["EMA_DIR", "DDPOJaggTrainer", "EMACallback", "SampleImagesCallback"]
