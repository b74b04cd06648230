"""The checks of :class:`~trl_jagg.GRPOJaggConfig`'s fields: the allowed values, types, ranges and the combinations
that cannot work, each failing early with the field's name and the fix, and the generation batch derived from the
others (run by ``GRPOJaggConfig.__post_init__``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import typing
import warnings
from typing import TYPE_CHECKING, Any

from trl_jagg.config.field_types import type_problem
from trl_jagg.core.grpo import MULTI_OBJECTIVE_AGGREGATIONS
from trl_jagg.core.jagg import ENDPOINT_BACKWARDS, JAGG_MODES
from trl_jagg.core.nft import OLD_POLICY_DECAY_TYPES
from trl_jagg.core.sampling import SAMPLERS
from trl_jagg.core.sde_window import WINDOW_SCHEDULES, max_window_start
from trl_jagg.core.velocity_cache import VELOCITY_CACHE_MODES
from trl_jagg.recipes import RECIPES
from trl_jagg.utils.redaction import redacted

if TYPE_CHECKING:
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig

TRAIN_SAMPLERS = tuple(s for s in SAMPLERS if s != "ode")
GAUSSIAN_SAMPLERS = ("sde", "dance")  # log-probs are true Gaussian log-densities (CPS drops the constants)
OBJECTIVES = ("grpo", "nft")
TRAIN_TIMESTEPS = ("all_but_last", "all", "random", "random_but_last", "sde_window")
SCALE_REWARDS = ("group", "batch", "none")
KL_STDS = ("step", "flow_grpo")
EMA_SCHEDULES = ("step", "flow_grpo")
CFG_GRADIENTS = ("both", "conditional")
TRAIN_EXPERTS = ("both", "high_noise", "low_noise")  # Wan2.2 A14B's; models/wan_experts.py maps them to experts
DTYPES = ("float32", "bfloat16", "float16")
MAX_NOISE_LEVEL = 2.0
CLIP_RANGE_SLACK = 100.0
"""How far (a factor) a clip range may lie outside the recipes' (1e-5 .. 1e-3, Flow-GRPO's Wan2.1 the widest) before
the config warns about its scale: TRL's token default 0.2 warns."""


def check_types_and_finiteness(config: GRPOJaggConfig) -> None:
    """Every field given a value other than its default has its annotated type (the types the CLI flags
    convert to; YAML values reach the dataclass unconverted), and every float is finite (``nan < 0`` is
    false, so a NaN passes any range check)."""
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if not item.init or value is item.default or (type(value) is type(item.default) and value == item.default):
            continue
        problem = None if item.name in type(config)._types_checked_later else type_problem(value, hints[item.name])
        if problem is not None:
            raise TypeError(f"GRPOJaggConfig.{item.name} is {value!r} ({type(value).__name__}); expected {problem}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        for number in values:
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"GRPOJaggConfig.{item.name} is {value!r}. Use a finite number.")
    fsdp = config.fsdp
    if not (
        fsdp is None
        or isinstance(fsdp, (bool, str))
        or (isinstance(fsdp, list) and all(isinstance(o, str) for o in fsdp))
    ):
        # transformers takes any truthy value as "FSDP on".
        raise TypeError(
            f"GRPOJaggConfig.fsdp is {fsdp!r} ({type(fsdp).__name__}); expected true or false, or a string of "
            "FSDP options ('full_shard auto_wrap')."
        )
    # Before `_resolve_generation_batch` divides by them, and before the multiple-of-G check, which 0 passes.
    # per_device_eval_batch_size too: 0 would stop the first evaluation, which runs before that step's save.
    names = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    for name in (*names, "steps_per_generation"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"GRPOJaggConfig.{name} is {value}. Use 1 or more.")


def reward_kwargs_mapping(value: Any) -> dict | None:
    """``GRPOJaggConfig.reward_kwargs`` as a mapping: a flag's JSON text parsed (TrainingArguments' dict fields take
    the same form); the entries are checked against the rewards by ``load_reward_funcs``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(
                # The text is not shown: it may hold a key, and cannot be parsed to redact it.
                f"GRPOJaggConfig.reward_kwargs is not JSON ({error}). Give a JSON object, e.g. "
                """--reward_kwargs '{"vlm-judge": {"url": "http://localhost:8080/v1"}}'."""
            ) from None
    if value is not None and not isinstance(value, dict):
        raise TypeError(
            f"GRPOJaggConfig.reward_kwargs is {redacted(value)!r} ({type(value).__name__}); expected a mapping from "
            "reward names to their keyword arguments, or None."
        )
    return value


def check_fields(config: GRPOJaggConfig) -> None:
    check_trackers_installed(config)

    def fail(name: str, problem: str, fix: str) -> None:
        raise ValueError(f"GRPOJaggConfig.{name} {problem}. {fix}")

    if config.output_dir is not None and os.path.isfile(config.output_dir):
        fail(
            "output_dir",
            f"{config.output_dir} is a file",
            "Checkpoints and weights need a directory: use another path.",
        )
    if config.dtype not in DTYPES:
        fail("dtype", f"is {config.dtype!r}", f"Use one of {DTYPES}.")
    if config.num_generations < 2:
        fail("num_generations", f"is {config.num_generations}", "GRPO needs at least 2 images per prompt.")
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        fail(
            "max_steps",
            f"is {config.max_steps} with num_train_epochs={config.num_train_epochs}: the run would train 0 steps",
            "Set max_steps > 0 or num_train_epochs > 0.",
        )
    if config.learning_rate < 0:
        fail("learning_rate", f"is {config.learning_rate}", "Use a value >= 0 (1e-4 for LoRA is typical).")
    for name in ("weight_decay", "max_grad_norm"):
        if getattr(config, name) < 0:
            fail(name, f"is {getattr(config, name)}", "Use a value >= 0.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            fail(name, f"is {getattr(config, name)}", "Use a value in [0, 1).")
    if not config.adam_epsilon > 0:
        # Adam divides by sqrt(v) + epsilon: a parameter whose gradient is 0 would become 0 / 0.
        fail("adam_epsilon", f"is {config.adam_epsilon}", "Use a positive value (1e-8, the default).")
    for name in ("seed", "data_seed", "eval_seed"):
        value = getattr(config, name)
        if value is not None and not 0 <= value < 2**32:
            fail(name, f"is {value}", "Use a seed in [0, 2**32) (numpy's seeds are 32-bit).")
    if config.save_strategy == "steps" and not config.save_steps > 0:
        fail(
            "save_steps",
            f"is {config.save_steps} with save_strategy='steps': no checkpoint would ever be saved",
            "Use a positive interval, or save_strategy='no'.",
        )
    if config.num_inference_steps < 2:
        fail("num_inference_steps", f"is {config.num_inference_steps}", "Use at least 2 steps.")
    for name in ("height", "width"):
        if getattr(config, name) <= 0 or getattr(config, name) % 16:
            fail(name, f"is {getattr(config, name)}", "Use a positive multiple of 16 (8x VAE and 2x2 packing).")
    if config.num_frames is not None and (not isinstance(config.num_frames, int) or config.num_frames < 1):
        fail("num_frames", f"is {config.num_frames!r}", "Use a positive number of frames (Wan: 4 k + 1, e.g. 33).")
    if config.guidance_scale_2 is not None and not config.guidance_scale_2 > 1:
        fail(
            "guidance_scale_2",
            f"is {config.guidance_scale_2!r}",
            "Wan2.2's low-noise CFG scale applies where guidance_scale > 1 turns CFG on: use a value > 1, or None.",
        )
    if config.train_experts not in TRAIN_EXPERTS:
        fail("train_experts", f"is {config.train_experts!r}", f"Use one of {TRAIN_EXPERTS} (Wan2.2 A14B).")
    if config.sampler not in TRAIN_SAMPLERS:
        fail("sampler", f"is {config.sampler!r}", f"Use one of {TRAIN_SAMPLERS} (the ODE step has no log-prob).")
    if config.noise_level <= 0:
        # All training samplers are stochastic: without noise the step has no log-probability to train.
        fail(
            "noise_level",
            f"is {config.noise_level} with sampler={config.sampler!r}",
            "The trained steps must be stochastic: use a value > 0 (0.7 for SD3.5, 0.9 for Flux; eta 0.3 for dance).",
        )
    if config.sampler == "cps" and config.noise_level > 1:
        fail("noise_level", f"is {config.noise_level} with sampler='cps'", "CPS takes a value in (0, 1].")
    if config.sampler != "cps" and config.noise_level > MAX_NOISE_LEVEL:
        # The first SDE step (and dance's last) multiplies the latent by 1 - a^2 / 2 in its mean: above 2 the
        # step amplifies it, and the rollout's latents grow without bound.
        fail(
            "noise_level",
            f"is {config.noise_level} with sampler={config.sampler!r}: above {MAX_NOISE_LEVEL} a step's mean "
            "amplifies the latent (by a^2 / 2 - 1) and the rollout diverges",
            f"Use a value in (0, {MAX_NOISE_LEVEL}] (0.7 for SD3.5, 0.9 for Flux; eta 0.3 for dance).",
        )
    if config.guidance_scale < 0:
        fail("guidance_scale", f"is {config.guidance_scale}", "Use a value >= 0 (3.5 for Flux.1-dev, 4.5 for SD3.5).")
    if config.true_cfg_scale < 1:
        fail("true_cfg_scale", f"is {config.true_cfg_scale}", "Use 1 (off) or more (4 for Qwen-Image).")
    if config.train_timesteps not in TRAIN_TIMESTEPS:
        fail("train_timesteps", f"is {config.train_timesteps!r}", f"Use one of {TRAIN_TIMESTEPS}.")
    if not 0 < config.train_timestep_fraction <= 1:
        fail("train_timestep_fraction", f"is {config.train_timestep_fraction}", "Use a value in (0, 1].")
    _check_nft(config, fail)
    if (config.train_timesteps == "sde_window") != (config.sde_window_size > 0):
        fail(
            "train_timesteps",
            f"is {config.train_timesteps!r} with sde_window_size={config.sde_window_size}",
            "Flow-GRPO-Fast trains exactly its SDE window: set both train_timesteps='sde_window' and "
            "sde_window_size >= 1, or neither.",
        )
    if not 0 <= config.sde_window_size < config.num_inference_steps:
        fail("sde_window_size", f"is {config.sde_window_size}", "Use 0 (off) or fewer than num_inference_steps.")
    last_start = max_window_start(config.sde_window_schedule, config.num_inference_steps, config.sde_window_size)
    if config.sde_window_max_start is not None and not 0 <= config.sde_window_max_start <= last_start:
        fail(
            "sde_window_max_start",
            f"is {config.sde_window_max_start}",
            f"Use a value in [0, {last_start}].",
        )
    if config.sde_window_schedule not in WINDOW_SCHEDULES:
        fail("sde_window_schedule", f"is {config.sde_window_schedule!r}", f"Use one of {WINDOW_SCHEDULES}.")
    for name in ("sde_window_stride", "sde_window_shift_interval"):
        if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
            fail(name, f"is {getattr(config, name)!r}", "Use an integer >= 1.")
    if config.ode_solver_order not in (1, 2, 3):
        fail("ode_solver_order", f"is {config.ode_solver_order!r}", "Use 1 (Euler), 2 or 3 (DPM-Solver++).")
    if not 0 < config.ode_step_ratio <= 1:
        fail("ode_step_ratio", f"is {config.ode_step_ratio}", "Use a fraction in (0, 1] (1 keeps every step).")
    if config.sde_window_size == 0:
        for name, off in (("sde_window_schedule", "random"), ("ode_solver_order", 1), ("ode_step_ratio", 1.0)):
            # NFT's rollout is all ODE: its solver order acts on every step.
            if getattr(config, name) != off and not (name == "ode_solver_order" and config.objective == "nft"):
                fail(
                    name,
                    f"is {getattr(config, name)!r} without an SDE window (sde_window_size=0)",
                    "It acts on the SDE window and the ODE steps around it: set sde_window_size >= 1 "
                    "(with train_timesteps='sde_window'), or leave it at its default.",
                )
    if config.compile_repeated_blocks:
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if config.compile_backend not in backends:
            fail("compile_backend", f"is {config.compile_backend!r}", f"Use one of {sorted(backends)}.")
    if config.clip_range <= 0:
        name = "epsilon" if config.epsilon is not None else "clip_range"
        fail(name, f"is {config.clip_range}", "Use a positive value (1e-4 for SDE, 1e-5 for CPS).")
    if config.epsilon_high is not None and config.epsilon_high <= 0:
        fail("epsilon_high", f"is {config.epsilon_high}", "Use a positive value, or None for the lower clip range.")
    if config.adv_clip_max <= 0:
        fail("adv_clip_max", f"is {config.adv_clip_max}", "Use a positive value (5 in Flow-GRPO).")
    if config.beta < 0:
        fail("beta", f"is {config.beta}", "Use 0 (no KL) or a positive weight.")
    if config.num_iterations < 1:
        fail("num_iterations", f"is {config.num_iterations}", "Use 1 or more.")
    if config.scale_rewards not in SCALE_REWARDS:
        fail("scale_rewards", f"is {config.scale_rewards!r}", f"Use one of {SCALE_REWARDS}.")
    if config.per_prompt_stat_tracking and config.scale_rewards == "none":
        fail(
            "scale_rewards",
            "is 'none' with per_prompt_stat_tracking=True",
            "The stat tracker scales by a std: use 'group' or 'batch', or turn the tracker off.",
        )
    if config.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        fail(
            "multi_objective_aggregation",
            f"is {config.multi_objective_aggregation!r}",
            f"Use one of {MULTI_OBJECTIVE_AGGREGATIONS}.",
        )
    if config.multi_objective_aggregation == "normalize_then_sum" and (
        config.per_prompt_stat_tracking or config.scale_rewards == "none"
    ):
        conflict = "per_prompt_stat_tracking=True" if config.per_prompt_stat_tracking else "scale_rewards='none'"
        fail(
            "multi_objective_aggregation",
            f"is 'normalize_then_sum' with {conflict}",
            "normalize_then_sum normalises by group and batch stds of the current batch: turn the stat tracker "
            "off and keep scale_rewards 'group' or 'batch', or use 'sum_then_normalize'.",
        )
    if config.advantage_std_ddof not in (0, 1):
        fail("advantage_std_ddof", f"is {config.advantage_std_ddof!r}", "Use 0 (population std) or 1 (unbiased).")
    if not config.advantage_eps >= 0:
        fail("advantage_eps", f"is {config.advantage_eps}", "Use a value >= 0 (1e-4 or 1e-8 are typical).")
    if config.kl_std not in KL_STDS:
        fail("kl_std", f"is {config.kl_std!r}", f"Use one of {KL_STDS}.")
    if config.ratio_normalization and config.sampler not in GAUSSIAN_SAMPLERS:
        fail(
            "ratio_normalization",
            f"is on with sampler={config.sampler!r}, whose log-prob has no Gaussian normalisation",
            f"Use a sampler in {GAUSSIAN_SAMPLERS}, or ratio_normalization=False.",
        )
    if config.cfg_gradient not in CFG_GRADIENTS:
        fail("cfg_gradient", f"is {config.cfg_gradient!r}", f"Use one of {CFG_GRADIENTS}.")
    if not 0 <= config.ema_decay < 1:
        fail(
            "ema_decay",
            f"is {config.ema_decay}",
            "Use a value in [0, 1): 0 disables the EMA, 0.9-0.9999 are typical.",
        )
    if not isinstance(config.ema_update_interval, int) or config.ema_update_interval < 1:
        fail("ema_update_interval", f"is {config.ema_update_interval!r}", "Use an integer >= 1.")
    if config.ema_decay > 0 and 0 < config.max_steps < config.ema_update_interval:
        _warn_no_effect(
            f"GRPOJaggConfig.ema_update_interval ({config.ema_update_interval}) is larger than max_steps "
            f"({config.max_steps}): the EMA is never updated and stays the initial weights. Use an interval <= "
            "max_steps, or ema_decay=0."
        )
    if config.ema_offload and config.ema_decay == 0:
        _warn_no_effect(
            "GRPOJaggConfig.ema_offload=True does nothing with ema_decay=0 (no EMA is kept). Set ema_decay > 0 "
            "(0.995 in DanceGRPO), or drop ema_offload."
        )
    if config.ema_schedule not in EMA_SCHEDULES:
        fail("ema_schedule", f"is {config.ema_schedule!r}", f"Use one of {EMA_SCHEDULES}.")
    if not isinstance(config.jagg_group_size, int) or config.jagg_group_size < 1:
        fail("jagg_group_size", f"is {config.jagg_group_size!r}", "Use an integer >= 1 (4 or 8 are typical).")
    if isinstance(config.jagg_frac, bool):
        # bool is an int in Python: True would silently mean 1.0.
        fail("jagg_frac", f"is {config.jagg_frac!r}, not a fraction", "Use a fraction in [0, 1] or 'auto'.")
    if isinstance(config.jagg_frac, str) and config.jagg_frac != "auto":
        try:
            config.jagg_frac = float(config.jagg_frac)
        except ValueError:
            fail("jagg_frac", f"is {config.jagg_frac!r}", "Use a fraction in [0, 1] or 'auto'.")
    if config.jagg_frac != "auto" and not (isinstance(config.jagg_frac, (int, float)) and 0 <= config.jagg_frac <= 1):
        fail("jagg_frac", f"is {config.jagg_frac!r}", "Use a fraction in [0, 1] (0.6 in the paper) or 'auto'.")
    if not isinstance(config.jagg_probe_steps, int) or config.jagg_probe_steps < 1:
        fail("jagg_probe_steps", f"is {config.jagg_probe_steps!r}", "Use an integer >= 1.")
    if not -1 <= config.jagg_cos_threshold <= 1:
        fail("jagg_cos_threshold", f"is {config.jagg_cos_threshold}", "Use a cosine in [-1, 1] (0.7 is typical).")
    if config.jagg_endpoint_backward not in ENDPOINT_BACKWARDS:
        fail("jagg_endpoint_backward", f"is {config.jagg_endpoint_backward!r}", f"Use one of {ENDPOINT_BACKWARDS}.")
    if config.jagg_cache_mode not in VELOCITY_CACHE_MODES:
        fail("jagg_cache_mode", f"is {config.jagg_cache_mode!r}", f"Use one of {VELOCITY_CACHE_MODES}.")
    if not (isinstance(config.jagg_cache_tolerance, (int, float)) and config.jagg_cache_tolerance >= 0):
        fail("jagg_cache_tolerance", f"is {config.jagg_cache_tolerance!r}", "Use a number >= 0 (the default is 1e-3).")
    if config.no_grad_batch_steps is not None and (
        not isinstance(config.no_grad_batch_steps, int) or config.no_grad_batch_steps < 1
    ):
        fail("no_grad_batch_steps", f"is {config.no_grad_batch_steps!r}", "Use an integer >= 1 or None.")
    if config.jagg_mode not in JAGG_MODES:
        fail("jagg_mode", f"is {config.jagg_mode!r}", f"Use one of {JAGG_MODES}.")
    for name in (
        "sample_batch_size",
        "max_sequence_length",
        "source_image_area",
        "eval_num_inference_steps",
        "stat_tracking_buffer_size",
        "num_completions_to_print",
    ):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            fail(name, f"is {getattr(config, name)}", "Use a positive value, or None for the default.")
    if config.image_log_steps < 0:
        fail("image_log_steps", f"is {config.image_log_steps}", "Use 0 (off) or a positive interval.")
    sources = config.eval_source_images
    if sources is not None and len(sources) != len(config.eval_prompts or ()):
        fail(
            "eval_source_images",
            f"has {len(sources)} images for {len(config.eval_prompts or ())} eval_prompts",
            "Give one source image (a file path) per eval prompt.",
        )
    if config.reward_retries < 0:
        fail("reward_retries", f"is {config.reward_retries}", "Use 0 (no retry) or more.")
    if config.reward_timeout is not None and not config.reward_timeout > 0:
        fail("reward_timeout", f"is {config.reward_timeout}", "Use a number of seconds > 0, or None (see its help).")
    trained = config.num_trained_steps
    routed = config.jagg_frac == "auto" or config.jagg_frac > 0
    if config.use_jagg and config.jagg_mode != "exact" and routed and config.jagg_group_size > trained:
        _warn_no_effect(
            f"GRPOJaggConfig.jagg_group_size ({config.jagg_group_size}) is larger than the {trained} trained "
            f"step{'s' if trained != 1 else ''} (train_timesteps={config.train_timesteps!r}, num_inference_steps="
            f"{config.num_inference_steps}): no group is full, so JAGG stays idle and every step takes an exact "
            f"backward. Use jagg_group_size <= {trained}, or use_jagg=False."
        )
    _warn_clip_range_scale(config)


def _check_nft(config: GRPOJaggConfig, fail: Any) -> None:
    """The objective and DiffusionNFT's own fields; GRPO-only settings that NFT cannot honour are refused."""
    if config.objective not in OBJECTIVES:
        fail("objective", f"is {config.objective!r}", f"Use one of {OBJECTIVES}.")
    if config.objective != "nft":
        return
    if not config.nft_beta > 0:
        fail("nft_beta", f"is {config.nft_beta}", "Use a positive guidance strength (DiffusionNFT: 1, or 0.1).")
    if config.nft_decay_type not in OLD_POLICY_DECAY_TYPES:
        fail("nft_decay_type", f"is {config.nft_decay_type!r}", f"Use one of {sorted(OLD_POLICY_DECAY_TYPES)}.")
    grpo_only = {
        "sde_window_size": (config.sde_window_size != 0, "NFT rollouts are deterministic ODE: set it to 0."),
        "drop_zero_advantages": (
            config.drop_zero_advantages,
            "NFT trains a zero-advantage sample too (optimality 1/2): set it to False.",
        ),
        "ratio_normalization": (config.ratio_normalization, "NFT has no PPO ratio: set it to False."),
    }
    for name, (is_set, fix) in grpo_only.items():
        if is_set:
            fail(name, f"is {getattr(config, name)!r} with objective='nft'", fix)


def check_activation_checkpointing(config: GRPOJaggConfig) -> None:
    """``activation_checkpointing_kwargs`` (transformers' field; ``gradient_checkpointing_kwargs`` is its alias) as
    diffusers backbones take it: ``every_n_layers``, a positive integer, checkpoints every n-th transformer block
    (``use_reentrant=False`` is accepted: it is what diffusers runs). Checked once transformers has parsed the field
    and resolved the alias."""
    kwargs = config.activation_checkpointing_kwargs or {}
    name = "activation_checkpointing_kwargs"
    if not isinstance(kwargs, dict):
        raise ValueError(f'GRPOJaggConfig.{name} is {kwargs!r}. Use a dict such as {{"every_n_layers": 2}}.')
    unknown = sorted(set(kwargs) - {"every_n_layers", "use_reentrant"})
    if unknown or kwargs.get("use_reentrant", False):
        raise ValueError(
            f"GRPOJaggConfig.{name} is {kwargs!r}: diffusers backbones take only `every_n_layers` (and "
            "`use_reentrant=False`, which they always run). Remove the other keys."
        )
    every = kwargs.get("every_n_layers", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"GRPOJaggConfig.{name}['every_n_layers'] is {every!r}. Use a positive integer: 1 checkpoints every "
            "transformer block, k every k-th."
        )
    if every > 1 and not config.activation_checkpointing:
        raise ValueError(
            f"GRPOJaggConfig.{name}['every_n_layers'] is {every} without activation checkpointing. Set "
            "activation_checkpointing=True (or gradient_checkpointing=True), or remove it."
        )


TRACKER_MODULES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
    "mlflow": (("mlflow",), "mlflow"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "clearml": (("clearml",), "clearml"),
    "neptune": (("neptune",), "neptune"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "codecarbon": (("codecarbon",), "codecarbon"),
}
"""``report_to`` name -> (the modules transformers' callback imports, any one will do; the package to install). The
trackers are optional dependencies: ``pip install trl-jagg`` installs none of them."""


def module_installed(name: str) -> bool:
    """``name`` can be imported (a module set to ``None`` in ``sys.modules`` is one whose import fails)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def check_trackers_installed(config: GRPOJaggConfig) -> None:
    """Every tracker named in ``report_to`` is installed; otherwise the error names the package to install (the
    Trainer would stop later, with a message about the PyTorch version for TensorBoard)."""
    names = [config.report_to] if isinstance(config.report_to, str) else list(config.report_to or [])
    for name in names:
        modules, package = TRACKER_MODULES.get(name, ((), ""))
        if modules and not any(module_installed(module) for module in modules):
            raise ValueError(
                f"GRPOJaggConfig.report_to names {name!r}, which is not installed. Install it (`pip install "
                f"{package}`), or leave it out of report_to (report_to='none' logs to the console only)."
            )


def _warn_clip_range_scale(config: GRPOJaggConfig) -> None:
    """Warn when the clip range is far from the flow-model recipes' (TRL's token default 0.2 is 2000x Flow-GRPO's
    1e-4): it then clips nearly nothing or nearly everything."""
    clipped = [recipe for recipe in RECIPES.values() if "clip_range" in recipe.config]  # GRPO's, not NFT's
    used = sorted({recipe.config["clip_range"] for recipe in clipped})
    if used[0] / CLIP_RANGE_SLACK <= config.clip_range <= used[-1] * CLIP_RANGE_SLACK:
        return
    name = "epsilon" if config.epsilon is not None else "clip_range"
    recipes = ", ".join(f"{recipe.name} {recipe.config['clip_range']:g}" for recipe in clipped)
    warnings.warn(
        f"GRPOJaggConfig.{name} is {config.clip_range:g}, more than {CLIP_RANGE_SLACK:g}x outside the clip ranges of "
        f"the flow-model recipes ({recipes}): a step's log-prob is a mean over latent dimensions, so its ratio "
        "moves far less than a token's, and a token-scale value such as TRL's 0.2 effectively never clips. Use "
        "1e-4 (SDE / Dance samplers) or 1e-5 (CPS).",
        UserWarning,
        stacklevel=3,
    )


def _warn_no_effect(message: str) -> None:
    """A setting that does nothing: a warning pointing at the user's GRPOJaggConfig(...) call."""
    warnings.warn(message, UserWarning, stacklevel=5)


def resolve_generation_batch(config: GRPOJaggConfig) -> None:
    """``steps_per_generation`` and ``generation_batch_size`` from whichever is set, as TRL's GRPOConfig."""
    per_step = config.per_device_train_batch_size * config.world_size
    if config.generation_batch_size is None:
        if config.steps_per_generation is None:
            config.steps_per_generation = config.gradient_accumulation_steps
        config.generation_batch_size = per_step * config.steps_per_generation
    elif config.generation_batch_size < 1 or config.generation_batch_size % per_step:
        raise ValueError(
            f"GRPOJaggConfig.generation_batch_size ({config.generation_batch_size}) is not a positive multiple of "
            f"per_device_train_batch_size ({config.per_device_train_batch_size}) x processes ({config.world_size}) "
            f"= {per_step}. Use a multiple, or set steps_per_generation instead."
        )
    steps = config.generation_batch_size // per_step
    if config.steps_per_generation is not None and config.steps_per_generation != steps:
        raise ValueError(
            f"GRPOJaggConfig.generation_batch_size ({config.generation_batch_size}) and steps_per_generation "
            f"({config.steps_per_generation}) disagree: {config.generation_batch_size} images are {steps} "
            f"micro-batches of {per_step}. Set only one of them."
        )
    config.steps_per_generation = steps
    if config.generation_batch_size % config.num_generations:
        raise ValueError(
            f"GRPOJaggConfig.per_device_train_batch_size ({config.per_device_train_batch_size}) x processes "
            f"({config.world_size}) x steps_per_generation ({config.steps_per_generation}) = generation_batch_size "
            f"{config.generation_batch_size} is not a multiple of num_generations ({config.num_generations}). "
            "Choose sizes that make whole prompt groups."
        )
