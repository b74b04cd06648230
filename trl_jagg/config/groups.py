"""The field groups of :class:`~trl_jagg.GRPOJaggConfig` that configure one part of the run each: model loading, the
JAGG engine, distributed training / memory / speed, the EMA of the trained weights and the evaluation images. Each is
a dataclass mixed into ``GRPOJaggConfig`` with its allowed values and its check (a ``_check_*_fields`` method that
``GRPOJaggConfig.__post_init__`` calls); none is used on its own. The rollout's groups are in
:mod:`trl_jagg.config.sampling`, the objective's, the policy loss's and the advantages' in their own modules."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_jagg.config.reporting import fail, warn_user
from trl_jagg.core.jagg import ENDPOINT_BACKWARDS, JAGG_MODES
from trl_jagg.core.velocity_cache import VELOCITY_CACHE_MODES

DTYPES = ("float32", "bfloat16", "float16")
EMA_SCHEDULES = ("step", "flow_grpo")


@dataclass
class ModelArguments:
    """How the pipeline is loaded when ``model`` is a Hub id or a path."""

    dtype: str = field(
        default="float32",
        metadata={"help": f"dtype of the pipeline when `model` is a Hub id or a path, one of {DTYPES}."},
    )
    model_revision: str | None = field(default=None, metadata={"help": "Revision (branch, tag or commit) to load."})

    def _check_model_fields(self) -> None:
        if self.dtype not in DTYPES:
            fail("dtype", f"is {self.dtype!r}", f"Use one of {DTYPES}.")


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
            "`engine/jagg/cached_velocities`."
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
            "Logged as `engine/jagg/corrected_velocities` (`checked`: also `engine/jagg/cache_rejected` and "
            "`engine/jagg/cache_sensitivity`, the largest relative move)."
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

    def _check_jagg_fields(self) -> None:
        """Group size, routing, the velocity cache, the no-grad batching; a group that can never be full warns.
        Reads the trained steps (``num_trained_steps``)."""
        if not isinstance(self.jagg_group_size, int) or self.jagg_group_size < 1:
            fail("jagg_group_size", f"is {self.jagg_group_size!r}", "Use an integer >= 1 (4 or 8 are typical).")
        self._check_jagg_frac()
        if not isinstance(self.jagg_probe_steps, int) or self.jagg_probe_steps < 1:
            fail("jagg_probe_steps", f"is {self.jagg_probe_steps!r}", "Use an integer >= 1.")
        if not -1 <= self.jagg_cos_threshold <= 1:
            fail("jagg_cos_threshold", f"is {self.jagg_cos_threshold}", "Use a cosine in [-1, 1] (0.7 is typical).")
        if self.jagg_endpoint_backward not in ENDPOINT_BACKWARDS:
            fail("jagg_endpoint_backward", f"is {self.jagg_endpoint_backward!r}", f"Use one of {ENDPOINT_BACKWARDS}.")
        if self.jagg_cache_mode not in VELOCITY_CACHE_MODES:
            fail("jagg_cache_mode", f"is {self.jagg_cache_mode!r}", f"Use one of {VELOCITY_CACHE_MODES}.")
        if not (isinstance(self.jagg_cache_tolerance, (int, float)) and self.jagg_cache_tolerance >= 0):
            fail(
                "jagg_cache_tolerance", f"is {self.jagg_cache_tolerance!r}", "Use a number >= 0 (the default is 1e-3)."
            )
        if self.no_grad_batch_steps is not None and (
            not isinstance(self.no_grad_batch_steps, int) or self.no_grad_batch_steps < 1
        ):
            fail("no_grad_batch_steps", f"is {self.no_grad_batch_steps!r}", "Use an integer >= 1 or None.")
        if self.jagg_mode not in JAGG_MODES:
            fail("jagg_mode", f"is {self.jagg_mode!r}", f"Use one of {JAGG_MODES}.")
        self._warn_idle_groups()

    def _check_jagg_frac(self) -> None:
        """A fraction in [0, 1] or ``"auto"``; a flag's text (``"0.6"``) becomes a float."""
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

    def _warn_idle_groups(self) -> None:
        trained = self.num_trained_steps
        routed = self.jagg_frac == "auto" or self.jagg_frac > 0
        if self.use_jagg and self.jagg_mode != "exact" and routed and self.jagg_group_size > trained:
            warn_user(
                f"GRPOJaggConfig.jagg_group_size ({self.jagg_group_size}) is larger than the {trained} trained "
                f"step{'s' if trained != 1 else ''} (train_timesteps={self.train_timesteps!r}, num_inference_steps="
                f"{self.num_inference_steps}): no group is full, so JAGG stays idle and every step takes an exact "
                f"backward. Use jagg_group_size <= {trained}, or use_jagg=False."
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

    def _check_scaling_fields(self) -> None:
        if self.compile_repeated_blocks:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile_backend not in backends:
                fail("compile_backend", f"is {self.compile_backend!r}", f"Use one of {sorted(backends)}.")


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

    def _check_ema_fields(self) -> None:
        if not 0 <= self.ema_decay < 1:
            fail(
                "ema_decay",
                f"is {self.ema_decay}",
                "Use a value in [0, 1): 0 disables the EMA, 0.9-0.9999 are typical.",
            )
        if not isinstance(self.ema_update_interval, int) or self.ema_update_interval < 1:
            fail("ema_update_interval", f"is {self.ema_update_interval!r}", "Use an integer >= 1.")
        if self.ema_schedule not in EMA_SCHEDULES:
            fail("ema_schedule", f"is {self.ema_schedule!r}", f"Use one of {EMA_SCHEDULES}.")


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

    def _check_evaluation_fields(self) -> None:
        for name in ("eval_num_inference_steps", "num_completions_to_print"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)}", "Use a positive value, or None for the default.")
        if self.image_log_steps < 0:
            fail("image_log_steps", f"is {self.image_log_steps}", "Use 0 (off) or a positive interval.")
        sources = self.eval_source_images
        if sources is not None and len(sources) != len(self.eval_prompts or ()):
            fail(
                "eval_source_images",
                f"has {len(sources)} images for {len(self.eval_prompts or ())} eval_prompts",
                "Give one source image (a file path) per eval prompt.",
            )
