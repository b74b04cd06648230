"""Configuration of :class:`~trl_jagg.DDPOJaggTrainer`: GRPO for flow models with JAGG group gradients."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import typing
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from transformers import TrainingArguments

from .field_types import type_problem
from .grpo import MULTI_OBJECTIVE_AGGREGATIONS
from .jagg import ENDPOINT_BACKWARDS, JAGG_MODES
from .prompts import check_prompts
from .recipes import RECIPES, get_recipe
from .sampling import SAMPLERS
from .sde_window import WINDOW_SCHEDULES

TRAIN_SAMPLERS = tuple(s for s in SAMPLERS if s != "ode")
GAUSSIAN_SAMPLERS = ("sde", "dance")  # log-probs are true Gaussian log-densities (CPS drops the constants)
TRAIN_TIMESTEPS = ("all_but_last", "all", "random", "random_but_last", "sde_window")
SCALE_REWARDS = ("group", "batch", "none")
KL_STDS = ("step", "flow_grpo")
EMA_SCHEDULES = ("step", "flow_grpo")
CFG_GRADIENTS = ("both", "conditional")
DTYPES = ("float32", "bfloat16", "float16")
MAX_NOISE_LEVEL = 2.0
CLIP_RANGE_SLACK = 1000.0
"""How far (a factor) a clip range may lie outside the recipes' before the config warns about its scale."""


@dataclass
class GRPOJaggConfig(TrainingArguments):
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
        gradient_checkpointing (inherited): uses diffusers' `enable_gradient_checkpointing()` on the backbone.

        > Sampling (rollouts)

        num_generations, num_inference_steps, height, width, guidance_scale, true_cfg_scale, negative_prompt,
        sampler, noise_level, reward_on_predicted_x0, sample_batch_size, max_sequence_length, steps_per_generation,
        generation_batch_size.

        > Training (which steps, which loss)

        train_timesteps, train_timestep_fraction, sde_window_size, sde_window_max_start, sde_window_schedule,
        sde_window_stride, sde_window_shift_interval, ode_solver_order, ode_step_ratio, clip_range (TRL: epsilon),
        epsilon_high, adv_clip_max, beta, kl_std, ratio_normalization, step_gradient_reweighting, cfg_gradient,
        quantize_timesteps, same_group_noise, num_iterations,
        scale_rewards, advantage_std_ddof, advantage_eps, per_prompt_stat_tracking, stat_tracking_buffer_size,
        drop_zero_advantages, reward_weights, multi_objective_aggregation, overlap_rewards, reward_retries.

        > EMA of the trained weights

        ema_decay, ema_update_interval, ema_schedule, ema_warmup, ema_offload.

        > JAGG

        use_jagg, jagg_group_size, jagg_frac, jagg_probe_steps, jagg_cos_threshold, jagg_mode,
        jagg_cache_velocities, jagg_endpoint_backward, no_grad_batch_steps.

        > Distributed and memory

        fully_shard_backbone, offload_frozen_modules, precompute_prompt_embeds.

        > Speed

        compile_repeated_blocks, compile_backend.

        > Evaluation

        eval_prompts, eval_num_inference_steps, eval_seed, image_log_steps, log_completions; with an `eval_dataset`,
        the inherited `eval_strategy` / `eval_steps` / `per_device_eval_batch_size` run `DDPOJaggTrainer.evaluate`.

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
            "help": "Every trainable backbone parameter takes part in each velocity call, so DDP skips the search."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep every dataset column: extra columns are passed to the reward functions as kwargs."},
    )

    # ---- Model loading ----
    dtype: str = field(
        default="float32",
        metadata={"help": f"dtype of the pipeline when `model` is a Hub id or a path, one of {DTYPES}."},
    )
    model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag or commit) to load."})

    # ---- Sampling ----
    num_generations: int = field(default=8, metadata={"help": "Images sampled per prompt: the GRPO group size G."})
    num_inference_steps: int = field(default=10, metadata={"help": "Denoising steps of each rollout."})
    height: int = field(default=512, metadata={"help": "Image height in pixels (a multiple of 16)."})
    width: int = field(default=512, metadata={"help": "Image width in pixels (a multiple of 16)."})
    guidance_scale: float = field(
        default=3.5,
        metadata={
            "help": "As in the diffusers pipeline: the embedded guidance of guidance-distilled models (Flux.1-dev), "
            "the classifier-free guidance scale of SD3 (1 disables it)."
        },
    )
    true_cfg_scale: float = field(
        default=1.0,
        metadata={
            "help": "True classifier-free guidance with `negative_prompt` for Flux and Qwen-Image (two backbone "
            "calls per step; 1 disables it)."
        },
    )
    negative_prompt: str = field(default="", metadata={"help": "Negative prompt for classifier-free guidance."})
    sampler: str = field(
        default="sde",
        metadata={
            "help": f"Rollout sampler, one of {TRAIN_SAMPLERS}: `sde` (Flow-GRPO), `cps` (coefficient-preserving), "
            "`dance` (DanceGRPO, constant eta)."
        },
    )
    noise_level: float = field(
        default=0.7,
        metadata={
            "help": "SDE noise level `a` (0.7 for SD3.5, 0.9 for Flux in Flow-GRPO); eta for `dance`. In (0, 2] "
            "((0, 1] for `cps`): above 2 the steps amplify the latent."
        },
    )
    reward_on_predicted_x0: bool = field(
        default=False,
        metadata={
            "help": "Decode for the rewards the last step's prediction of the clean latent, x0-hat = z - sigma v at "
            "its start (DanceGRPO), instead of the final latent, which still carries the last stochastic step's "
            "noise. The sample images and evaluations (ODE) are unchanged."
        },
    )
    sample_batch_size: int | None = field(
        default=None,
        metadata={"help": "Images per backbone call during rollouts (defaults to `per_device_train_batch_size`)."},
    )
    max_sequence_length: int | None = field(
        default=None, metadata={"help": "Maximum prompt length in tokens passed to `encode_prompt` (model default)."}
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches per rollout: one rollout of `per_device_train_batch_size * steps_per_generation` "
            "images per device feeds that many micro-batches. Defaults to `gradient_accumulation_steps`, or to "
            "what `generation_batch_size` implies."
        },
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "As in TRL's GRPOConfig: images sampled per rollout on all processes together, "
            "`per_device_train_batch_size * num_processes * steps_per_generation`. Set one of the two (the other "
            "follows); defaults to the value `steps_per_generation` gives."
        },
    )

    # ---- Training ----
    train_timesteps: str = field(
        default="all_but_last",
        metadata={
            "help": f"Which denoising steps are trained, one of {TRAIN_TIMESTEPS}: `all_but_last` (Flow-GRPO), `all`, "
            "`random` (a random `train_timestep_fraction` of the steps at every update), `random_but_last` (the same "
            "among all steps but the last, as DanceGRPO) or `sde_window` (Flow-GRPO-Fast: only the steps inside the "
            "SDE window)."
        },
    )
    train_timestep_fraction: float = field(
        default=0.6,
        metadata={
            "help": "Fraction of the candidate steps trained when `train_timesteps` is `random` or `random_but_last`."
        },
    )
    sde_window_size: int = field(
        default=0,
        metadata={
            "help": "Flow-GRPO-Fast: number of consecutive SDE steps; the other steps are deterministic ODE steps. "
            "0 makes every step stochastic."
        },
    )
    sde_window_max_start: int | None = field(
        default=None,
        metadata={
            "help": "Latest first step of the SDE window. Defaults to the first half of the schedule for the "
            "`random` schedule, and to every full window that ends before the last step for `progressive`."
        },
    )
    sde_window_schedule: str = field(
        default="random",
        metadata={
            "help": f"Where the SDE window sits, one of {WINDOW_SCHEDULES}: `random` (Flow-GRPO-Fast: its start "
            "drawn uniformly in [0, sde_window_max_start] at every rollout) or `progressive` (MixGRPO: it starts at "
            "step 0 and moves `sde_window_stride` steps later every `sde_window_shift_interval` optimizer steps, "
            "back to step 0 after sde_window_max_start)."
        },
    )
    sde_window_stride: int = field(
        default=1,
        metadata={"help": "Steps the `progressive` window moves at each shift (MixGRPO's `prog_overlap_step`)."},
    )
    sde_window_shift_interval: int = field(
        default=25,
        metadata={
            "help": "Optimizer steps between two shifts of the `progressive` window (MixGRPO's `iters_per_group`)."
        },
    )
    ode_solver_order: int = field(
        default=1,
        metadata={
            "help": "Solver of the ODE steps outside the SDE window: 1 is the Euler step; 2 or 3 is diffusers' "
            "multistep DPM-Solver++ (`DPMSolverMultistepScheduler`, flow sigmas and flow prediction; MixGRPO-Flash "
            "uses order 2), accurate on the fewer steps of `ode_step_ratio` < 1."
        },
    )
    ode_step_ratio: float = field(
        default=1.0,
        metadata={
            "help": "Fraction of the ODE steps kept on each side of the SDE window (at least one a side), on points "
            "of the schedule spread evenly over the side: each dropped step is a backbone call saved (MixGRPO-Flash's "
            "`dpm_post_compress_ratio`, which it applies after the window only). 1 keeps every step."
        },
    )
    clip_range: float = field(
        default=1e-4,
        metadata={"help": "PPO clip range epsilon (tiny because log-probs are averaged over latent dims)."},
    )
    epsilon: float | None = field(
        default=None,
        metadata={
            "help": "TRL's name of `clip_range`: when set, it is the clip range (it overrides `clip_range`). Note the "
            "scale: 1e-4 for flow models' per-dimension log-probs, not TRL's 0.2 for tokens."
        },
    )
    epsilon_high: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip range, as in TRL: the ratio is clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's "
            "clip-higher). Defaults to the lower one."
        },
    )
    adv_clip_max: float = field(
        default=5.0, metadata={"help": "Advantages are clipped to [-adv_clip_max, adv_clip_max]."}
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient against the reference model (the base weights: adapter disabled for LoRA, a "
            "frozen copy for full fine-tuning). 0 skips the reference forward."
        },
    )
    kl_std: str = field(
        default="step",
        metadata={
            "help": f"Std the KL term divides by, one of {KL_STDS}: `step`, the step Gaussian's std (the exact KL of "
            "the step), or `flow_grpo`, Flow-GRPO's `std_dev_t` (for `sde` the diffusion coefficient g without "
            "sqrt(|dt|), which makes the KL the exact one times |dt|; for `cps` the step std). `beta` means "
            "different things under the two."
        },
    )
    ratio_normalization: bool = field(
        default=False,
        metadata={
            "help": "GRPO-Guard's RatioNorm (arXiv 2510.22319, Flow-GRPO's `rationorm`): the PPO ratio of a step is "
            "exp(s (log p - log p_old) + |mu - mu_old|^2 / (2 s)), s the step's std, which removes the ratio's "
            "negative drift and puts every step on one scale. Gaussian samplers only (`sde`, `dance`); the rollout "
            "keeps its velocities to recompute mu_old. Pair it with GRPO-Guard's clip range (4e-6, not 1e-4)."
        },
    )
    step_gradient_reweighting: bool = field(
        default=False,
        metadata={
            "help": "GRPO-Guard's per-step reweighting (Flow-GRPO's `rationorm` divides each step's policy loss by "
            "|dt|): the policy term of step k is weighted by 1 / |sigma_k - sigma_{k+1}|; the KL term is not."
        },
    )
    cfg_gradient: str = field(
        default="both",
        metadata={
            "help": f"Which classifier-free guidance branches the update differentiates, one of {CFG_GRADIENTS}: "
            "`both`, or `conditional` (the unconditional prediction runs without a graph and is a constant, so the "
            "backward covers half the samples)."
        },
    )
    quantize_timesteps: bool = field(
        default=False,
        metadata={
            "help": "Floor the backbone's timestep input to a whole scheduler timestep, int(sigma * 1000) / 1000 "
            "for Flux (DanceGRPO); the sampler keeps the exact sigma."
        },
    )
    same_group_noise: bool = field(
        default=False,
        metadata={
            "help": "Start every image of a prompt group from the same initial noise (Flow-GRPO `same_latent`, "
            "DanceGRPO `init_same_noise`), drawn from a per-group seed, so a group split across processes shares it."
        },
    )
    num_iterations: int = field(
        default=1, metadata={"help": "Inner PPO epochs: optimisation passes over each rollout before sampling anew."}
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": f"Advantage scaling, one of {SCALE_REWARDS}: per-group std, the std of the whole gathered batch "
            "(a global std, Flow-GRPO's `global_std`), or none. The mean is always the group's (the prompt's). As in "
            "TRL, `True` means 'group' and `False` 'none'."
        },
    )
    advantage_std_ddof: int = field(
        default=1,
        metadata={
            "help": "Delta degrees of freedom of the advantage std: 1 is the unbiased std (torch, DanceGRPO), 0 the "
            "population std (numpy, Flow-GRPO). At G = 2 the two differ by a factor sqrt(2)."
        },
    )
    advantage_eps: float = field(
        default=1e-4,
        metadata={
            "help": "Added to the advantage std (Flow-GRPO 1e-4, DanceGRPO 1e-8); 0 is valid (a constant group's "
            "advantages are 0)."
        },
    )
    per_prompt_stat_tracking: bool = field(
        default=False,
        metadata={"help": "Normalise rewards with a per-prompt history across steps (Flow-GRPO's stat tracking)."},
    )
    stat_tracking_buffer_size: int | None = field(
        default=None, metadata={"help": "Rewards kept per prompt by the stat tracker (None: current batch only)."}
    )
    drop_zero_advantages: bool = field(
        default=False,
        metadata={
            "help": "Drop the samples whose advantage is exactly 0 (every sample of a zero-std group) from the update, "
            "as Flow-GRPO's SD3 script does: they cost no backward, and each step's loss averages over the others. "
            "Logged as `zero_advantage/dropped_frac`."
        },
    )
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight of each reward function in the total reward (defaults to 1 for each)."},
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": f"How several rewards make one advantage, one of {MULTI_OBJECTIVE_AGGREGATIONS} (TRL's names): "
            "'sum_then_normalize' sums the weighted rewards, then normalises the sum as `scale_rewards` says; "
            "'normalize_then_sum' (GDPO, Flow-Factory's 'gdpo') normalises each reward within its group first (its "
            "group std), sums them with `reward_weights`, then normalises the sum over the whole batch, so a reward "
            "with a large scale or spread cannot drown the others. With one reward the two differ only in the final "
            "std (group or batch). With 'normalize_then_sum' each reward's share is logged as "
            "`advantages/<name>/abs_mean` (the mean |weight x group-normalised reward|). Every preset keeps "
            "'sum_then_normalize' (each trains one reward)."
        },
    )
    overlap_rewards: bool = field(
        default=True,
        metadata={
            "help": "Score each rollout chunk (`sample_batch_size` images) with the rewards that score every sample on "
            "its own (a remote server, a pointwise `vlm-judge`, any reward with `per_sample = True`) in background "
            "threads while the next chunk samples, instead of after the whole rollout. The scores are the same; "
            "the step no longer waits for all but the last chunk's answers. Other rewards run after the rollout."
        },
    )
    reward_retries: int = field(
        default=0,
        metadata={
            "help": "Extra attempts for a reward function that raises (a flaky remote server, a transient CUDA "
            "error); each retry is logged. When the last attempt fails too, a checkpoint is saved before the error "
            "stops the run. Output checks (a NaN, a wrong count) are not retried."
        },
    )

    # ---- JAGG ----
    use_jagg: bool = field(
        default=True, metadata={"help": "Use JAGG group gradients in the update; False runs exact per-step backward."}
    )
    jagg_group_size: int = field(
        default=4,
        metadata={"help": "JAGG group size W: consecutive trained steps sharing one joint backward (>= 1)."},
    )
    # `str | None` in the annotation makes HfArgumentParser hand the CLI value over as text ("auto" or "0.6");
    # __post_init__ turns a number into a float.
    jagg_frac: float | str | None = field(
        default=0.6,
        metadata={
            "help": "Fraction of groups, highest noise first, routed to JAGG; the rest use exact backward. In [0, 1], "
            "or `auto`: every `jagg_probe_steps` optimizer steps, measure the JAGG-vs-exact gradient cosine of every "
            "group on one micro-batch and route the leading groups whose cosine is >= `jagg_cos_threshold`."
        },
    )
    jagg_probe_steps: int = field(
        default=50,
        metadata={"help": "With `jagg_frac=auto`: optimizer steps between two routing probes (the first at step 0)."},
    )
    jagg_cos_threshold: float = field(
        default=0.7,
        metadata={"help": "With `jagg_frac=auto`: the gradient cosine a group needs to be routed to JAGG."},
    )
    jagg_mode: str = field(
        default="jagg",
        metadata={"help": f"One of {JAGG_MODES}: `jagg`, `endpoints` (ablation without interpolation) or `exact`."},
    )
    jagg_cache_velocities: bool = field(
        default=True,
        metadata={
            "help": "Record every step's guided velocity during the rollout and use them for the intermediate steps "
            "of JAGG groups while they are exact (no optimizer step since the rollout, no active dropout, same "
            "dtype/autocast): a group then costs 2 endpoint forwards + 1 backward. Logged as `jagg/cached_velocities`."
        },
    )
    jagg_endpoint_backward: str = field(
        default="joint",
        metadata={
            "help": f"One of {ENDPOINT_BACKWARDS}: one backward through both endpoint graphs, or one per endpoint "
            "so that only one graph is alive (lower peak memory, no extra forward; under FSDP each module is "
            "gathered twice instead of once)."
        },
    )
    no_grad_batch_steps: int | None = field(
        default=None,
        metadata={
            "help": "Trained steps whose no-grad backbone forwards (KL reference, uncached JAGG intermediates) run as "
            "one batched call of `steps x micro-batch` samples: the memory cap of those calls. None: all in one "
            "call; 1: one call per step."
        },
    )

    # ---- Distributed ----
    fully_shard_backbone: bool = field(
        default=False,
        metadata={
            "help": "Shard the backbone with torch's FSDP2 `fully_shard` inside the trainer (each transformer block, "
            "then the root) over the launched processes, for launches where accelerate's FSDP plugin does not apply "
            "(CPU / gloo under `torchrun`). On GPUs use accelerate's plugin (`examples/accelerate_configs/fsdp2.yaml`)."
        },
    )

    # ---- Memory ----
    offload_frozen_modules: bool = field(
        default=False,
        metadata={
            "help": "Keep the frozen VAE and text encoders on the CPU and move each to the accelerator only while it "
            "runs (prompt encoding, latent decoding, sample images): their memory is free during the update, at the "
            "cost of one host-to-device copy of each per rollout."
        },
    )
    precompute_prompt_embeds: bool = field(
        default=False,
        metadata={
            "help": "Encode each distinct prompt once (the training set's at start, any new one when first met) and "
            "keep the embeddings on the CPU (DanceGRPO does this): the text encoders no longer run during training, "
            "and with `offload_frozen_modules` they stay on the CPU. The table costs one prompt embedding per distinct "
            "prompt in CPU memory."
        },
    )

    # ---- Speed ----
    compile_repeated_blocks: bool = field(
        default=False,
        metadata={
            "help": "Regional compilation: `torch.compile` each repeated transformer block of the backbone and of the "
            "KL reference copy (diffusers' `compile_repeated_blocks`; SD3, which declares no `_repeated_blocks`, its "
            "`_no_split_modules` blocks), for the rollout and the update alike. The first steps pay the compile time; "
            "a new batch shape compiles again."
        },
    )
    compile_backend: str = field(
        default="inductor",
        metadata={
            "help": "The `torch.compile` backend of `compile_repeated_blocks` (`aot_eager` captures the graphs "
            "without generating code: a quick check that a model compiles)."
        },
    )

    # ---- EMA ----
    ema_decay: float = field(
        default=0.0,
        metadata={
            "help": "Decay of an exponential moving average of the trained weights (Flow-GRPO 0.9, DanceGRPO 0.995); 0 "
            "disables it. The EMA weights render the sample images and evaluations and are saved in `ema/` beside "
            "the trained ones, in the same format."
        },
    )
    ema_update_interval: int = field(
        default=1,
        metadata={
            "help": "Update the EMA every N optimizer steps (Flow-GRPO 8; DanceGRPO's 8-GPU script once per rollout: "
            "its optimizer steps per rollout, steps_per_generation / gradient_accumulation_steps)."
        },
    )
    ema_schedule: str = field(
        default="step",
        metadata={
            "help": f"When the EMA updates, one of {EMA_SCHEDULES}: `step`, once after optimizer step t when "
            "t % ema_update_interval == 0; `flow_grpo`, Flow-GRPO's, which calls its EMA after every micro-batch "
            "with the optimizer steps taken so far t and updates when (t + 1) % ema_update_interval == 0: "
            "gradient_accumulation_steps updates with the weights after step t (an effective decay of "
            "ema_decay ** gradient_accumulation_steps), the warm-up decay at t."
        },
    )
    ema_warmup: bool = field(
        default=False,
        metadata={
            "help": "Flow-GRPO's (and diffusers' EMAModel's) warm-up: the decay at optimizer step t is "
            "min(ema_decay, (1 + t) / (10 + t)); False keeps it at `ema_decay` (DanceGRPO)."
        },
    )
    ema_offload: bool = field(
        default=False,
        metadata={
            "help": "Keep the EMA (float32) on the CPU, as DanceGRPO does for full fine-tuning: the accelerator holds no "
            "copy, at the cost of one device-to-host copy of the trained weights per EMA update."
        },
    )

    # ---- Evaluation images ----
    eval_prompts: list[str] | None = field(
        default=None, metadata={"help": "Prompts rendered (deterministic ODE sampling) and logged as sample images."}
    )
    eval_num_inference_steps: int | None = field(
        default=None, metadata={"help": "Denoising steps for sample images (defaults to `num_inference_steps`)."}
    )
    eval_seed: int = field(default=0, metadata={"help": "Seed of the sample images' noise."})
    image_log_steps: int = field(
        default=0,
        metadata={"help": "Render `eval_prompts` every N optimizer steps (and at the end); 0 disables it."},
    )
    log_completions: bool = field(
        default=False,
        metadata={
            "help": "As in TRL: every `logging_steps`, log the latest rollout's images with their prompts and "
            "rewards to the `report_to` trackers (a captioned grid, one row per prompt group; a table on W&B and "
            "trackio) and to `output_dir/completions/`."
        },
    )
    num_completions_to_print: int | None = field(
        default=None,
        metadata={
            "help": "As in TRL (which prints that many completions): how many of the rollout's images "
            "`log_completions` logs, in rollout order (whole prompt groups first); None logs them all."
        },
    )
    shuffle_dataset: bool = field(
        default=True,
        metadata={
            "help": "As in TRL: draw the training prompts in a shuffled order (per epoch, from `seed`); False keeps "
            "the dataset's order."
        },
    )

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> GRPOJaggConfig:
        """A preset reproducing a public recipe (see :mod:`trl_jagg.recipes`, ``docs/models.md``), with
        ``overrides`` on top; ``output_dir`` is required.

        Example: ``GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir="runs/sd35", max_steps=500)``.
        Names: ``flow-grpo-sd35``, ``flow-grpo-flux``, ``flow-grpo-qwenimage``, ``flow-grpo-fast-flux``,
        ``dancegrpo-flux`` (``trl_jagg.recipes.list_recipes()``).
        """
        recipe = get_recipe(name)
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
        if isinstance(self.reward_weights, numbers.Real) and not isinstance(self.reward_weights, bool):
            self.reward_weights = [self.reward_weights]
        # Before TrainingArguments uses any value: a wrong type or a NaN would fail there without naming the field.
        self._check_types_and_finiteness()
        if self.epsilon is not None:
            self.clip_range = self.epsilon
        # TRL's boolean form (a flag or a YAML value arrives as a string).
        flag = {"true": "group", "false": "none"}
        if isinstance(self.scale_rewards, bool) or str(self.scale_rewards).lower() in flag:
            self.scale_rewards = flag[str(self.scale_rewards).lower()]
        if self.eval_prompts is not None:
            self.eval_prompts = check_prompts(self.eval_prompts, "GRPOJaggConfig.eval_prompts")
        # This config's own fields first: a bad value is named the same way on any machine, before the Trainer's
        # checks of the machine (bf16 on a CPU, ...) can stop on something else.
        self._check()
        super().__post_init__()
        self._resolve_generation_batch()  # needs the number of processes

    def _resolve_generation_batch(self) -> None:
        """``steps_per_generation`` and ``generation_batch_size`` from whichever is set, as TRL's GRPOConfig."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size < 1 or self.generation_batch_size % per_step:
            raise ValueError(
                f"GRPOJaggConfig.generation_batch_size ({self.generation_batch_size}) is not a positive multiple of "
                f"per_device_train_batch_size ({self.per_device_train_batch_size}) x processes ({self.world_size}) "
                f"= {per_step}. Use a multiple, or set steps_per_generation instead."
            )
        steps = self.generation_batch_size // per_step
        if self.steps_per_generation is not None and self.steps_per_generation != steps:
            raise ValueError(
                f"GRPOJaggConfig.generation_batch_size ({self.generation_batch_size}) and steps_per_generation "
                f"({self.steps_per_generation}) disagree: {self.generation_batch_size} images are {steps} "
                f"micro-batches of {per_step}. Set only one of them."
            )
        self.steps_per_generation = steps
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"GRPOJaggConfig.per_device_train_batch_size ({self.per_device_train_batch_size}) x processes "
                f"({self.world_size}) x steps_per_generation ({self.steps_per_generation}) = generation_batch_size "
                f"{self.generation_batch_size} is not a multiple of num_generations ({self.num_generations}). "
                "Choose sizes that make whole prompt groups."
            )

    def _check_types_and_finiteness(self) -> None:
        """Every field given a value other than its default has its annotated type (the types the CLI flags
        convert to; YAML values reach the dataclass unconverted), and every float is finite (``nan < 0`` is
        false, so a NaN passes any range check)."""
        hints = typing.get_type_hints(type(self))
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if not item.init or value is item.default or (type(value) is type(item.default) and value == item.default):
                continue
            problem = None if item.name in self._types_checked_later else type_problem(value, hints[item.name])
            if problem is not None:
                raise TypeError(
                    f"GRPOJaggConfig.{item.name} is {value!r} ({type(value).__name__}); expected {problem}."
                )
            values = value if isinstance(value, (list, tuple)) else [value]
            for number in values:
                if isinstance(number, float) and not math.isfinite(number):
                    raise ValueError(f"GRPOJaggConfig.{item.name} is {value!r}. Use a finite number.")
        fsdp = self.fsdp
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
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"GRPOJaggConfig.{name} is {value}. Use 1 or more.")

    def _check(self) -> None:
        def fail(name: str, problem: str, fix: str) -> None:
            raise ValueError(f"GRPOJaggConfig.{name} {problem}. {fix}")

        if self.output_dir is not None and os.path.isfile(self.output_dir):
            fail(
                "output_dir",
                f"{self.output_dir} is a file",
                "Checkpoints and weights need a directory: use another path.",
            )
        if self.dtype not in DTYPES:
            fail("dtype", f"is {self.dtype!r}", f"Use one of {DTYPES}.")
        if self.num_generations < 2:
            fail("num_generations", f"is {self.num_generations}", "GRPO needs at least 2 images per prompt.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            fail(
                "max_steps",
                f"is {self.max_steps} with num_train_epochs={self.num_train_epochs}: the run would train 0 steps",
                "Set max_steps > 0 or num_train_epochs > 0.",
            )
        if self.learning_rate < 0:
            fail("learning_rate", f"is {self.learning_rate}", "Use a value >= 0 (1e-4 for LoRA is typical).")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                fail(name, f"is {getattr(self, name)}", "Use a value >= 0.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)}", "Use a value in [0, 1).")
        if not self.adam_epsilon > 0:
            # Adam divides by sqrt(v) + epsilon: a parameter whose gradient is 0 would become 0 / 0.
            fail("adam_epsilon", f"is {self.adam_epsilon}", "Use a positive value (1e-8, the default).")
        for name in ("seed", "data_seed", "eval_seed"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 2**32:
                fail(name, f"is {value}", "Use a seed in [0, 2**32) (numpy's seeds are 32-bit).")
        if self.save_strategy == "steps" and not self.save_steps > 0:
            fail(
                "save_steps",
                f"is {self.save_steps} with save_strategy='steps': no checkpoint would ever be saved",
                "Use a positive interval, or save_strategy='no'.",
            )
        if self.num_inference_steps < 2:
            fail("num_inference_steps", f"is {self.num_inference_steps}", "Use at least 2 steps.")
        for name in ("height", "width"):
            if getattr(self, name) <= 0 or getattr(self, name) % 16:
                fail(name, f"is {getattr(self, name)}", "Use a positive multiple of 16 (8x VAE and 2x2 packing).")
        if self.sampler not in TRAIN_SAMPLERS:
            fail("sampler", f"is {self.sampler!r}", f"Use one of {TRAIN_SAMPLERS} (the ODE step has no log-prob).")
        if self.noise_level <= 0:
            # All training samplers are stochastic: without noise the step has no log-probability to train.
            fail(
                "noise_level",
                f"is {self.noise_level} with sampler={self.sampler!r}",
                "The trained steps must be stochastic: use a value > 0 (0.7 for SD3.5, 0.9 for Flux; eta 0.3 for "
                "dance).",
            )
        if self.sampler == "cps" and self.noise_level > 1:
            fail("noise_level", f"is {self.noise_level} with sampler='cps'", "CPS takes a value in (0, 1].")
        if self.sampler != "cps" and self.noise_level > MAX_NOISE_LEVEL:
            # The first SDE step (and dance's last) multiplies the latent by 1 - a^2 / 2 in its mean: above 2 the
            # step amplifies it, and the rollout's latents grow without bound.
            fail(
                "noise_level",
                f"is {self.noise_level} with sampler={self.sampler!r}: above {MAX_NOISE_LEVEL} a step's mean "
                "amplifies the latent (by a^2 / 2 - 1) and the rollout diverges",
                f"Use a value in (0, {MAX_NOISE_LEVEL}] (0.7 for SD3.5, 0.9 for Flux; eta 0.3 for dance).",
            )
        if self.guidance_scale < 0:
            fail(
                "guidance_scale", f"is {self.guidance_scale}", "Use a value >= 0 (3.5 for Flux.1-dev, 4.5 for SD3.5)."
            )
        if self.true_cfg_scale < 1:
            fail("true_cfg_scale", f"is {self.true_cfg_scale}", "Use 1 (off) or more (4 for Qwen-Image).")
        if self.train_timesteps not in TRAIN_TIMESTEPS:
            fail("train_timesteps", f"is {self.train_timesteps!r}", f"Use one of {TRAIN_TIMESTEPS}.")
        if not 0 < self.train_timestep_fraction <= 1:
            fail("train_timestep_fraction", f"is {self.train_timestep_fraction}", "Use a value in (0, 1].")
        if (self.train_timesteps == "sde_window") != (self.sde_window_size > 0):
            fail(
                "train_timesteps",
                f"is {self.train_timesteps!r} with sde_window_size={self.sde_window_size}",
                "Flow-GRPO-Fast trains exactly its SDE window: set both train_timesteps='sde_window' and "
                "sde_window_size >= 1, or neither.",
            )
        if not 0 <= self.sde_window_size < self.num_inference_steps:
            fail("sde_window_size", f"is {self.sde_window_size}", "Use 0 (off) or fewer than num_inference_steps.")
        if self.sde_window_max_start is not None and not (
            0 <= self.sde_window_max_start <= self.num_inference_steps - self.sde_window_size
        ):
            fail(
                "sde_window_max_start",
                f"is {self.sde_window_max_start}",
                f"Use a value in [0, {self.num_inference_steps - self.sde_window_size}].",
            )
        if self.sde_window_schedule not in WINDOW_SCHEDULES:
            fail("sde_window_schedule", f"is {self.sde_window_schedule!r}", f"Use one of {WINDOW_SCHEDULES}.")
        for name in ("sde_window_stride", "sde_window_shift_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)!r}", "Use an integer >= 1.")
        if self.ode_solver_order not in (1, 2, 3):
            fail("ode_solver_order", f"is {self.ode_solver_order!r}", "Use 1 (Euler), 2 or 3 (DPM-Solver++).")
        if not 0 < self.ode_step_ratio <= 1:
            fail("ode_step_ratio", f"is {self.ode_step_ratio}", "Use a fraction in (0, 1] (1 keeps every step).")
        if self.sde_window_size == 0:
            for name, off in (("sde_window_schedule", "random"), ("ode_solver_order", 1), ("ode_step_ratio", 1.0)):
                if getattr(self, name) != off:
                    fail(
                        name,
                        f"is {getattr(self, name)!r} without an SDE window (sde_window_size=0)",
                        "It acts on the SDE window and the ODE steps around it: set sde_window_size >= 1 "
                        "(with train_timesteps='sde_window'), or leave it at its default.",
                    )
        if self.compile_repeated_blocks:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                fail("compile_backend", f"is {self.compile_backend!r}", f"Use one of {sorted(backends)}.")
        if self.clip_range <= 0:
            name = "epsilon" if self.epsilon is not None else "clip_range"
            fail(name, f"is {self.clip_range}", "Use a positive value (1e-4 for SDE, 1e-5 for CPS).")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            fail("epsilon_high", f"is {self.epsilon_high}", "Use a positive value, or None for the lower clip range.")
        if self.adv_clip_max <= 0:
            fail("adv_clip_max", f"is {self.adv_clip_max}", "Use a positive value (5 in Flow-GRPO).")
        if self.beta < 0:
            fail("beta", f"is {self.beta}", "Use 0 (no KL) or a positive weight.")
        if self.num_iterations < 1:
            fail("num_iterations", f"is {self.num_iterations}", "Use 1 or more.")
        if self.scale_rewards not in SCALE_REWARDS:
            fail("scale_rewards", f"is {self.scale_rewards!r}", f"Use one of {SCALE_REWARDS}.")
        if self.per_prompt_stat_tracking and self.scale_rewards == "none":
            fail(
                "scale_rewards",
                "is 'none' with per_prompt_stat_tracking=True",
                "The stat tracker scales by a std: use 'group' or 'batch', or turn the tracker off.",
            )
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            fail(
                "multi_objective_aggregation",
                f"is {self.multi_objective_aggregation!r}",
                f"Use one of {MULTI_OBJECTIVE_AGGREGATIONS}.",
            )
        if self.multi_objective_aggregation == "normalize_then_sum" and (
            self.per_prompt_stat_tracking or self.scale_rewards == "none"
        ):
            conflict = "per_prompt_stat_tracking=True" if self.per_prompt_stat_tracking else "scale_rewards='none'"
            fail(
                "multi_objective_aggregation",
                f"is 'normalize_then_sum' with {conflict}",
                "normalize_then_sum normalises by group and batch stds of the current batch: turn the stat tracker "
                "off and keep scale_rewards 'group' or 'batch', or use 'sum_then_normalize'.",
            )
        if self.advantage_std_ddof not in (0, 1):
            fail("advantage_std_ddof", f"is {self.advantage_std_ddof!r}", "Use 0 (population std) or 1 (unbiased).")
        if not self.advantage_eps >= 0:
            fail("advantage_eps", f"is {self.advantage_eps}", "Use a value >= 0 (1e-4 or 1e-8 are typical).")
        if self.kl_std not in KL_STDS:
            fail("kl_std", f"is {self.kl_std!r}", f"Use one of {KL_STDS}.")
        if self.ratio_normalization and self.sampler not in GAUSSIAN_SAMPLERS:
            fail(
                "ratio_normalization",
                f"is on with sampler={self.sampler!r}, whose log-prob has no Gaussian normalisation",
                f"Use a sampler in {GAUSSIAN_SAMPLERS}, or ratio_normalization=False.",
            )
        if self.cfg_gradient not in CFG_GRADIENTS:
            fail("cfg_gradient", f"is {self.cfg_gradient!r}", f"Use one of {CFG_GRADIENTS}.")
        if not 0 <= self.ema_decay < 1:
            fail(
                "ema_decay",
                f"is {self.ema_decay}",
                "Use a value in [0, 1): 0 disables the EMA, 0.9-0.9999 are typical.",
            )
        if not isinstance(self.ema_update_interval, int) or self.ema_update_interval < 1:
            fail("ema_update_interval", f"is {self.ema_update_interval!r}", "Use an integer >= 1.")
        if self.ema_decay > 0 and 0 < self.max_steps < self.ema_update_interval:
            self._warn(
                f"GRPOJaggConfig.ema_update_interval ({self.ema_update_interval}) is larger than max_steps "
                f"({self.max_steps}): the EMA is never updated and stays the initial weights. Use an interval <= "
                "max_steps, or ema_decay=0."
            )
        if self.ema_offload and self.ema_decay == 0:
            self._warn(
                "GRPOJaggConfig.ema_offload=True does nothing with ema_decay=0 (no EMA is kept). Set ema_decay > 0 "
                "(0.995 in DanceGRPO), or drop ema_offload."
            )
        if self.ema_schedule not in EMA_SCHEDULES:
            fail("ema_schedule", f"is {self.ema_schedule!r}", f"Use one of {EMA_SCHEDULES}.")
        if not isinstance(self.jagg_group_size, int) or self.jagg_group_size < 1:
            fail("jagg_group_size", f"is {self.jagg_group_size!r}", "Use an integer >= 1 (4 or 8 are typical).")
        if isinstance(self.jagg_frac, bool):
            # bool is an int in Python: True would silently mean 1.0.
            fail("jagg_frac", f"is {self.jagg_frac!r}, not a fraction", "Use a fraction in [0, 1] or 'auto'.")
        if isinstance(self.jagg_frac, str) and self.jagg_frac != "auto":
            try:
                self.jagg_frac = float(self.jagg_frac)
            except ValueError:
                fail("jagg_frac", f"is {self.jagg_frac!r}", "Use a fraction in [0, 1] or 'auto'.")
        if self.jagg_frac != "auto" and not (isinstance(self.jagg_frac, (int, float)) and 0 <= self.jagg_frac <= 1):
            fail("jagg_frac", f"is {self.jagg_frac!r}", "Use a fraction in [0, 1] (0.6 in the paper) or 'auto'.")
        if not isinstance(self.jagg_probe_steps, int) or self.jagg_probe_steps < 1:
            fail("jagg_probe_steps", f"is {self.jagg_probe_steps!r}", "Use an integer >= 1.")
        if not -1 <= self.jagg_cos_threshold <= 1:
            fail("jagg_cos_threshold", f"is {self.jagg_cos_threshold}", "Use a cosine in [-1, 1] (0.7 is typical).")
        if self.jagg_endpoint_backward not in ENDPOINT_BACKWARDS:
            fail("jagg_endpoint_backward", f"is {self.jagg_endpoint_backward!r}", f"Use one of {ENDPOINT_BACKWARDS}.")
        if self.no_grad_batch_steps is not None and (
            not isinstance(self.no_grad_batch_steps, int) or self.no_grad_batch_steps < 1
        ):
            fail("no_grad_batch_steps", f"is {self.no_grad_batch_steps!r}", "Use an integer >= 1 or None.")
        if self.jagg_mode not in JAGG_MODES:
            fail("jagg_mode", f"is {self.jagg_mode!r}", f"Use one of {JAGG_MODES}.")
        for name in (
            "sample_batch_size",
            "max_sequence_length",
            "eval_num_inference_steps",
            "stat_tracking_buffer_size",
            "num_completions_to_print",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)}", "Use a positive value, or None for the default.")
        if self.image_log_steps < 0:
            fail("image_log_steps", f"is {self.image_log_steps}", "Use 0 (off) or a positive interval.")
        if self.reward_retries < 0:
            fail("reward_retries", f"is {self.reward_retries}", "Use 0 (no retry) or more.")
        trained = self.num_trained_steps
        routed = self.jagg_frac == "auto" or self.jagg_frac > 0
        if self.use_jagg and self.jagg_mode != "exact" and routed and self.jagg_group_size > trained:
            self._warn(
                f"GRPOJaggConfig.jagg_group_size ({self.jagg_group_size}) is larger than the {trained} trained "
                f"step{'s' if trained != 1 else ''} (train_timesteps={self.train_timesteps!r}, num_inference_steps="
                f"{self.num_inference_steps}): no group is full, so JAGG stays idle and every step takes an exact "
                f"backward. Use jagg_group_size <= {trained}, or use_jagg=False."
            )
        self._warn_clip_range_scale()

    def _warn_clip_range_scale(self) -> None:
        """Warn when the clip range is far from the flow-model recipes' (TRL's token default 0.2 is 2000x Flow-GRPO's
        1e-4): it then clips nearly nothing or nearly everything."""
        used = sorted({recipe.config["clip_range"] for recipe in RECIPES.values()})
        if used[0] / CLIP_RANGE_SLACK <= self.clip_range <= used[-1] * CLIP_RANGE_SLACK:
            return
        name = "epsilon" if self.epsilon is not None else "clip_range"
        recipes = ", ".join(f"{recipe.name} {recipe.config['clip_range']:g}" for recipe in RECIPES.values())
        warnings.warn(
            f"GRPOJaggConfig.{name} is {self.clip_range:g}, more than {CLIP_RANGE_SLACK:g}x outside the clip ranges of "
            f"the flow-model recipes ({recipes}): a step's log-prob is a mean over latent dimensions, so its ratio "
            "moves far less than a token's, and a token-scale value such as TRL's 0.2 effectively never clips. Use "
            "1e-4 (SDE / Dance samplers) or 1e-5 (CPS).",
            UserWarning,
            stacklevel=3,
        )

    @staticmethod
    def _warn(message: str) -> None:
        """A setting that does nothing: a warning pointing at the user's GRPOJaggConfig(...) call."""
        warnings.warn(message, UserWarning, stacklevel=5)

    @property
    def num_trained_steps(self) -> int:
        """Denoising steps each update trains (as ``DDPOJaggTrainer`` selects them)."""
        steps = self.num_inference_steps
        return {
            "all": steps,
            "all_but_last": steps - 1,
            "sde_window": self.sde_window_size,
            "random": max(1, round(self.train_timestep_fraction * steps)),
            "random_but_last": max(1, round(self.train_timestep_fraction * (steps - 1))),
        }[self.train_timesteps]

    @property
    def prompts_per_rollout(self) -> int:
        """Distinct prompts one rollout draws from the dataset (on all processes together)."""
        return self.generation_batch_size // self.num_generations
