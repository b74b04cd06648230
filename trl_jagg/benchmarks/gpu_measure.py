"""The measurements of ``make gpu-check`` (:mod:`trl_jagg.benchmarks.gpu_check`), each on a trainer it is given.

- :func:`numerics`: the exactness claims on the device's own kernels and dtype. The gradients of the update stage
  (LoRA, flattened) of W = 2, of ``jagg_frac = 0`` and of JAGG (with and without the velocity cache) at W = 4 and
  W = 8 against exact's, with a second exact run as the noise floor; the rollout's cached velocities against the same
  velocities recomputed at the rollout's batch shape (one step per call, as the cache key requires), batched over
  steps, and with an autograd graph; the log-probabilities the update computes against the rollout's (the first PPO
  ratio, before any optimizer step, is their exponentiated difference).
- :func:`cadence_steps`: whole steps as ``train()`` runs them at a preset's own cadence: one rollout and all its
  micro-batches and optimizer steps per ``train()`` call, timed by a callback from the first optimizer step's begin
  to the last one's end, interleaved (ABBA) after a warm-up; the backbone's work is counted by hooks and priced by
  the FLOP model of the timed transformer (achieved TFLOP/s, MFU against the chip's bf16 peak).
- The update stage (exact / JAGG / JAGG + cache at W = 4 and 8) reuses
  :func:`trl_jagg.benchmarks.trainer.time_variants`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PrinterCallback, TrainerCallback

from trl_jagg.benchmarks.flops import StepCosts, backbone_costs, step_flops
from trl_jagg.benchmarks.measuring import (
    benchmark_clock,
    endless_batches,
    interleaved,
    served_share,
    spread,
    sync_device,
)
from trl_jagg.benchmarks.trainer import PROMPTS, _configured, time_update
from trl_jagg.benchmarks.whole_step import WorkCounter
from trl_jagg.trainer.metrics import logged_name

H200_BF16_TFLOPS = 790.0
"""The bf16 matrix-product rate MFU is taken against: 8192^3 GEMMs through PyTorch on the H200 (the platform notes)."""


# ---------------------------------------------------------------------------------------------- numerics
def _flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """The trainable parameters' gradients as one float32 vector (zeros where a parameter has none)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten() for p in params])


def compare(value: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """Cosine, relative error ``|a - b| / |b|`` (L2), largest absolute difference and bitwise equality."""
    value, reference = value.float().flatten(), reference.float().flatten()
    norm = reference.norm().item()
    return {
        "cosine": torch.nn.functional.cosine_similarity(value, reference, dim=0).item(),
        "rel_error": (value - reference).norm().item() / norm if norm > 0 else float("nan"),
        "max_abs": (value - reference).abs().max().item(),
        "bitwise_equal": bool(torch.equal(value, reference)),
    }


GRADIENT_CHECKS: dict[str, tuple[str, int | None, float | None]] = {
    "exact_again": ("exact", None, None),  # the noise floor: exact twice
    "w2_jagg": ("jagg", 2, 1.0),
    "w2_jagg_cache": ("jagg_cache", 2, 1.0),
    "frac0_jagg_cache": ("jagg_cache", 4, 0.0),
    "w4_jagg": ("jagg", 4, 1.0),
    "w4_jagg_cache": ("jagg_cache", 4, 1.0),
    "w8_jagg": ("jagg", 8, 1.0),
    "w8_jagg_cache": ("jagg_cache", 8, 1.0),
}
"""Each gradient compared with exact's: (variant of :data:`~trl_jagg.benchmarks.trainer.VARIANTS`, W, jagg_frac)."""


def sample_rollout(trainer: Any, batches: Any) -> Any:
    """One scored rollout of the trainer's next batch, its velocities recorded for the cache."""
    with _configured(trainer, "jagg_cache", None, None):
        return trainer._generate_and_score(next(batches))


def update_gradient(trainer: Any, rollout: Any, variant: str, w: int | None, frac: float | None) -> dict:
    """The update's gradient of ``rollout`` (all its micro-batches) with ``variant``'s settings, and the mean PPO
    ratio and clip fraction it logged (before any optimizer step: the first ratio)."""
    trainer._metrics.clear()
    time_update(trainer, rollout, variant, w, frac)
    grad = _flat_grad(trainer.model)
    means = {logged_name(key): sum(values) / len(values) for key, values in trainer._metrics.items() if values}
    logged = {key: value for key, value in means.items() if key in LOGGED}
    trainer._metrics.clear()
    trainer.model.zero_grad(set_to_none=True)
    return {"grad": grad, "logged": logged}


LOGGED = (
    "ratio", "clip_fraction", "engine/jagg/cached_velocities", "engine/jagg/no_grad_forwards",
    "engine/jagg/backward_calls",
)  # fmt: skip
"""The update's logged metrics each gradient check records, under their logged names."""


def velocity_checks(trainer: Any, micro_batch: Any) -> dict[str, Any]:
    """The rollout's recorded velocities of ``micro_batch``'s trained steps against the same velocities recomputed
    now (no optimizer step since): one step per call without a graph (the cache's claim: bitwise equal), all steps
    in one call (another batch shape), one step per call with a graph (what exact's update runs); and the
    log-probabilities of the rollout's next latents under each against the rollout's (the first PPO log-ratio)."""
    from trl_jagg.core.sampling import sampler_step

    args, stage, model = trainer.args, trainer.update_stage, trainer.model
    trained = stage.steps_to_train(micro_batch, micro_step=trainer._step, global_step=trainer.state.global_step)
    latents, sigmas, old = micro_batch.latents, micro_batch.sigmas, micro_batch.log_probs
    cached = [micro_batch.velocities[:, k] for k in trained]
    model.train()
    with torch.no_grad():
        per_step = [stage.velocities(model, micro_batch, [k])[0] for k in trained]
        batched = stage.velocities(model, micro_batch, trained) if len(trained) > 1 else per_step
        with torch.enable_grad():
            graph = [stage.velocities(model, micro_batch, [k])[0].detach() for k in trained]

    def log_gap(velocities: Sequence[torch.Tensor]) -> dict[str, float]:
        gaps = torch.stack([
            sampler_step(
                v, latents[:, k], sigmas[k], sigmas[k + 1], sampler=args.sampler, noise_level=args.noise_level,
                sigma_max=sigmas[1], prev_sample=latents[:, k + 1],
            ).log_prob.float() - old[:, k].float()
            for k, v in zip(trained, velocities)
        ])  # fmt: skip
        ratio = gaps.exp()
        return {
            "mean_abs": gaps.abs().mean().item(),
            "max_abs": gaps.abs().max().item(),
            "above_clip_range": int((gaps.abs() > args.epsilon).sum().item()),
            "ratio_mean": ratio.mean().item(),
            "ratio_max_dev": (ratio - 1).abs().max().item(),
        }

    return {
        "trained_steps": trained,
        "clip_range": args.epsilon,
        "velocity": {
            "recomputed_per_step": compare(torch.stack(per_step), torch.stack(cached)),
            "recomputed_batched": compare(torch.stack(batched), torch.stack(cached)),
            "recomputed_with_graph": compare(torch.stack(graph), torch.stack(cached)),
        },
        "log_prob_gap": {
            "cached": log_gap(cached),
            "recomputed_per_step": log_gap(per_step),
            "recomputed_with_graph": log_gap(graph),
        },
    }


def numerics(trainer: Any) -> dict[str, Any]:
    """The numerical checks (see the module docstring) on one fresh rollout of ``trainer``."""

    batches = endless_batches(trainer)
    rollout = sample_rollout(trainer, batches)
    report = velocity_checks(trainer, rollout.split(trainer.args.steps_per_generation)[0])
    exact = update_gradient(trainer, rollout, "exact", None, None)
    report["exact_logged"] = exact["logged"]
    report["gradients"] = {}
    for name, (variant, w, frac) in GRADIENT_CHECKS.items():
        result = update_gradient(trainer, rollout, variant, w, frac)
        report["gradients"][name] = {"variant": variant, "group_size": w, "jagg_frac": frac,
                                     **compare(result["grad"], exact["grad"]), "logged": result["logged"]}  # fmt: skip
    report["exact_grad_norm"] = exact["grad"].norm().item()
    return report


# ---------------------------------------------------------------------------------------------- cadence
def rollout_optimizer_steps(args: Any) -> int:
    """Optimizer steps per rollout: its micro-batches (``steps_per_generation x num_iterations``) over the
    accumulation; a rollout that does not end on an optimizer step is refused (whole rollouts are timed)."""
    micro_batches = args.steps_per_generation * args.num_iterations
    if micro_batches % args.gradient_accumulation_steps:
        raise ValueError(
            f"steps_per_generation x num_iterations ({micro_batches}) must be a multiple of "
            f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) to time whole rollouts."
        )
    return micro_batches // args.gradient_accumulation_steps


class RolloutTimer(TrainerCallback):
    """Times one ``train()`` call of ``max_steps`` optimizer steps: from the first step's begin (before the rollout)
    to the last one's end, synchronised; counts the optimizer steps in between."""

    def __init__(self, device: torch.device):
        self.device, self.clock = device, benchmark_clock(device)
        self.start: float | None = None
        self.elapsed: float | None = None
        self.optimizer_steps = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.start is None:
            sync_device(self.device)
            self.start = self.clock()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.optimizer_steps += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == state.max_steps and self.start is not None:
            sync_device(self.device)
            self.elapsed = self.clock() - self.start


@dataclass(frozen=True)
class CadenceRun:
    """A whole-step variant's trainer and whether its preset checkpoints the backbone's blocks (read before the
    trainer is built: the trainer switches the config's flags off once it has enabled diffusers' own)."""

    trainer: Any
    checkpointed: bool


def preset_values(preset: str, known: Collection[str], **values: Any) -> dict[str, Any]:
    """The ``GRPOJaggConfig`` keyword arguments of preset ``preset`` with ``values`` on top, for a config whose
    fields are ``known``: where the installed transformers predates ``TrainingArguments.activation_checkpointing``
    (the GPU machine's 5.17), the preset's switch is passed as ``gradient_checkpointing``, which the trainer treats
    alike (``trl_jagg/trainer/backbone.py``)."""
    from trl_jagg.recipes import get_recipe

    config = {**get_recipe(preset).config, **values}
    if "activation_checkpointing" not in known and "activation_checkpointing" in config:
        config["gradient_checkpointing"] = bool(
            config.pop("activation_checkpointing") or config.get("gradient_checkpointing")
        )
    return config


def preset_config(preset: str, **values: Any) -> Any:
    """The ``GRPOJaggConfig`` of :func:`preset_values` for the installed transformers."""
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig

    return GRPOJaggConfig(**preset_values(preset, {f.name for f in fields(GRPOJaggConfig) if f.init}, **values))


def build_cadence_trainer(
    pipe: Any, preset: str, variant_fields: Mapping[str, Any], workdir: str, **overrides: Any
) -> CadenceRun:
    """A ``DDPOJaggTrainer`` of preset ``preset`` with ``variant_fields`` and ``overrides`` (the run's: image size,
    text tokens, device, precision) on ``pipe``, the preset's scheduler override applied, the weight-free
    ``prompt_color`` reward, plain SGD (no optimizer state: the trainers share one pipeline), one rollout per
    ``train()`` call."""
    from datasets import Dataset

    from trl_jagg.recipes import get_recipe
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer

    run = {"output_dir": str(Path(workdir) / preset), "report_to": "none", "disable_tqdm": True,
           "save_strategy": "no", "logging_steps": 10**6, "optim": "sgd"}  # fmt: skip
    args = preset_config(preset, **{**variant_fields, **overrides, **run})
    args.max_steps = rollout_optimizer_steps(args)
    checkpointed = bool(args.gradient_checkpointing or getattr(args, "activation_checkpointing", False))
    torch.manual_seed(args.seed)
    trainer = DDPOJaggTrainer(
        model=get_recipe(preset).apply_scheduler(pipe), reward_funcs="prompt_color", args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # each train() call would print its logs: the report has them
    return CadenceRun(trainer, checkpointed)


def _timed_rollout(trainer: Any) -> dict[str, Any]:
    """One ``train()`` call (one rollout at the preset's cadence): its time, optimizer steps, counted work and the
    CUDA peak of allocated memory (``None`` on a CPU)."""
    device = trainer.accelerator.device
    timer, counter = RolloutTimer(device), WorkCounter(trainer.adapter.pipeline)
    trainer.add_callback(timer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        trainer.train()
    finally:
        trainer.remove_callback(timer)
        work = counter.close()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    # The intermediates the velocity cache served and those recomputed, as logged (any jagg_cache_mode).
    logged = [e for e in trainer.state.log_history if "engine/jagg/cached_velocities" in e]
    cache = {key: [e[f"engine/jagg/{key}"] for e in logged] for key in ("cached_velocities", "no_grad_forwards")}
    return {
        "time_s": timer.elapsed, "optimizer_steps": timer.optimizer_steps, "work": work, "peak_gib": peak,
        "cache": cache if logged else None,
    }  # fmt: skip


def cadence_steps(
    variants: Mapping[str, CadenceRun], costs: StepCosts, *, repeats: int, peak_tflops: float = H200_BF16_TFLOPS
) -> dict[str, dict[str, Any]]:
    """Whole steps of every trainer at its preset's cadence (see the module docstring): a warm-up rollout each,
    then ``repeats`` repeats in alternating order. Per variant: the step time (median, min, max), the optimizer
    steps per rollout, the counted work per rollout, the backbone's FLOPs per rollout (``costs``, blocks
    checkpointed as the config says), the achieved TFLOP/s and MFU against ``peak_tflops``, the peak memory."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for name in variants:  # the warm-up
        _timed_rollout(variants[name].trainer)
    for name in interleaved(list(variants), repeats):  # no variant pays for a collection of another's objects
        runs[name].append(_timed_rollout(variants[name].trainer))
    report = {}
    for name, timed in runs.items():
        work, checkpointed = timed[0]["work"], variants[name].checkpointed
        flops = step_flops(costs, work, checkpointing=checkpointed)
        step = spread([r["time_s"] for r in timed])
        achieved = flops / step["median"] / 1e12
        peaks = [r["peak_gib"] for r in timed if r["peak_gib"] is not None]
        caches = [r["cache"] for r in timed if r["cache"]]
        report[name] = {
            "step_s": step, "checkpointed": checkpointed, "optimizer_steps": timed[0]["optimizer_steps"],
            "counted": work,
            "work_per_rollout_equal": all(r["work"] == work for r in timed), "backbone_tflop": flops / 1e12,
            "achieved_tflops": achieved, "mfu": achieved / peak_tflops, "peak_gib": max(peaks) if peaks else None,
            # The share of JAGG intermediates the velocity cache served over the timed rollouts (None: no cache):
            # with the default `recompute`, those of the micro-batches before the rollout's first optimizer step.
            "cache_served": served_share(
                [n for c in caches for n in c["cached_velocities"]], [n for c in caches for n in c["no_grad_forwards"]]
            ),
        }  # fmt: skip
    return report


def backbone_step_costs(config: Mapping[str, Any], resolution: int, text_tokens: int) -> StepCosts:
    """The FLOP model's unit costs of the timed transformer (full fine-tuning) at ``resolution`` pixels; the VAE
    and text encoders (tiny here) are not priced, so the FLOPs are the backbone's."""
    backbone = backbone_costs(config, image_tokens=(resolution // 16) ** 2, text_tokens=text_tokens)
    return StepCosts(**backbone, vae_decode=0.0, text_encode=0.0)
