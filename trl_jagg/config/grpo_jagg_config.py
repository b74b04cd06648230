"""Configuration of :class:`~trl_jagg.DDPOJaggTrainer`: GRPO for flow models with JAGG group gradients."""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from transformers import TrainingArguments

from trl_jagg.config.advantages import AdvantageArguments, reward_kwargs_mapping
from trl_jagg.config.checks import (
    check_activation_checkpointing,
    check_training_arguments,
    check_types_and_finiteness,
    resolve_generation_batch,
)
from trl_jagg.config.groups import (
    EMAArguments,
    EvaluationArguments,
    JaggArguments,
    ModelArguments,
    ScalingArguments,
)
from trl_jagg.config.objective import ObjectiveArguments
from trl_jagg.config.policy_loss import PolicyLossArguments
from trl_jagg.config.rules import check_settings_without_effect
from trl_jagg.config.sampling import SamplingArguments, TrainedStepsArguments
from trl_jagg.recipes import get_recipe
from trl_jagg.utils.prompts import check_prompts
from trl_jagg.utils.redaction import redacted


@dataclass
class GRPOJaggConfig(
    EvaluationArguments,
    ScalingArguments,
    JaggArguments,
    EMAArguments,
    AdvantageArguments,
    PolicyLossArguments,
    ObjectiveArguments,
    TrainedStepsArguments,
    SamplingArguments,
    ModelArguments,
    TrainingArguments,
):
    r"""
    Configuration class for [`DDPOJaggTrainer`].

    Only the parameters specific to GRPO on flow models and to JAGG are listed here; see
    [`~transformers.TrainingArguments`] for the rest (optimizer, logging, saving, `report_to`, `push_to_hub`, ...).
    Some defaults differ from `TrainingArguments`: `logging_steps=1`, `remove_unused_columns=False`,
    `learning_rate=1e-4`, `per_device_train_batch_size=8`.

    Parameters:
        > Model loading

        dtype (`str`, defaults to `"float32"`): dtype the pipeline is loaded in when `model` is a Hub id or a path.
        model_revision (`str`, *optional*): revision of the model to load.
        gradient_checkpointing (inherited): diffusers' `enable_gradient_checkpointing()` (`every_n_layers`: docs/config.md).

        > Sampling (rollouts)

        num_generations, num_inference_steps, height, width, num_frames, guidance_scale, guidance_scale_2, true_cfg_scale,
        negative_prompt, sampler, noise_level, reward_on_predicted_x0, sample_batch_size, max_sequence_length, steps_per_generation,
        generation_batch_size, source_image_area.

        > Training (which steps, which loss)

        objective, nft_beta, nft_decay_type, train_timesteps, train_timestep_fraction, sde_window_size, sde_window_max_start, sde_window_schedule,
        sde_window_stride, sde_window_shift_interval, ode_solver_order, ode_step_ratio, epsilon (formerly clip_range),
        epsilon_high, adv_clip_max, beta, kl_std, ratio_normalization, step_gradient_reweighting, cfg_gradient,
        quantize_timesteps, same_group_noise, num_iterations,
        scale_rewards, advantage_std_ddof, advantage_eps, per_prompt_stat_tracking, stat_tracking_buffer_size,
        drop_zero_advantages, reward_weights, reward_kwargs, multi_objective_aggregation, overlap_rewards,
        reward_retries, reward_timeout.

        > EMA of the trained weights

        ema_decay, ema_update_interval, ema_schedule, ema_warmup, ema_offload.

        > JAGG

        use_jagg, jagg_group_size, jagg_frac, jagg_probe_steps, jagg_cos_threshold, jagg_mode,
        jagg_cache_velocities, jagg_cache_mode, jagg_cache_tolerance, jagg_endpoint_backward, no_grad_batch_steps.

        > Distributed and memory

        fully_shard_backbone, offload_frozen_modules, precompute_prompt_embeds.

        > Speed

        compile_repeated_blocks, compile_backend.

        > Evaluation

        eval_prompts, eval_source_images, eval_num_inference_steps, eval_seed, image_log_steps, log_completions; with
        an `eval_dataset`, the inherited `eval_strategy` / `eval_steps` / `per_device_eval_batch_size` run
        `DDPOJaggTrainer.evaluate`.

    Fields that mean what a field of TRL's `GRPOConfig` means carry TRL's name (`num_generations`, `beta`,
    `num_iterations`, `epsilon`, `epsilon_high`, `scale_rewards` (also boolean), `steps_per_generation`,
    `generation_batch_size`, `reward_weights`, `multi_objective_aggregation`, `log_completions`).

    Every field's `help` text is the reference (see `docs/config.md`, generated from it).
    """

    _types_checked_later: ClassVar[tuple[str, ...]] = ("eval_prompts", "scale_rewards", "fsdp")
    """Fields with their own type check: eval_prompts prompt by prompt (conversations allowed), scale_rewards also
    takes TRL's booleans, fsdp takes True as transformers documents (`fsdp=True` turns FSDP on) though annotated
    `str | None`."""

    # ---- TrainingArguments defaults that differ ----
    learning_rate: float = field(default=1e-4, metadata={"help": "Initial learning rate of the optimizer."})
    logging_steps: float = field(default=1, metadata={"help": "Log every X optimizer steps."})
    per_device_train_batch_size: int = field(
        default=8,
        metadata={
            "help": "Images (not prompts) per device per micro-batch. `per_device_train_batch_size * num_processes * "
            "steps_per_generation` must be a multiple of `num_generations`."
        },
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={
            "help": "Every trainable backbone parameter takes part in each velocity call, so DDP skips the search. "
            "Wan2.2 A14B training both experts on several processes sets it to True: each backward call reaches one "
            "expert, and DDP's search also reduces the gradient the other accumulated under `no_sync`."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep every dataset column: extra columns are passed to the reward functions as kwargs."},
    )
    dataloader_pin_memory: bool = field(default=False, metadata={"help": "Off: prompts have nothing to pin."})

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> GRPOJaggConfig:
        """A preset reproducing a public recipe (see :mod:`trl_jagg.recipes`, ``docs/models.md``), with
        ``overrides`` on top; ``output_dir`` is required.

        Example: ``GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir="runs/sd35", max_steps=500)``.
        Names: ``flow-grpo-sd35``, ``flow-grpo-flux``, ``flow-grpo-qwenimage``, ``flow-grpo-fast-flux``,
        ``dancegrpo-flux`` (``trl_jagg.recipes.list_recipes()``).
        """
        recipe = get_recipe(name)
        recipe.warn_if_deprecated()
        if not overrides.get("output_dir"):
            raise ValueError(
                f"from_recipe({name!r}) needs output_dir=...: where checkpoints, logs and the trained weights go."
            )
        known = {item.name for item in fields(cls) if item.init}
        for key in overrides:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"{cls.__name__} has no field {key!r}.{hint}")
        return cls(**{**recipe.config, **overrides})

    def __post_init__(self) -> None:
        # A YAML or flag scalar where a list is expected means a list of one (as for `reward_funcs`): one eval
        # prompt, not one prompt per character.
        if isinstance(self.eval_prompts, str):
            self.eval_prompts = [self.eval_prompts]
        if isinstance(self.eval_source_images, str):
            self.eval_source_images = [self.eval_source_images]
        if isinstance(self.reward_weights, numbers.Real) and not isinstance(self.reward_weights, bool):
            self.reward_weights = [self.reward_weights]
        self.reward_kwargs = reward_kwargs_mapping(self.reward_kwargs)
        type(self).clip_range.resolve(self)  # the former name of epsilon: moved to it, with a FutureWarning
        # Before TrainingArguments uses any value: a wrong type or a NaN would fail there without naming the field.
        check_types_and_finiteness(self)
        # TRL's boolean form (a flag or a YAML value arrives as a string).
        flag = {"true": "group", "false": "none"}
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in flag:
            self.scale_rewards = flag[str(self.scale_rewards).lower()]
        if self.eval_prompts is not None:
            self.eval_prompts = check_prompts(self.eval_prompts, "GRPOJaggConfig.eval_prompts")
        # This config's own fields first: a bad value is named the same way on any machine, before the Trainer's
        # checks of the machine (bf16 on a CPU, ...) can stop on something else.
        check_training_arguments(self)
        self._check_model_fields()
        self._check_sampling_fields()
        self._check_trained_steps_fields()
        self._check_objective_fields()
        self._check_scaling_fields()
        self._check_policy_loss_fields()
        self._check_advantage_fields()
        self._check_ema_fields()
        self._check_jagg_fields()
        self._check_evaluation_fields()
        check_settings_without_effect(self)  # before transformers resolves its aliases, dropping one
        self._warn_clip_range_scale()
        super().__post_init__()
        check_activation_checkpointing(self)  # transformers' field, parsed and its alias resolved just above
        resolve_generation_batch(self)  # needs the number of processes

    def to_dict(self) -> dict[str, Any]:
        """The fields as ``TrainingArguments.to_dict`` gives them (what trackers record, through ``to_json_string``
        and ``to_sanitized_dict`` too), with every secret redacted (:mod:`trl_jagg.utils.redaction`): a key inside
        ``reward_kwargs`` or a URL would otherwise reach TensorBoard, W&B and the Hub."""
        fields = super().to_dict()
        del fields["clip_range"]  # the former name of epsilon, which is there
        return redacted(fields)

    def __repr__(self) -> str:
        # The dataclass repr would show every field in clear (hub_token and reward_kwargs included).
        shown = "".join(f"{key}={value!r},\n" for key, value in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{shown})"

    __str__ = __repr__

    @property
    def prompts_per_rollout(self) -> int:
        """Distinct prompts one rollout draws from the dataset (on all processes together)."""
        return self.generation_batch_size // self.num_generations
