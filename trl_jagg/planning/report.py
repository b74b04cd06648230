"""A :class:`~trl_jagg.planning.plan.ResourcePlan` as the text ``trl-jagg plan`` prints and as JSON."""

from __future__ import annotations

from typing import Any

from trl_jagg.planning.memory import FROZEN_ROW, STRATEGIES
from trl_jagg.planning.plan import ResourcePlan

GB = 1e9


def _gb(value: int) -> str:
    return f"{value / GB:.1f}"


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def format_plan(plan: ResourcePlan, *, title: str) -> str:
    """The plan as a table: one row per component, one column per strategy (GB per process), then the verdict,
    the fix and the predicted time."""
    settings, gpus, sizes = plan.settings, plan.gpus, plan.sizes
    trained = "LoRA" if settings.lora is not None else "full fine-tuning"
    checkpointing = (
        "off" if settings.checkpoint_every is None
        else "every block" if settings.checkpoint_every == 1 else f"every {settings.checkpoint_every}th block"
    )  # fmt: skip
    frames = f" x {settings.num_frames} frames" if settings.num_frames is not None else ""
    samples = "video(s)" if settings.num_frames is not None else "image(s)"
    lines = [
        f"{title}: {settings.model}",
        f"  backbone {sizes.backbone_params / 1e9:.2f}B parameters, {trained}: {sizes.trainable_params / 1e9:.3f}B "
        f"trained; weights {_dtype(settings.weights_dtype)}, compute {_dtype(settings.compute_dtype)}",
        f"  {settings.height} x {settings.width} px{frames}, {settings.text_tokens} text tokens, micro-batch "
        f"{settings.micro_batch} {samples} x {settings.branches} branch(es); activation checkpointing {checkpointing}",
        f"  on {gpus.num_processes} processes x {gpus.memory_gb:g} GB ({_gb(gpus.usable_bytes)} GB usable: "
        f"{gpus.margin:.0%} kept free)",
        "",
        f"{'per process, GB':<30}" + "".join(f"{name:>9}" for name in STRATEGIES) + "   note",
    ]
    components = [row.component for row in plan.tables[settings.strategy]]
    for index, component in enumerate(components):
        if component != FROZEN_ROW and not any(plan.tables[name][index].bytes for name in STRATEGIES):
            continue  # a copy this run does not keep (the frozen modules' row stays: offloaded, it says where)
        values = "".join(f"{_gb(plan.tables[name][index].bytes):>9}" for name in STRATEGIES)
        note = plan.tables[settings.strategy][index].note
        lines.append(f"{component:<30}{values}   {note}".rstrip())
    verdicts = "".join(f"{'yes' if plan.fits(name) else 'no':>9}" for name in STRATEGIES)
    lines.append(f"{'fits':<30}{verdicts}")
    lines.append("")
    own = settings.strategy
    if plan.fits():
        lines.append(f"Fits under {own} (the run's strategy): peak {_gb(plan.peak(own))} GB per process.")
    elif plan.fix is not None:
        lines.append(
            f"Does not fit under {own} (the run's strategy): peak {_gb(plan.peak(own))} GB > {_gb(gpus.usable_bytes)}"
            f" GB usable. Cheapest change that fits: {plan.fix} (peak {_gb(plan.fix_peak_bytes or 0)} GB)."
        )
    else:
        lines.append(
            f"Does not fit under {own}: peak {_gb(plan.peak(own))} GB, and no change tried fits: use GPUs with "
            "more memory or more processes."
        )
    time = plan.time
    lines.append(
        f"Predicted at {gpus.mfu:.0%} MFU of {gpus.tflops:g} TFLOP/s: {time.seconds_per_rollout:.1f} s per rollout "
        f"({time.sampling_share:.0%} sampling), {time.seconds_per_optimizer_step:.1f} s per optimizer step "
        f"({time.rollout_flops / 1e15:.2f} PFLOP per rollout per process; exact backward, VAE and text encoders "
        "not priced)."
    )
    return "\n".join(lines)


def plan_as_dict(plan: ResourcePlan) -> dict[str, Any]:
    """The plan as JSON-friendly values (bytes per process, per strategy)."""
    return {
        "model": plan.settings.model,
        "strategy": plan.settings.strategy,
        "num_processes": plan.gpus.num_processes,
        "gpu_memory_gb": plan.gpus.memory_gb,
        "usable_bytes": plan.gpus.usable_bytes,
        "num_frames": plan.settings.num_frames,
        "backbone_params": plan.sizes.backbone_params,
        "trainable_params": plan.sizes.trainable_params,
        "tables": {name: {row.component: row.bytes for row in rows} for name, rows in plan.tables.items()},
        "fits": {name: plan.fits(name) for name in STRATEGIES},
        "fix": plan.fix,
        "fix_peak_bytes": plan.fix_peak_bytes,
        "seconds_per_rollout": plan.time.seconds_per_rollout,
        "seconds_per_optimizer_step": plan.time.seconds_per_optimizer_step,
        "rollout_flops": plan.time.rollout_flops,
    }
