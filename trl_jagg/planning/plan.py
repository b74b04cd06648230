"""A resource plan: the run's per-process memory under each sharding strategy, whether it fits the GPUs, the
cheapest change that makes it fit, and the predicted time of a step, all from the architecture built on ``meta``.

:func:`measure_backbone` builds the backbone (with the run's LoRA) once per micro-batch size, measures what one
update call saves for its backward and counts its FLOPs (:mod:`trl_jagg.planning.measure`); :func:`make_plan`
places the sizes (:mod:`trl_jagg.planning.memory`) and prices the rollout.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.planning.architecture import Architecture, Component, skipped_initialisation
from trl_jagg.planning.inputs import backbone_inputs
from trl_jagg.planning.measure import (
    ActivationProfile,
    CallFlops,
    count_flops,
    measure_activations,
    transformer_blocks,
)
from trl_jagg.planning.memory import STRATEGIES, MemoryRow, ModelSizes, memory_rows
from trl_jagg.planning.settings import RunSettings


@dataclass(frozen=True)
class GPUs:
    """The machines a plan is for."""

    num_processes: int = 8
    memory_gb: float = 80.0
    """Memory of one GPU, in GB as vendors state it (80 for an H100 80GB)."""
    tflops: float = 989.0
    """Dense bf16 TFLOP/s of one GPU (989 for an H100 SXM)."""
    mfu: float = 0.4
    """The share of ``tflops`` the step is assumed to reach (model FLOPs utilisation)."""
    margin: float = 0.1
    """The share of the memory kept free for the CUDA context, NCCL and the allocator's fragmentation."""

    def __post_init__(self) -> None:
        # Named as ``trl-jagg plan``'s flags, which build this.
        checks = {
            "num_processes": (self.num_processes, self.num_processes >= 1, "1 or more"),
            "gpu_memory_gb": (self.memory_gb, self.memory_gb > 0, "a positive size"),
            "gpu_tflops": (self.tflops, self.tflops > 0, "a positive rate"),
            "mfu": (self.mfu, 0 < self.mfu <= 1, "a share in (0, 1]"),
            "memory_margin": (self.margin, 0 <= self.margin < 1, "a share in [0, 1)"),
        }
        for name, (value, valid, expected) in checks.items():
            if not valid:
                raise ValueError(f"{name} is {value}. Use {expected}.")

    @property
    def usable_bytes(self) -> int:
        """What a process may use: the GPU's memory less the margin."""
        return int(self.memory_gb * 1e9 * (1 - self.margin))


@dataclass(frozen=True)
class BackboneMeasurement:
    """The backbone's sizes, one update call's saved activations and its FLOPs, measured on ``meta``."""

    sizes: ModelSizes
    activations: ActivationProfile
    flops: CallFlops
    rows: int

    def activation_bytes(self, checkpoint_every: int | None) -> int:
        """One micro-batch's activations with that checkpointing (``None``: off)."""
        if checkpoint_every is None:
            return self.activations.total
        return self.activations.checkpointed_bytes(checkpoint_every)


def _floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (in dicts and lists: Z-Image's per-sample inputs) in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {key: _floating(item, dtype) for key, item in value.items()}
    if isinstance(value, list):
        return [_floating(item, dtype) for item in value]
    return value


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def frozen_sizes(architecture: Architecture, weights_dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each frozen module (text encoders, VAE) loaded in ``weights_dtype``."""
    size = _element_size(weights_dtype)
    return {
        component.name: sum(p.numel() for p in component.build_on_meta().parameters()) * size
        for component in architecture.frozen
    }


def trained_backbones(architecture: Architecture, settings: RunSettings) -> list[str]:
    """The backbone components the run trains: the one transformer, or Wan2.2 A14B's experts of ``train_experts``."""
    names = list(architecture.backbones)
    return names if len(names) == 1 else [name for name in names if name in settings.trained_experts]


def _built_backbone(component: Component, settings: RunSettings, *, trained: bool) -> torch.nn.Module:
    """A backbone on ``meta`` in the compute dtype, as the trainer prepares it: LoRA added, all of it trainable,
    or (an expert the run does not train) frozen."""
    model = component.build_on_meta(settings.compute_dtype)
    if not trained or settings.lora is not None:
        model.requires_grad_(False)
    if trained and settings.lora is not None:
        from peft import LoraConfig

        with skipped_initialisation():
            model.add_adapter(LoraConfig(**settings.lora))
    return model


def measure_backbone(architecture: Architecture, settings: RunSettings) -> BackboneMeasurement:
    """Build the backbone on ``meta`` in the compute dtype (with the LoRA adapter, as the trainer adds it), run one
    update call of ``settings.rows`` rows: its saved activations, then its forward and backward FLOPs.

    Wan2.2 A14B's two experts are both held (trained or frozen, as ``train_experts`` says); each call runs one of
    them, so the call is measured on the first trained one."""
    trained_names = trained_backbones(architecture, settings)
    models = {
        name: _built_backbone(component, settings, trained=name in trained_names)
        for name, component in architecture.backbones.items()
    }
    weight_size = _element_size(settings.weights_dtype)
    # peft keeps adapters in float32 over a bf16/fp16 base; full fine-tuning trains the weights' dtype.
    trainable_size = 4 if settings.lora is not None else weight_size
    params = [p for model in models.values() for p in model.parameters()]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    largest_block = max(
        (
            sum(p.numel() for p in block.parameters())
            for model in models.values()
            for block in transformer_blocks(model)
        ),
        default=0,
    )
    sizes = ModelSizes(
        backbone_params=trainable + frozen,
        backbone_bytes=trainable * trainable_size + frozen * weight_size,
        trainable_params=trainable,
        trainable_bytes=trainable * trainable_size,
        largest_block_bytes=largest_block * weight_size,
        frozen_bytes=frozen_sizes(architecture, settings.weights_dtype),
    )
    shape = {
        "rows": settings.rows,
        "height": settings.height,
        "width": settings.width,
        "references": settings.references,
        "num_frames": settings.num_frames,
    }
    component, model = architecture.backbones[trained_names[0]], models[trained_names[0]]
    with torch.device("meta"):
        inputs = backbone_inputs(component.class_name, component.config, **shape, text_tokens=settings.text_tokens)
    inputs = _floating(inputs, settings.compute_dtype)
    activations = measure_activations(model, inputs)
    flops = count_flops(model, inputs)
    return BackboneMeasurement(sizes=sizes, activations=activations, flops=flops, rows=settings.rows)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds at the stated MFU, from the counted FLOPs of the backbone calls (exact backward: JAGG
    skips some of the update's backward rows; the VAE decode and the prompt encodings are left out)."""

    rollout_flops: float
    seconds_per_rollout: float
    seconds_per_optimizer_step: float
    sampling_share: float


def step_time(settings: RunSettings, measured: BackboneMeasurement, gpus: GPUs) -> StepTime:
    """Per process: a rollout samples ``micro_batch x steps_per_generation`` images (every denoising step, no graph),
    then trains ``steps_per_generation x num_iterations`` micro-batches at ``trained_steps`` denoising steps each
    (forward, backward and the checkpointed blocks' recomputation)."""
    forward_row = measured.flops.forward / measured.rows
    backward_row = measured.flops.backward_with_checkpointing(settings.checkpoint_every) / measured.rows
    images = settings.micro_batch * settings.steps_per_generation
    sampling = images * settings.branches * settings.inference_steps * forward_row
    micro_batches = settings.steps_per_generation * settings.num_iterations
    calls = micro_batches * settings.trained_steps * settings.micro_batch
    update = calls * (settings.branches * forward_row + settings.graph_branches * backward_row)
    total = sampling + update
    seconds = total / (gpus.tflops * 1e12 * gpus.mfu)
    optimizer_steps = max(1, micro_batches // settings.gradient_accumulation_steps)
    return StepTime(
        rollout_flops=total,
        seconds_per_rollout=seconds,
        seconds_per_optimizer_step=seconds / optimizer_steps,
        sampling_share=sampling / total,
    )


@dataclass(frozen=True)
class ResourcePlan:
    """The plan of one run on ``gpus``: the memory table per strategy, the verdict and the fix, the time."""

    settings: RunSettings
    gpus: GPUs
    sizes: ModelSizes
    tables: dict[str, list[MemoryRow]]
    time: StepTime
    fix: str | None
    """The cheapest change that makes the run's own strategy fit (``None`` when it fits, or nothing tried does)."""
    fix_peak_bytes: int | None = None

    def peak(self, strategy: str) -> int:
        """Peak bytes per process under ``strategy``."""
        return self.tables[strategy][-1].bytes

    def fits(self, strategy: str | None = None) -> bool:
        """Whether the peak under ``strategy`` (default: the run's own) leaves the margin free."""
        return self.peak(strategy or self.settings.strategy) <= self.gpus.usable_bytes


Measure = Callable[[RunSettings], BackboneMeasurement]


def cached_measure(architecture: Architecture) -> Measure:
    """:func:`measure_backbone` on ``architecture``, measured once per distinct backbone call (LoRA, rows, sizes,
    dtypes): the fixes a plan tries share the measurements."""
    cache: dict[str, BackboneMeasurement] = {}

    def measure(settings: RunSettings) -> BackboneMeasurement:
        key = json.dumps(
            [settings.lora, settings.rows, settings.height, settings.width, settings.text_tokens,
             str(settings.compute_dtype), str(settings.weights_dtype), settings.references, settings.num_frames,
             list(settings.trained_experts)],
            sort_keys=True,
        )  # fmt: skip
        if key not in cache:
            cache[key] = measure_backbone(architecture, settings)
        return cache[key]

    return measure


def _tables(settings: RunSettings, measured: BackboneMeasurement, gpus: GPUs) -> dict[str, list[MemoryRow]]:
    activations = measured.activation_bytes(settings.checkpoint_every)
    return {
        strategy: memory_rows(
            measured.sizes, settings.copies, activations, strategy=strategy, num_processes=gpus.num_processes
        )
        for strategy in STRATEGIES
    }


def candidate_changes(settings: RunSettings, default_lora: dict[str, Any]) -> list[tuple[str, RunSettings]]:
    """Single changes that lower the peak, cheapest for the run first: moving frozen modules or the EMA to the CPU
    (transfers), sharding the weights (communication), checkpointing every 4th, 2nd, every block (recomputation),
    halving the micro-batch (the same batch in more, smaller calls), and last LoRA (it changes what is trained)."""
    replace = dataclasses.replace
    copies = settings.copies
    changes: list[tuple[str, RunSettings]] = []
    if not copies.offload_frozen_modules:
        changes.append(
            ("--offload_frozen_modules true", replace(settings, copies=replace(copies, offload_frozen_modules=True)))
        )
    if copies.ema and not copies.ema_offload:
        changes.append(("--ema_offload true", replace(settings, copies=replace(copies, ema_offload=True))))
    if settings.strategy in ("ddp", "zero2"):
        changes.append(("--accelerate_config fsdp2 (or deepspeed_zero3)", replace(settings, strategy="fsdp2")))
    for every in (4, 2, 1):
        if settings.checkpoint_every is None or settings.checkpoint_every > every:
            flag = "--activation_checkpointing true"
            if every > 1:
                flag += f" --activation_checkpointing_kwargs '{{\"every_n_layers\": {every}}}'"
            changes.append((flag, replace(settings, checkpoint_every=every)))
    if settings.micro_batch > 1:
        half = settings.micro_batch // 2
        accumulation = settings.gradient_accumulation_steps * settings.micro_batch // half
        changes.append((
            f"--per_device_train_batch_size {half} --steps_per_generation {settings.steps_per_generation * 2} "
            f"--gradient_accumulation_steps {accumulation}",
            replace(settings, micro_batch=half, steps_per_generation=settings.steps_per_generation * 2,
                    gradient_accumulation_steps=accumulation),
        ))  # fmt: skip
    if settings.lora is None:
        flags = f"--use_peft true --lora_r {default_lora['r']}"
        changes.append((flags, replace(settings, lora=default_lora, copies=replace(copies, reference_copy=False))))
    return changes


def make_plan(
    settings: RunSettings,
    gpus: GPUs,
    measure: Measure,
    *,
    default_lora: dict[str, Any],
) -> ResourcePlan:
    """The :class:`ResourcePlan` of ``settings``; ``measure`` measures a backbone call (:func:`measure_backbone`
    bound to the architecture; called again only for a change that alters the backbone call: micro-batch, LoRA).

    When the run's strategy does not fit, the single changes of :func:`candidate_changes` are tried in order; if
    none fits alone, they are applied one after the other, each kept only if it lowers the peak, and the first
    combination that fits is the fix."""
    measured = measure(settings)
    tables = _tables(settings, measured, gpus)
    plan_time = step_time(settings, measured, gpus)
    plan = ResourcePlan(settings=settings, gpus=gpus, sizes=measured.sizes, tables=tables, time=plan_time, fix=None)
    if plan.fits():
        return plan

    def peak_of(candidate: RunSettings) -> int:
        return _tables(candidate, measure(candidate), gpus)[candidate.strategy][-1].bytes

    changes = candidate_changes(settings, default_lora)
    for flags, candidate in changes:
        peak = peak_of(candidate)
        if peak <= gpus.usable_bytes:
            return dataclasses.replace(plan, fix=flags, fix_peak_bytes=peak)
    # Keyed by each change's first flag: a later checkpointing interval replaces an earlier one's flags.
    combined, applied, peak = settings, {}, plan.peak(settings.strategy)
    for flags, candidate in changes:
        trial = _apply(combined, settings, candidate)
        trial_peak = peak_of(trial)
        if trial_peak >= peak:
            continue  # no help on top of the changes kept (another copy bounds the peak)
        combined, peak = trial, trial_peak
        applied[flags.split()[0]] = flags
        if peak <= gpus.usable_bytes:
            return dataclasses.replace(plan, fix=" ".join(applied.values()), fix_peak_bytes=peak)
    return plan


def _apply(current: RunSettings, base: RunSettings, change: RunSettings) -> RunSettings:
    """``current`` with the fields ``change`` alters relative to ``base``."""
    updates = {
        field.name: getattr(change, field.name)
        for field in dataclasses.fields(RunSettings)
        if getattr(change, field.name) != getattr(base, field.name)
    }
    if "copies" in updates:
        copy_updates = {
            field.name: getattr(change.copies, field.name)
            for field in dataclasses.fields(change.copies)
            if getattr(change.copies, field.name) != getattr(base.copies, field.name)
        }
        updates["copies"] = dataclasses.replace(current.copies, **copy_updates)
    return dataclasses.replace(current, **updates)
