"""The field groups of :class:`~trl_jagg.GRPOJaggConfig` that configure one part of the run each: the JAGG engine,
distributed training / memory / speed, the EMA of the trained weights and the evaluation images. Each is a dataclass
mixed into ``GRPOJaggConfig`` (whose docstring and ``__post_init__`` document and check every field); none is used on
its own."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_jagg.config.checks import EMA_SCHEDULES
from trl_jagg.core.jagg import ENDPOINT_BACKWARDS, JAGG_MODES
from trl_jagg.core.velocity_cache import VELOCITY_CACHE_MODES


@dataclass
class JaggArguments:
    """The JAGG engine: grouping, routing, the velocity cache and batched no-grad forwards."""

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
            "of JAGG groups (no active dropout, same dtype/autocast and batch shape; after an optimizer step since "
            "the rollout as `jagg_cache_mode` says): a group then costs 2 endpoint forwards + 1 backward. Logged as "
            "`jagg/cached_velocities`."
        },
    )
    jagg_cache_mode: str = field(
        default="recompute",
        metadata={
            "help": f"One of {VELOCITY_CACHE_MODES}: what the velocity cache does after an optimizer step since the "
            "rollout (`steps_per_generation > gradient_accumulation_steps`, `num_iterations > 1`). `recompute` (the "
            "default): the intermediates run again without a graph, so the gradient is JAGG's at the current "
            "weights whatever the step changed. The others skip those forwards and approximate, with no bound "
            "under every weight change: `corrected` moves each cached intermediate by the change of its group's "
            "two endpoints since the rollout, interpolated with JAGG's weights (exact only when that change is "
            "linear in time across the group; a change that leaves the endpoints alone is missed entirely). "
            "`checked`: a heuristic that keeps `corrected` where the group's loss signals move by at most "
            "`jagg_cache_tolerance` when every correction is undone or doubled, recomputing elsewhere; it probes "
            "only along the correction, so it passes any error the correction does not see. `stale`: the rollout's "
            "velocities as they are. Before the first optimizer step every mode uses the cache as is (exact). "
            "Logged as `jagg/corrected_velocities` (`checked`: also `jagg/cache_rejected` and "
            "`jagg/cache_sensitivity`, the largest relative move)."
        },
    )
    jagg_cache_tolerance: float = field(
        default=1e-3,
        metadata={
            "help": "With `jagg_cache_mode=checked`: the largest relative move of a JAGG group's aggregated loss "
            "signals, under a velocity error as large as the correction, for which the corrected intermediates are "
            "kept. A heuristic threshold, not an error bound: on ordinary Adam steps the gradient's error measured "
            "below it, on a weight change that leaves the endpoints unchanged it measured 19-50% "
            "(docs/jagg.md)."
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


@dataclass
class ScalingArguments:
    """Distributed training, memory and speed."""

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


@dataclass
class EMAArguments:
    """The exponential moving average of the trained weights."""

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


@dataclass
class EvaluationArguments:
    """Sample images and the held-out evaluation."""

    eval_prompts: list[str] | None = field(
        default=None, metadata={"help": "Prompts rendered (deterministic ODE sampling) and logged as sample images."}
    )
    eval_source_images: list[str] | None = field(
        default=None,
        metadata={
            "help": "Editing models (FLUX.1 Kontext): the source image each of `eval_prompts` edits, one file path "
            "per prompt, for the sample images."
        },
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
