"""Velocity-cache benchmark: how far each ``jagg_cache_mode`` moves the update's gradient after optimizer steps.

After an optimizer step since the rollout, the rollout's recorded velocities are the old policy's. The reference
is the JAGG gradient with the intermediate velocities recomputed at the current weights (``"recompute"``); the
benchmark measures the gradient of ``"checked"`` (a heuristic: corrected where the group's signals hold, see
:mod:`trl_jagg.core.velocity_cache`), ``"corrected"`` (each cached intermediate moved by its group's endpoint change)
and ``"stale"`` (the cache as it is) against it, on the CPU demo (:mod:`trl_jagg.demo.run`: the shipped tiny Flux
pipeline, its LoRA and learning rate, 72 images, one JAGG group of W = 4 on the 4 SDE steps):

1. One rollout at the base weights, one micro-batch (the demo's cadence).
2. At 0, 1, ..., ``optimizer_steps`` optimizer steps since the rollout: the gradient of every mode on that rollout;
   then an optimizer step (the trainer's optimizer, gradient clipping as in training) with the reference gradient.
3. Per mode and step: the cosine to the reference and the relative error ``|g - g_ref| / |g_ref|`` (and, for
   ``checked``, the groups' largest sensitivity and the intermediates it recomputed). The gate a mode must pass to be
   the default: cosine >= 0.999 and relative error <= 1e-3 at 1, 2 and 3 steps.

It also trains one rollout at ``steps_per_generation = optimizer_steps`` (``dancegrpo-flux``'s 3 optimizer steps per
rollout) in every mode and reports the cache's hits per micro-batch (``engine/jagg/cached_velocities``,
``engine/jagg/corrected_velocities``, ``engine/jagg/no_grad_forwards``).

    trl-jagg bench velocity-cache --output_dir runs/bench [--optimizer_steps 3] [--seed 0]

writes ``velocity_cache_benchmark.json`` and ``velocity_cache_benchmark.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from trl_jagg.benchmarks.engine import torch_threads
from trl_jagg.core.velocity_cache import VELOCITY_CACHE_MODES
from trl_jagg.demo.run import DEMO_ASSET_DIR, NUM_GENERATIONS, demo_prompts, demo_trainer

JSON_NAME = "velocity_cache_benchmark.json"
PNG_NAME = "velocity_cache_benchmark.png"
GATE = {"cosine": 0.999, "relative_error": 1e-3}
"""What a mode must reach at every measured optimizer step to be the default."""
REFERENCE_MODE = "recompute"


def mode_gradient(trainer: Any, batch: dict[str, Any], mode: str, global_step: int) -> tuple[torch.Tensor, Any]:
    """The flat float64 gradient of one update of ``batch`` at optimizer step ``global_step`` with
    ``jagg_cache_mode=mode`` (restored afterwards), and the engine's result; ``.grad`` keeps that gradient."""
    args, model = trainer.args, trainer.model
    saved = args.jagg_cache_mode
    args.jagg_cache_mode = mode
    try:
        model.zero_grad(set_to_none=True)
        model.train()
        result = trainer.update_stage.run(model, batch, micro_step=0, global_step=global_step, accumulation_steps=1)
    finally:
        args.jagg_cache_mode = saved
    params = [p for p in model.parameters() if p.requires_grad]
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    return grad.double(), result


def compare(gradient: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Cosine, relative error ``|g - g_ref| / |g_ref|`` and norm ratio ``|g| / |g_ref|`` (float64)."""
    norm = reference.norm()
    return {
        "cosine": (gradient @ reference / (gradient.norm() * norm)).item(),
        "relative_error": ((gradient - reference).norm() / norm).item(),
        "norm_ratio": (gradient.norm() / norm).item(),
    }


def cache_gradient_errors(
    trainer: Any,
    rollout: dict[str, Any],
    optimizer_steps: int,
    modes: tuple[str, ...] = ("checked", "corrected", "stale"),
) -> list[dict[str, Any]]:
    """Each mode's gradient against ``recompute``'s on ``rollout`` (recorded at ``trainer.state.global_step``)
    after 0 .. ``optimizer_steps`` optimizer steps, each taken with the reference gradient by the trainer's
    optimizer after clipping to ``max_grad_norm`` (as ``train()`` does). Returns one row per (steps, mode) with
    :func:`compare`'s figures and the engine's cache counts. The trainer's weights are moved."""
    args, model = trainer.args, trainer.model
    start = trainer.state.global_step
    if trainer.optimizer is None:
        trainer.create_optimizer()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for taken in range(optimizer_steps + 1):
        step = start + taken
        results = {mode: mode_gradient(trainer, rollout, mode, step) for mode in modes}
        reference, ref_result = mode_gradient(trainer, rollout, REFERENCE_MODE, step)  # last: its .grad is kept
        for mode, (gradient, result) in results.items():
            rows.append({
                "optimizer_steps": taken, "mode": mode, **compare(gradient, reference),
                "cached": result.num_cached, "corrected": result.num_corrected, "rejected": result.num_rejected,
                "sensitivity": result.cache_sensitivity,
                "no_grad_forwards": result.num_no_grad_forwards,
                "reference_no_grad_forwards": ref_result.num_no_grad_forwards,
            })  # fmt: skip
        if taken < optimizer_steps:
            if args.max_grad_norm and args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            trainer.optimizer.step()
    model.zero_grad(set_to_none=True)
    return rows


def cadence_hits(
    model: str, run_dir: str, *, steps_per_rollout: int, seed: int, **overrides: Any
) -> list[dict[str, int]]:
    """The cache's counts per micro-batch when the demo (with config ``overrides``) trains one rollout in
    ``steps_per_rollout`` optimizer steps (``steps_per_generation``, one micro-batch each, the rollout sampled at the
    micro-batch size)."""
    images = len(demo_prompts()) * NUM_GENERATIONS
    if images % steps_per_rollout or (images // steps_per_rollout) % NUM_GENERATIONS:
        raise ValueError(f"`optimizer_steps` ({steps_per_rollout}) must split {images} images into whole groups.")
    trainer = demo_trainer(
        model, run_dir, steps=steps_per_rollout, seed=seed, per_device_train_batch_size=images // steps_per_rollout,
        steps_per_generation=steps_per_rollout, **overrides,
    )  # fmt: skip
    trainer.train()
    keys = ("engine/jagg/cached_velocities", "engine/jagg/corrected_velocities", "engine/jagg/no_grad_forwards")
    logs = sorted((e for e in trainer.state.log_history if keys[0] in e), key=lambda e: e["step"])
    return [{"step": e["step"], **{k.rsplit("/", 1)[1]: int(e[k]) for k in keys}} for e in logs]


def gate_passed(rows: list[dict[str, Any]], mode: str) -> bool:
    """Whether ``mode`` meets :data:`GATE` at every measured step after the first optimizer step."""
    after = [r for r in rows if r["mode"] == mode and r["optimizer_steps"] > 0]
    return bool(after) and all(
        r["cosine"] >= GATE["cosine"] and r["relative_error"] <= GATE["relative_error"] for r in after
    )


def plot_report(rows: list[dict[str, Any]], path: Path) -> None:
    """Cosine gap ``1 - cos`` and relative error per optimizer step, per mode, with the gate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.6), dpi=100)
    FigureCanvasAgg(figure)
    gap_ax, error_ax = figure.subplots(1, 2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode and r["optimizer_steps"] > 0]
        steps = [r["optimizer_steps"] for r in mine]
        gap_ax.plot(steps, [max(1 - r["cosine"], 1e-12) for r in mine], "o-", label=mode)
        error_ax.plot(steps, [max(r["relative_error"], 1e-12) for r in mine], "o-", label=mode)
    gap_ax.axhline(1 - GATE["cosine"], color="gray", ls=":", label="gate")
    error_ax.axhline(GATE["relative_error"], color="gray", ls=":", label="gate")
    gap_ax.set(xlabel="optimizer steps since the rollout", ylabel="1 - cosine to recompute", yscale="log")
    error_ax.set(xlabel="optimizer steps since the rollout", ylabel="|g - g_recompute| / |g_recompute|", yscale="log")
    gap_ax.legend()
    figure.suptitle("JAGG gradient with the rollout's velocities vs recomputed intermediates (CPU demo)")
    figure.tight_layout()
    figure.savefig(path)


def run_velocity_cache_benchmark(
    output_dir: str,
    *,
    model: str = DEMO_ASSET_DIR,
    optimizer_steps: int = 3,
    seed: int = 0,
    learning_rate: float | None = None,
    clip_range: float | None = None,
    num_threads: int = 1,
    plot: bool = True,
) -> dict[str, Any]:
    """Measure every cache mode's gradient error and hits (see the module docstring); returns and writes the report.

    Args:
        output_dir: where the JSON and PNG (and the trainers' folders) go.
        model: the pipeline (the shipped demo model by default).
        optimizer_steps: optimizer steps since the rollout to measure after, and per rollout for the hit counts.
        seed: the LoRA initialisation and the rollout's seed.
        learning_rate: overrides the demo's (``None``: the demo's 1e-2).
        clip_range: overrides the demo's PPO clip range (``None``: the default 1e-4); a large one (1.0) never clips,
            which shows how much of the error comes from ratios crossing the clip edge.
        num_threads: torch CPU threads; restored afterwards.
        plot: write the PNG.
    """
    if optimizer_steps < 1:
        raise ValueError(f"`optimizer_steps` must be >= 1, got {optimizer_steps}.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = {k: v for k, v in {"learning_rate": learning_rate, "epsilon": clip_range}.items() if v is not None}
    with torch_threads(num_threads):
        trainer = demo_trainer(model, str(out / "velocity_cache_runs" / "gradients"), steps=1, seed=seed, **overrides)
        rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
        rows = cache_gradient_errors(trainer, rollout, optimizer_steps)
        hits = {
            mode: cadence_hits(
                model,
                str(out / "velocity_cache_runs" / mode),
                steps_per_rollout=optimizer_steps,
                seed=seed,
                jagg_cache_mode=mode,
                **overrides,
            )  # fmt: skip
            for mode in VELOCITY_CACHE_MODES
        }
    report = {
        "config": {
            "model": "trl_jagg/demo/assets/demo_flux" if model == DEMO_ASSET_DIR else model, "seed": seed, "optimizer_steps": optimizer_steps,
            "learning_rate": trainer.args.learning_rate, "clip_range": trainer.args.epsilon,
            "max_grad_norm": trainer.args.max_grad_norm,
            "jagg_group_size": trainer.args.jagg_group_size, "jagg_cache_tolerance": trainer.args.jagg_cache_tolerance, "images": len(demo_prompts()) * NUM_GENERATIONS,
            "torch_threads": num_threads, "torch": torch.__version__, "gate": GATE, "reference": REFERENCE_MODE,
        },
        "gradients": rows,
        "passes_gate": {mode: gate_passed(rows, mode) for mode in dict.fromkeys(r["mode"] for r in rows)},
        "hits_per_micro_batch": hits,
    }  # fmt: skip
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    if plot:
        plot_report(rows, out / PNG_NAME)
    print(format_report(report), flush=True)
    print(f"[velocity-cache] wrote {out / JSON_NAME}", flush=True)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as the table printed at the end of a run (the numbers docs/benchmarks.md quotes)."""
    lines = [
        "steps  mode        cosine      rel. error  norm ratio  cached  corrected  rejected  sensitivity  no-grad fwd"
    ]
    for r in report["gradients"]:
        lines.append(
            f"{r['optimizer_steps']:>5}  {r['mode']:<10}  {r['cosine']:.7f}  {r['relative_error']:.3e}   "
            f"{r['norm_ratio']:.5f}   {r['cached']:>6}  {r['corrected']:>9}  {r['rejected']:>8}  "
            f"{r['sensitivity']:>11.3e}  {r['no_grad_forwards']:>11}"
        )
    for mode, passed in report["passes_gate"].items():
        lines.append(f"{mode} passes the gate {report['config']['gate']}: {passed}")
    for mode, entries in report["hits_per_micro_batch"].items():
        per = ", ".join(f"{e['cached_velocities']}/{e['no_grad_forwards']}" for e in entries)
        lines.append(f"{mode:<10} cached/recomputed intermediates per micro-batch: {per}")
    return "\n".join(lines)
