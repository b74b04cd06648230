"""``trl-jagg bench``: update-stage timings, JAGG vs exact backward, and the per-group gradient cosine.

.. code-block:: bash

    trl-jagg bench [--output_dir runs/bench] [--group_sizes 2 4 8 ...]           # the engine on a small DiT
    trl-jagg bench trainer [--output_dir runs/bench] [--group_sizes 2 4 8 ...]   # DDPOJaggTrainer on a tiny Flux
    trl-jagg bench whole-step [--output_dir runs/bench] [--repeats 5 ...]       # presets at their own cadence
    trl-jagg bench quality [--output_dir runs/quality] [--seeds 0 1 2 ...]      # the demo's reward per variant
    trl-jagg bench reward-overlap [--output_dir runs/bench] [--latency 0.5 ...]  # a slow reward, overlapped or not
    trl-jagg bench nft-jagg [--output_dir runs/bench] [--seeds 0 1 2 ...]       # JAGG across DiffusionNFT's timesteps
    trl-jagg bench velocity-cache [--output_dir runs/bench] [--optimizer_steps 3]  # the cache after optimizer steps

Each benchmark's options are the fields of a dataclass mirroring its function's parameters
(:class:`EngineBenchmarkArguments` for :func:`trl_jagg.benchmarks.engine.run_engine_benchmark`,
:class:`TrainerBenchmarkArguments` for :func:`trl_jagg.benchmarks.trainer.run_trainer_benchmark`,
:class:`WholeStepBenchmarkArguments` for :func:`trl_jagg.benchmarks.whole_step.run_whole_step_benchmark`,
:class:`QualityBenchmarkArguments` for :func:`trl_jagg.benchmarks.quality.run_quality_benchmark`,
:class:`RewardOverlapBenchmarkArguments` for
:func:`trl_jagg.benchmarks.reward_overlap.run_reward_overlap_benchmark`, :class:`VelocityCacheBenchmarkArguments` for
:func:`trl_jagg.benchmarks.velocity_cache.run_velocity_cache_benchmark`): a parameter
added to the function is exposed by adding the field of the same name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from trl_jagg.demo.run import DEMO_ASSET_DIR
from trl_jagg.scripts.utils import CommandParser

ENGINE_DESCRIPTION = (
    "Time the update stage (forward + backward over the trained steps) with JAGG and with exact per-step backward "
    "on a small DiT, measure the per-group gradient cosine, and write engine_benchmark.json and .png to --output_dir. "
    "`trl-jagg bench trainer --help`: the same comparison through DDPOJaggTrainer on a tiny Flux pipeline."
)
TRAINER_DESCRIPTION = (
    "Time the update stage of DDPOJaggTrainer itself (adapter, SDE log-prob, PPO loss, accelerator.backward): exact, "
    "JAGG, JAGG + velocity cache (+ sequential endpoints), interleaved per repeat, with backbone calls counted and "
    "peak memory, on a small Flux pipeline built from config; write trainer_benchmark.json and .png."
)

WHOLE_STEP_DESCRIPTION = (
    "Train each preset (dancegrpo-flux exact and as shipped, mixgrpo-flux as MixGRPO-Flash with an exact update and "
    "as shipped) through DDPOJaggTrainer.train() at its own cadence (optimizer steps per rollout, window, trained-step "
    "draw, checkpointing) on a tiny Flux pipeline, one rollout at a time, interleaved; time each rollout with all its "
    "optimizer steps, count the work by hooks and predict each ratio at FLUX.1-dev size with a FLOP model of the real "
    "modules; measure memory in an untimed rollout; write whole_step_benchmark.json and .png."
)


@dataclass
class EngineBenchmarkArguments:
    """The options of ``trl-jagg bench`` (parameters of :func:`~trl_jagg.benchmarks.engine.run_engine_benchmark`)."""

    _argument_group_name = "Engine benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON and PNG go."})
    group_sizes: list[int] = field(default_factory=lambda: [2, 4, 8], metadata={"help": "JAGG group sizes W."})
    num_steps: int = field(default=8, metadata={"help": "Trained steps per rollout."})
    width: int = field(default=128, metadata={"help": "Transformer hidden size."})
    depth: int = field(default=2, metadata={"help": "Transformer blocks."})
    heads: int = field(default=4, metadata={"help": "Attention heads (must divide width)."})
    tokens: int = field(default=64, metadata={"help": "Latent tokens per image."})
    channels: int = field(default=16, metadata={"help": "Latent channels per token."})
    batch: int = field(default=4, metadata={"help": "Images per update."})
    num_generations: int | None = field(default=None, metadata={"help": "GRPO group size (default: batch)."})
    repeats: int = field(default=5, metadata={"help": "Timed exact/JAGG pairs per W (after one warm-up pair)."})
    num_threads: int | None = field(default=1, metadata={"help": "torch intra-op threads (0: torch's default)."})
    seed: int = field(default=0, metadata={"help": "Seed of the network and the rollout."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})


@dataclass
class TrainerBenchmarkArguments:
    """The options of ``trl-jagg bench trainer`` (parameters of
    :func:`~trl_jagg.benchmarks.trainer.run_trainer_benchmark`)."""

    _argument_group_name = "Trainer benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON and PNG go."})
    group_sizes: list[int] = field(default_factory=lambda: [2, 4, 8], metadata={"help": "JAGG group sizes W."})
    jagg_fracs: list[float] = field(
        default_factory=lambda: [0.6, 1.0], metadata={"help": "Fractions of groups routed to JAGG."}
    )
    betas: list[float] = field(
        default_factory=lambda: [0.0, 0.04], metadata={"help": "KL coefficients (each gets its own trainer)."}
    )
    num_inference_steps: int = field(default=9, metadata={"help": "Denoising steps; all but the last are trained."})
    resolution: int = field(
        default=384, metadata={"help": "Image height and width in pixels (a multiple of 16): (res/16)^2 image tokens."}
    )
    max_sequence_length: int = field(default=512, metadata={"help": "Text tokens (FLUX.1-dev's default: 512)."})
    batch: int = field(default=2, metadata={"help": "Images per micro-batch (prompts x 2 generations)."})
    num_layers: int = field(default=2, metadata={"help": "Double-stream blocks of the Flux transformer."})
    num_single_layers: int = field(default=4, metadata={"help": "Single-stream blocks of the Flux transformer."})
    repeats: int = field(
        default=5, metadata={"help": "Timed repeats after a warm-up: each samples a rollout and times every variant."}
    )
    lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full backbone."})
    memory: bool = field(
        default=True, metadata={"help": "Measure each variant's peak update memory (--no_memory skips it)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the model weights and the rollouts."})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads while timing (restored afterwards)."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})
    family: str = field(
        default="flux",
        metadata={
            "help": "flux (images), flux_kontext (image editing: the source image's latents in every backbone call, "
            "twice the image tokens) or wan (videos: the long token sequences of video)."
        },
    )
    num_frames: int = field(default=9, metadata={"help": "Frames of each video with --family wan (4 k + 1)."})


def _whole_step_variants() -> tuple[str, ...]:
    from trl_jagg.benchmarks.whole_step import WHOLE_STEP_VARIANTS

    return tuple(WHOLE_STEP_VARIANTS)


@dataclass
class WholeStepBenchmarkArguments:
    """The options of ``trl-jagg bench whole-step`` (parameters of
    :func:`~trl_jagg.benchmarks.whole_step.run_whole_step_benchmark`)."""

    _argument_group_name = "Whole-step benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON and PNG go."})
    variants: list[str] = field(
        default_factory=lambda: list(_whole_step_variants()),
        metadata={"help": "The variants to time (all; the baselines a variant names are added)."},
    )
    resolution: int = field(default=128, metadata={"help": "Image height and width in pixels (a multiple of 16)."})
    max_sequence_length: int = field(default=64, metadata={"help": "Text tokens."})
    num_layers: int = field(default=2, metadata={"help": "Double-stream blocks of the Flux transformer."})
    num_single_layers: int = field(default=4, metadata={"help": "Single-stream blocks of the Flux transformer."})
    repeats: int = field(
        default=5, metadata={"help": "Timed repeats after a warm-up, each one rollout of every variant."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the model weights and the rollouts."})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads while timing (restored afterwards)."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})
    reprice_report: str | None = field(
        default=None,
        metadata={
            "help": "A whole_step_benchmark.json written before: time nothing, recompute its FLUX.1-dev predictions "
            "(full fine-tuning and LoRA) from its counted work and write it to --output_dir."
        },
    )
    model: str | None = field(
        default=None,
        metadata={
            "help": "A local pipeline folder to train instead of a random-initialised tiny Flux; `demo`: the CPU "
            "demo's pretrained pipeline, a model that has learnt its prompts (with --resolution 32 "
            "--max_sequence_length 16). --num_layers and --num_single_layers then do not apply."
        },
    )


QUALITY_DESCRIPTION = (
    "Train the CPU demo with exact updates, JAGG + velocity cache and the mixed ODE-SDE rollouts (MixGRPO-style "
    "sliding window, and the jagg-fast-flux window held on the high-noise steps; DPM-Solver++) + JAGG + cache, for "
    "every seed in interleaved order, on the colour, fine-detail or stripes task; write quality.json (reward and "
    "colour accuracy per step, evaluations every tenth of the run, the CPU time to exact's final held-out reward) "
    "and quality.png (reward against step and CPU time)."
)


def _quality_variants() -> tuple[str, ...]:
    from trl_jagg.benchmarks.quality import QUALITY_VARIANTS

    return QUALITY_VARIANTS


@dataclass
class QualityBenchmarkArguments:
    """The options of ``trl-jagg bench quality`` (parameters of
    :func:`~trl_jagg.benchmarks.quality.run_quality_benchmark`)."""

    _argument_group_name = "Quality benchmark"

    output_dir: str = field(default="runs/quality", metadata={"help": "Where the JSON, PNG and run folders go."})
    task: str = field(
        default="color",
        metadata={
            "help": "`color` (the demo's prompt_color reward, settled in the high-noise steps), `detail` (the "
            "high_frequency reward: fine detail) or `stripes` (the horizontal_detail reward: oriented fine detail, "
            "far from its ceiling)."
        },
    )
    steps: int = field(default=100, metadata={"help": "Optimizer steps per run."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training seeds (each variant)."})
    variants: list[str] = field(
        default_factory=lambda: list(_quality_variants()), metadata={"help": "The variants to train (all)."}
    )
    eval_repeats: int = field(default=8, metadata={"help": "Held-out images per prompt at each evaluation."})
    eval_every: int | None = field(
        default=None,
        metadata={"help": "Optimizer steps between evaluations, besides half-way and the end (default steps // 10)."},
    )
    model: str = field(
        default=DEMO_ASSET_DIR,
        metadata={"help": "The pipeline to fine-tune, a local directory or a Hub id (default: the demo's model)."},
    )
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads while training (restored afterwards)."})
    price_flux: bool = field(
        default=True,
        metadata={
            "help": "Also price the time to reward in FLOPs at FLUX.1-dev's size (1024 px, LoRA): the counted work "
            "of the runs at that size (counting FLUX.1-dev's modules takes a minute or two, once)."
        },
    )
    beta: float | None = field(
        default=None,
        metadata={
            "help": "The KL coefficient of every variant (default: the demo's 0.15); 0 is the Flux presets' own "
            "(mixgrpo-flux, jagg-fast-flux)."
        },
    )


REWARD_OVERLAP_DESCRIPTION = (
    "Train a tiny Flux pipeline with a remote reward whose server answers each request after --latency seconds, "
    "steps alternating between scoring after the rollout and scoring each chunk while the rollout samples and the "
    "update starts (overlap_rewards); write reward_overlap_benchmark.json and .png: per pair of adjacent steps the "
    "step times and how far the step fell against the reward's share of it."
)


@dataclass
class RewardOverlapBenchmarkArguments:
    """The options of ``trl-jagg bench reward-overlap`` (parameters of
    :func:`~trl_jagg.benchmarks.reward_overlap.run_reward_overlap_benchmark`)."""

    _argument_group_name = "Reward-overlap benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON and PNG go."})
    latency: float = field(default=0.5, metadata={"help": "Seconds the server waits before each answer."})
    chunk: int = field(default=2, metadata={"help": "Images per rollout chunk: one group, one request."})
    chunks: int = field(default=4, metadata={"help": "Chunks per rollout, each one micro-batch of the update."})
    pairs: int = field(default=16, metadata={"help": "Pairs of adjacent steps per beta, one each way."})
    num_inference_steps: int = field(default=48, metadata={"help": "Sampling steps; all but the last are trained."})
    resolution: int = field(default=64, metadata={"help": "Image height and width in pixels."})
    num_layers: int = field(default=2, metadata={"help": "Double-stream blocks of the Flux transformer."})
    num_single_layers: int = field(default=4, metadata={"help": "Single-stream blocks of the Flux transformer."})
    betas: list[float] = field(
        default_factory=lambda: [0.0, 0.04], metadata={"help": "KL coefficients (each gets its own trainer)."}
    )
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads (the rest run the server)."})
    seed: int = field(default=0, metadata={"help": "Seed of the model weights and the rollouts."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})


VELOCITY_CACHE_DESCRIPTION = (
    "On the CPU demo, the JAGG gradient with the rollout's cached velocities corrected where the check holds "
    "(jagg_cache_mode=checked, a heuristic), all corrected by the endpoints' change (corrected) and as they are "
    "(stale) against recomputed intermediates (recompute, the default), after 1 .. "
    "--optimizer_steps optimizer steps since the rollout (cosine, relative error, the default's gate), and the "
    "cache's hits per micro-batch at that many optimizer steps per rollout; write velocity_cache_benchmark.json "
    "and .png."
)


@dataclass
class VelocityCacheBenchmarkArguments:
    """The options of ``trl-jagg bench velocity-cache`` (parameters of
    :func:`~trl_jagg.benchmarks.velocity_cache.run_velocity_cache_benchmark`)."""

    _argument_group_name = "Velocity-cache benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON, PNG and run folders go."})
    model: str = field(
        default=DEMO_ASSET_DIR,
        metadata={"help": "The pipeline to fine-tune, a local directory or a Hub id (default: the demo's model)."},
    )
    optimizer_steps: int = field(
        default=3, metadata={"help": "Optimizer steps since the rollout to measure after (and per rollout for hits)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the LoRA initialisation and the rollout."})
    learning_rate: float | None = field(default=None, metadata={"help": "Overrides the demo's 1e-2."})
    clip_range: float | None = field(
        default=None, metadata={"help": "Overrides the demo's PPO clip range 1e-4 (1.0: never clips)."}
    )
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads (restored afterwards)."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})


NFT_JAGG_DESCRIPTION = (
    "On the CPU demo trained with DiffusionNFT (objective=nft), one rollout's update with JAGG across 4 timesteps "
    "against the same update exact with the same shared noise, and against DiffusionNFT's own fresh-noise update "
    "(use_jagg=False), at several optimizer steps of an exact-NFT run: gradient cosines, relative errors and the "
    "update's CPU-time ratio; write nft_jagg_benchmark.json and .png."
)


@dataclass
class NFTJaggBenchmarkArguments:
    """The options of ``trl-jagg bench nft-jagg`` (parameters of
    :func:`~trl_jagg.benchmarks.nft.run_nft_jagg_benchmark`)."""

    _argument_group_name = "JAGG-NFT benchmark"

    output_dir: str = field(default="runs/bench", metadata={"help": "Where the JSON and PNG go."})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Seeds (LoRA init and rollouts)."})
    checkpoints: list[int] = field(
        default_factory=lambda: [0, 20, 40], metadata={"help": "Optimizer steps of the exact-NFT run to measure at."}
    )
    repeats: int = field(default=5, metadata={"help": "Timed exact/JAGG pairs per measurement (after a warm-up)."})
    num_threads: int | None = field(default=1, metadata={"help": "torch intra-op threads (0: torch's default)."})
    model: str | None = field(default=None, metadata={"help": "The pipeline (default: the demo's model)."})
    plot: bool = field(default=True, metadata={"help": "Write the PNG chart (--no_plot skips it)."})


COMMANDS = {
    "trainer": (TrainerBenchmarkArguments, "bench trainer", TRAINER_DESCRIPTION),
    "whole-step": (WholeStepBenchmarkArguments, "bench whole-step", WHOLE_STEP_DESCRIPTION),
    "quality": (QualityBenchmarkArguments, "bench quality", QUALITY_DESCRIPTION),
    "reward-overlap": (RewardOverlapBenchmarkArguments, "bench reward-overlap", REWARD_OVERLAP_DESCRIPTION),
    "velocity-cache": (VelocityCacheBenchmarkArguments, "bench velocity-cache", VELOCITY_CACHE_DESCRIPTION),
    "nft-jagg": (NFTJaggBenchmarkArguments, "bench nft-jagg", NFT_JAGG_DESCRIPTION),
}
"""The sub-benchmarks by name; without one, ``trl-jagg bench`` runs the engine benchmark."""


def make_parser(command: str | None = None) -> CommandParser:
    arguments, name, description = COMMANDS.get(command, (EngineBenchmarkArguments, "bench", ENGINE_DESCRIPTION))
    return CommandParser((arguments,), name, description)


def main(argv: Sequence[str]) -> int:
    """``trl-jagg bench [trainer | whole-step | quality | reward-overlap | velocity-cache | nft-jagg] ARGV``: run the benchmark (it prints its table and where its files
    are)."""
    command = argv[0] if argv and argv[0] in COMMANDS else None
    parsed = make_parser(command).parse_command_line(argv[1:] if command else argv)
    if parsed is None:
        return 0
    kwargs = asdict(parsed[0])
    for key in ("group_sizes", "jagg_fracs", "betas", "variants", "seeds", "checkpoints"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    if command == "trainer":
        from trl_jagg.benchmarks.trainer import run_trainer_benchmark

        run_trainer_benchmark(**kwargs)
    elif command == "whole-step":
        from trl_jagg.benchmarks.whole_step import run_whole_step_benchmark

        run_whole_step_benchmark(**kwargs)
    elif command == "quality":
        from trl_jagg.benchmarks.quality import run_quality_benchmark

        run_quality_benchmark(**kwargs)
    elif command == "reward-overlap":
        from trl_jagg.benchmarks.reward_overlap import run_reward_overlap_benchmark

        run_reward_overlap_benchmark(**kwargs)
    elif command == "velocity-cache":
        from trl_jagg.benchmarks.velocity_cache import run_velocity_cache_benchmark

        run_velocity_cache_benchmark(**kwargs)
    elif command == "nft-jagg":
        from trl_jagg.benchmarks.nft import run_nft_jagg_benchmark

        run_nft_jagg_benchmark(**kwargs)
    else:
        from trl_jagg.benchmarks.engine import run_engine_benchmark

        run_engine_benchmark(**kwargs)
    return 0
