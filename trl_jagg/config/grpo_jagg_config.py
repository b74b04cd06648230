"""Configuration of :class:`~trl_jagg.DDPOJaggTrainer`: GRPO for flow models with JAGG group gradients."""

from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from transformers import TrainingArguments

from trl_jagg.config.checks import (
    CFG_GRADIENTS,
    DTYPES,
    KL_STDS,
    OBJECTIVES,
    SCALE_REWARDS,
    TRAIN_SAMPLERS,
    TRAIN_TIMESTEPS,
    check_activation_checkpointing,
    check_fields,
    check_types_and_finiteness,
    resolve_generation_batch,
    reward_kwargs_mapping,
)
from trl_jagg.config.groups import EMAArguments, EvaluationArguments, JaggArguments, ScalingArguments
from trl_jagg.core.grpo import MULTI_OBJECTIVE_AGGREGATIONS
from trl_jagg.core.sde_window import WINDOW_SCHEDULES
from trl_jagg.recipes import get_recipe
from trl_jagg.utils.prompts import check_prompts
from trl_jagg.utils.redaction import redacted


@dataclass
class GRPOJaggConfig(JaggArguments, ScalingArguments, EMAArguments, EvaluationArguments, TrainingArguments):
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
        sde_window_stride, sde_window_shift_interval, ode_solver_order, ode_step_ratio, clip_range (TRL: epsilon),
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
    num_frames: int | None = field(
        default=None,
        metadata={"help": "Frames of each video (video models; Wan: 4 k + 1, None: its 81). Images: None."},
    )
    guidance_scale: float = field(
        default=3.5,
        metadata={
            "help": "As in the diffusers pipeline: the embedded guidance of guidance-distilled models (Flux.1-dev), "
            "the classifier-free guidance scale of SD3 (1 disables it)."
        },
    )
    guidance_scale_2: float | None = field(
        default=None,
        metadata={"help": "Wan2.2 A14B: the low-noise expert's CFG scale, as the pipeline's (None: guidance_scale)."},
    )
    true_cfg_scale: float = field(
        default=1.0,
        metadata={
            "help": "True classifier-free guidance with `negative_prompt` for Flux and Qwen-Image (two backbone "
            "calls per step; 1 disables it)."
        },
    )
    negative_prompt: str = field(default="", metadata={"help": "Negative prompt for classifier-free guidance."})
    train_experts: str = field(
        default="both",
        metadata={
            "help": "Wan2.2 A14B: the experts trained, `both`, `high_noise` or `low_noise` (the others frozen)."
        },
    )
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
    source_image_area: int | None = field(
        default=None,
        metadata={
            "help": "Qwen-Image-Edit(-Plus): the pixel area each source image is resized to (aspect ratio kept, sides "
            "multiples of 32) before the VAE encodes it into reference tokens, as Flow-Factory's "
            "`condition_image_size`. None: the pipeline's 1024 * 1024."
        },
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
    objective: str = field(
        default="grpo",
        metadata={
            "help": f"Training objective, one of {OBJECTIVES}: `grpo` (PPO-clipped policy gradient through the reverse "
            "SDE, Flow-GRPO / DanceGRPO) or `nft` (DiffusionNFT: deterministic ODE rollouts by a slowly following "
            "old policy, the negative-aware flow-matching loss on forward-noised clean samples, no log-probabilities; "
            "trains a random `train_timestep_fraction` of the rollout's timesteps, `beta` is its KL coefficient, "
            "`use_jagg` groups a sample's timesteps). See docs/models.md for how it follows NVlabs/DiffusionNFT."
        },
    )
    nft_beta: float = field(
        default=1.0,
        metadata={
            "help": "`objective='nft'`: the guidance strength beta of the implicit positive / negative policies "
            "(`beta v + (1 - beta) v_old` and `(1 + beta) v_old - beta v`); DiffusionNFT uses 1 (0.1 for OCR and "
            "multi-reward runs)."
        },
    )
    nft_decay_type: int = field(
        default=1,
        metadata={
            "help": "`objective='nft'`: how the sampling (old) policy follows the trained one after each rollout, "
            "`old = decay * old + (1 - decay) * current`, DiffusionNFT's `decay_type`: 0 (decay 0: on-policy), 1 "
            "(0.001 per optimizer step up to 0.5), 2 (0 for 75 steps, then 0.0075 per step up to 0.999)."
        },
    )
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
            "help": "Latest first step of the SDE window (for `fixed`, its only one). Defaults to the first half of "
            "the schedule for the `random` schedule, to num_inference_steps - 3 for `progressive` (MixGRPO's last "
            "start with a non-empty window: its windows stop before step num_inference_steps - 2, MixGRPO's "
            "max_timesteps, and are cut short there), and to 0 for `fixed`."
        },
    )
    sde_window_schedule: str = field(
        default="random",
        metadata={
            "help": f"Where the SDE window sits, one of {WINDOW_SCHEDULES}: `random` (Flow-GRPO-Fast: its start "
            "drawn uniformly in [0, sde_window_max_start] at every rollout), `progressive` (MixGRPO: it starts at "
            "step 0 and moves `sde_window_stride` steps later every `sde_window_shift_interval` rollouts, back to "
            "step 0 after sde_window_max_start; it never trains the last two steps, and the ODE after it takes "
            "MixGRPO-Flash's count of steps, see ode_step_ratio; the default max start is MixGRPO's full slide, a "
            "smaller one limits the slide to the first starts) or `fixed` (held at start sde_window_max_start, default 0: "
            "the high-noise steps, where the layout and colours are settled)."
        },
    )
    sde_window_stride: int = field(
        default=1,
        metadata={"help": "Steps the `progressive` window moves at each shift (MixGRPO's `prog_overlap_step`)."},
    )
    sde_window_shift_interval: int = field(
        default=25,
        metadata={
            "help": "Rollouts between two shifts of the `progressive` window (MixGRPO's `iters_per_group`: its "
            "window moves once per rollout counter, whatever the optimizer steps a rollout feeds). Counted in "
            "rollouts since issue 37; it was optimizer steps before, so with k optimizer steps a rollout divide an "
            "older value by k to keep its window's pace."
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
            "`dpm_post_compress_ratio`, which it applies after the window only). Before the window, and after a "
            "`random` or `fixed` one, round(ratio x n) of the side's n steps; after a `progressive` window, "
            "MixGRPO-Flash's count: int((n + 1) x ratio) - 1 (7 of 21 at 0.4). 1 keeps every step."
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
    # `dict | str`, as TrainingArguments' dict fields: a flag gives the JSON text, parsed by __post_init__.
    reward_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of the reward factories, by reward name (as written in `reward_funcs`: a "
            'registry name or a URL), e.g. `{"vlm-judge": {"url": "http://localhost:8080/v1", "model": '
            '"UnifiedReward"}}`; a YAML mapping, or its JSON text on the command line. The trainer passes them to '
            "`load_reward_funcs`; a key that is not one of `reward_funcs` or a keyword the reward does not take is an "
            "error before anything loads. API keys stay in environment variables."
        },
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
            "`advantages/<name>/abs_mean` (the mean |weight x group-normalised reward|). The presets follow their "
            "peer: flow-factory-flux2-dev (CLIP + PickScore, Flow-Factory's GDPO) sets 'normalize_then_sum', the "
            "others keep 'sum_then_normalize'."
        },
    )
    overlap_rewards: bool = field(
        default=True,
        metadata={
            "help": "Score each rollout chunk (`sample_batch_size` images) with the rewards that score every sample on "
            "its own (a remote server, a pointwise `vlm-judge`, any reward with `per_sample = True`) in background "
            "threads while the next chunk samples, instead of after the whole rollout. When every reward is such a "
            "reward, each micro-batch of the update waits for them only at its first loss: with per-group "
            "advantages (`scale_rewards` 'group' or 'none', no GDPO, no `per_prompt_stat_tracking` or "
            "`drop_zero_advantages`) only for the chunks holding its groups, so the first micro-batches train while "
            "the last chunk is scored; otherwise for all of them, after the KL reference (`beta > 0`) and the first "
            "step's forward. The scores, advantages and gradients are the same. Other rewards run after the rollout "
            "(and then the last chunk is awaited there). See docs/rewards.md."
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
    reward_timeout: float | None = field(
        default=900.0,
        metadata={
            "help": "Seconds each reward function may take to score one batch (a rollout, a rollout chunk scored "
            "during the rollout, an evaluation), retries included. When it expires, the call is abandoned (an "
            "`async def` reward is cancelled; a synchronous one is left running in a daemon thread, its result "
            "dropped), every process saves a checkpoint of the steps trained so far, and the run stops with an "
            "error naming the reward and the step; a stop signal (SIGINT, SIGTERM) abandons a reward the same way. "
            "Default 900 s for every reward, local callables included (longer than the remote reward's own "
            "attempts, shorter than the process group's 30-minute timeout). None (YAML `null`) turns it off: a "
            "synchronous reward then runs in the trainer's thread. See docs/rewards.md."
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
        # Before TrainingArguments uses any value: a wrong type or a NaN would fail there without naming the field.
        check_types_and_finiteness(self)
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
        check_fields(self)
        super().__post_init__()
        check_activation_checkpointing(self)  # transformers' field, parsed and its alias resolved just above
        resolve_generation_batch(self)  # needs the number of processes

    def to_dict(self) -> dict[str, Any]:
        """The fields as ``TrainingArguments.to_dict`` gives them (what trackers record, through ``to_json_string``
        and ``to_sanitized_dict`` too), with every secret redacted (:mod:`trl_jagg.utils.redaction`): a key inside
        ``reward_kwargs`` or a URL would otherwise reach TensorBoard, W&B and the Hub."""
        return redacted(super().to_dict())

    def __repr__(self) -> str:
        # The dataclass repr would show every field in clear (hub_token and reward_kwargs included).
        shown = "".join(f"{key}={value!r},\n" for key, value in sorted(self.to_dict().items()))
        return f"{type(self).__name__}(\n{shown})"

    __str__ = __repr__

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
