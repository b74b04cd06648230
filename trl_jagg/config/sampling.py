"""The rollout's field groups of :class:`~trl_jagg.GRPOJaggConfig`, each with its allowed values and its check: how
images are sampled (:class:`SamplingArguments`) and which denoising steps are trained, with the SDE window and the
ODE steps around it (:class:`TrainedStepsArguments`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_jagg.config.reporting import fail
from trl_jagg.core.sampling import SAMPLERS
from trl_jagg.core.sde_window import WINDOW_SCHEDULES, max_window_start

TRAIN_SAMPLERS = tuple(s for s in SAMPLERS if s != "ode")
TRAIN_EXPERTS = ("both", "high_noise", "low_noise")  # Wan2.2 A14B's; models/wan_experts.py maps them to experts
MAX_NOISE_LEVEL = 2.0
TRAIN_TIMESTEPS = ("all_but_last", "all", "random", "random_but_last", "sde_window")


@dataclass
class SamplingArguments:
    """The rollout: images per prompt, steps, size, guidance, the sampler and its noise, batch sizes."""

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

    def _check_sampling_fields(self) -> None:
        """Sizes, guidance scales, the sampler and its noise level."""
        if self.num_generations < 2:
            fail("num_generations", f"is {self.num_generations}", "GRPO needs at least 2 images per prompt.")
        if self.num_inference_steps < 2:
            fail("num_inference_steps", f"is {self.num_inference_steps}", "Use at least 2 steps.")
        for name in ("height", "width"):
            if getattr(self, name) <= 0 or getattr(self, name) % 16:
                fail(name, f"is {getattr(self, name)}", "Use a positive multiple of 16 (8x VAE and 2x2 packing).")
        if self.num_frames is not None and (not isinstance(self.num_frames, int) or self.num_frames < 1):
            fail("num_frames", f"is {self.num_frames!r}", "Use a positive number of frames (Wan: 4 k + 1, e.g. 33).")
        if self.train_experts not in TRAIN_EXPERTS:
            fail("train_experts", f"is {self.train_experts!r}", f"Use one of {TRAIN_EXPERTS} (Wan2.2 A14B).")
        self._check_sampler()
        self._check_guidance()
        for name in ("sample_batch_size", "max_sequence_length", "source_image_area"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)}", "Use a positive value, or None for the default.")

    def _check_guidance(self) -> None:
        if self.guidance_scale_2 is not None and not self.guidance_scale_2 > 1:
            fail(
                "guidance_scale_2",
                f"is {self.guidance_scale_2!r}",
                "Wan2.2's low-noise CFG scale applies where guidance_scale > 1 turns CFG on: use a value > 1, or None.",
            )
        if self.guidance_scale < 0:
            fail(
                "guidance_scale", f"is {self.guidance_scale}", "Use a value >= 0 (3.5 for Flux.1-dev, 4.5 for SD3.5)."
            )
        if self.true_cfg_scale < 1:
            fail("true_cfg_scale", f"is {self.true_cfg_scale}", "Use 1 (off) or more (4 for Qwen-Image).")

    def _check_sampler(self) -> None:
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


@dataclass
class TrainedStepsArguments:
    """Which denoising steps are trained: all, a random fraction, or Flow-GRPO-Fast's / MixGRPO's SDE window and the
    ODE steps around it. Its check reads ``num_inference_steps`` (sampling)."""

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

    def _check_trained_steps_fields(self) -> None:
        """The trained steps, the window's size, start, schedule and slide, the ODE solver around it (an option of
        the window set without one is a rule of :mod:`trl_jagg.config.rules`)."""
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
        self._check_window()
        if self.ode_solver_order not in (1, 2, 3):
            fail("ode_solver_order", f"is {self.ode_solver_order!r}", "Use 1 (Euler), 2 or 3 (DPM-Solver++).")
        if not 0 < self.ode_step_ratio <= 1:
            fail("ode_step_ratio", f"is {self.ode_step_ratio}", "Use a fraction in (0, 1] (1 keeps every step).")

    def _check_window(self) -> None:
        if not 0 <= self.sde_window_size < self.num_inference_steps:
            fail("sde_window_size", f"is {self.sde_window_size}", "Use 0 (off) or fewer than num_inference_steps.")
        last_start = max_window_start(self.sde_window_schedule, self.num_inference_steps, self.sde_window_size)
        if self.sde_window_max_start is not None and not 0 <= self.sde_window_max_start <= last_start:
            fail("sde_window_max_start", f"is {self.sde_window_max_start}", f"Use a value in [0, {last_start}].")
        if self.sde_window_schedule not in WINDOW_SCHEDULES:
            fail("sde_window_schedule", f"is {self.sde_window_schedule!r}", f"Use one of {WINDOW_SCHEDULES}.")
        for name in ("sde_window_stride", "sde_window_shift_interval"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                fail(name, f"is {getattr(self, name)!r}", "Use an integer >= 1.")
