"""Trainer-level benchmark: the update stage of :class:`DDPOJaggTrainer`, exact vs JAGG vs JAGG + velocity cache.

It runs the real path on a Flux-architecture pipeline built from config (the adapter's backbone call, the SDE
log-prob, the PPO loss, ``accelerator.backward``) with a realistic token mix: the recipe's 512 text tokens
(FLUX.1-dev's ``max_sequence_length``) and more image tokens than text tokens. Every repeat samples a fresh rollout
(timed: the whole-step speedup uses the rollout of the same repeat) and then times, interleaved and in alternating
order, every variant's update on it:

- ``exact``: one backward per trained step (today's path: one KL-reference call per step);
- ``exact_batched`` (``beta > 0`` only): the same with the KL-reference forwards batched;
- ``jagg``: JAGG as in the paper (intermediate velocities recomputed, one no-grad call per step);
- ``jagg_cache``: JAGG with the on-policy velocity cache and batched no-grad calls;
- ``jagg_cache_seq``: the same with ``jagg_endpoint_backward="sequential"`` (one endpoint graph alive).

for every ``W`` in ``group_sizes``, ``jagg_frac`` in ``jagg_fracs`` and ``beta`` in ``betas``. Ratios are taken per
repeat and reported as median, min and max; times are wall time on a GPU and the process's CPU time on a CPU (see
:func:`benchmark_clock`). Backbone calls are counted by hooks (forwards with and without graph,
reference forwards, backward calls), and the peak memory of each variant's update is measured: the CUDA peak on a
GPU; on CPU (Linux) the growth of the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after returning freed memory with ``malloc_trim``) over the update.

``family="flux_kontext"`` runs the same on a tiny FLUX.1 Kontext (image editing): each sample edits a source image
whose latents join the sequence, so every backbone call carries twice the image tokens while only the generated
ones are trained; the update's speedup on that longer sequence is the editing variant of the benchmark.
"""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from trl_jagg.benchmarks.engine import torch_threads
from trl_jagg.benchmarks.measuring import (
    BackboneCallCounter,
    benchmark_clock,
    endless_batches,
    measure_peak_memory_mb,
    spread,
    sync_device,
)

PROMPTS = ["a red circle", "a green square", "a blue triangle", "a red square"]
FAMILIES = ("flux", "flux_kontext", "wan")
"""The tiny pipelines the benchmark runs on: text-to-image Flux, FLUX.1 Kontext (editing) and Wan2.1 (video)."""
JSON_NAME = "trainer_benchmark.json"
PNG_NAME = "trainer_benchmark.png"
VARIANTS: dict[str, dict[str, Any]] = {
    "exact": {"use_jagg": False, "no_grad_batch_steps": 1},
    "exact_batched": {"use_jagg": False, "no_grad_batch_steps": None},
    "jagg": {"use_jagg": True, "jagg_cache_velocities": False, "no_grad_batch_steps": 1},
    "jagg_cache": {"use_jagg": True, "jagg_cache_velocities": True, "no_grad_batch_steps": None},
    "jagg_cache_seq": {
        "use_jagg": True,
        "jagg_cache_velocities": True,
        "no_grad_batch_steps": None,
        "jagg_endpoint_backward": "sequential",
    },
}
"""The config fields each variant sets on the trainer before its update (the rest is the benchmark's config)."""
JAGG_VARIANTS = ("jagg", "jagg_cache", "jagg_cache_seq")
TARGETS = (
    # (what, beta, W, variant, baseline, minimum median ratio): issue 9's targets, jagg_frac = 1.
    ("W=4 JAGG vs exact", 0.0, 4, "jagg", "exact", 1.35),
    ("W=4 JAGG+cache vs exact", 0.0, 4, "jagg_cache", "exact", 1.8),
    ("W=8 JAGG vs exact", 0.0, 8, "jagg", "exact", 1.7),
    ("W=8 JAGG+cache vs exact", 0.0, 8, "jagg_cache", "exact", 3.2),
    ("beta>0 W=4 JAGG+cache vs JAGG", "kl", 4, "jagg_cache", "jagg", 1.15),
)


def theory(variant: str, group_size: int, num_trained: int, jagg_frac: float) -> float:
    """The cost model's exact/variant ratio over the whole plan, in forward units (a backward = 2 forwards; KL
    reference forwards left out): exact ``3`` per step; JAGG ``W + 4`` per group, with the cache ``6``."""
    from trl_jagg.core.jagg import plan_groups

    if variant.startswith("exact"):
        return 1.0
    groups = plan_groups([1.0 - k / num_trained for k in range(num_trained)], group_size, jagg_frac)
    joint = 6 if variant.startswith("jagg_cache") else None
    cost = sum((joint or len(g.steps) + 4) if g.is_joint else 3 * len(g.steps) for g in groups)
    return 3 * num_trained / cost


def run_trainer_benchmark(
    output_dir: str,
    *,
    group_sizes: Sequence[int] = (2, 4, 8),
    jagg_fracs: Sequence[float] = (0.6, 1.0),
    betas: Sequence[float] = (0.0, 0.04),
    num_inference_steps: int = 9,
    resolution: int = 384,
    max_sequence_length: int = 512,
    batch: int = 2,
    num_layers: int = 2,
    num_single_layers: int = 4,
    repeats: int = 5,
    lora: bool = False,
    memory: bool = True,
    seed: int = 0,
    num_threads: int = 1,
    plot: bool = True,
    family: str = "flux",
    num_frames: int = 9,
) -> dict[str, Any]:
    """Time the update stage of the real trainer for every variant (see the module docstring) on a tiny Flux, a
    tiny FLUX.1 Kontext (editing) or a tiny Wan2.1 making videos (``family``: the long token sequences).

    Returns (and writes as JSON, and PNG unless ``plot=False``) the configuration, the rollout seconds of every
    repeat and, per (beta, W, jagg_frac, variant): update seconds, speedups over exact (update stage and whole
    step) and, for the cached variants, over today's JAGG (median/min/max and per repeat), the backbone calls
    counted by hooks, the peak memory of the update (``jagg_frac=1`` only) and the cost model's ratio; then the
    issue's targets with the measured figures.

    Args:
        output_dir: where ``trainer_benchmark.json`` and ``trainer_benchmark.png`` go.
        group_sizes: the JAGG group sizes W.
        jagg_fracs: the routed fractions of groups.
        betas: KL coefficients; each gets its own trainer (and reference model when ``beta > 0``).
        num_inference_steps: denoising steps; all but the last are trained.
        resolution: image height and width in pixels (a multiple of 16); ``(resolution / 16)^2`` image tokens.
        max_sequence_length: text tokens (T5 pads every prompt to it; 512 is FLUX.1-dev's).
        batch: images per micro-batch (a multiple of 2: prompts x 2 generations).
        num_layers, num_single_layers: double- and single-stream blocks of the Flux transformer.
        repeats: timed repeats after one warm-up repeat; each samples a rollout and times every variant on it.
        lora: train a LoRA adapter (attention projections, rank 8) instead of the full backbone.
        memory: also measure each variant's peak update memory (two extra updates per variant at ``jagg_frac=1``).
        seed: seed of the model weights and the rollouts.
        num_threads: torch CPU threads while timing (1: on a shared machine more threads mostly time the
            scheduler); restored afterwards.
        plot: write the PNG chart.
        family: ``"flux"``, ``"flux_kontext"`` (editing: one source image per prompt, as many reference tokens as
            image tokens in every backbone call) or ``"wan"`` (videos of ``num_frames`` frames,
            ``(num_frames - 1) / 4 + 1`` latent frames of ``(resolution / 16)^2`` tokens each; ``num_layers`` Wan
            blocks, no CFG).
        num_frames: frames of each video (``4 k + 1``) when ``family="wan"``.
    """
    from peft import LoraConfig

    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.testing.tiny_models import save_tiny_pipeline
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer

    if not group_sizes or any(not isinstance(w, int) or w < 1 for w in group_sizes):
        raise ValueError(f"`group_sizes` must be integers >= 1, got {group_sizes!r}.")
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    if resolution % 16:
        raise ValueError(f"`resolution` must be a multiple of 16 (8x VAE, 2x2 packing), got {resolution}.")
    if batch < 2 or batch % 2:
        raise ValueError(f"`batch` must be a positive multiple of 2 (2 generations per prompt), got {batch}.")
    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {FAMILIES}, got {family!r}.")
    columns: dict[str, list] = {"prompt": PROMPTS}
    if family == "flux_kontext":  # the images the prompts edit: random pixels (a constant image encodes alike)
        generator = torch.Generator().manual_seed(seed)
        columns["source_image"] = [_random_image(resolution, generator) for _ in PROMPTS]
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    num_trained = num_inference_steps - 1
    results: list[dict[str, Any]] = []
    rollouts: dict[str, list[float]] = {}
    with torch_threads(num_threads):
        with tempfile.TemporaryDirectory() as tmp:
            blocks = {"num_layers": num_layers}
            blocks |= {"num_single_layers": num_single_layers} if family != "wan" else {}
            model_dir = save_tiny_pipeline(family, str(Path(tmp) / family), seed=seed, transformer=blocks)
            # Wan's guidance_scale is a CFG scale: 1 runs one branch, as Flux's embedded guidance does.
            video = {"num_frames": num_frames, "guidance_scale": 1.0} if family == "wan" else {}
            for beta in betas:
                config = GRPOJaggConfig(
                    output_dir=str(Path(tmp) / "run"),
                    per_device_train_batch_size=batch,
                    num_generations=2,
                    num_inference_steps=num_inference_steps,
                    height=resolution,
                    width=resolution,
                    max_sequence_length=max_sequence_length,
                    beta=beta,
                    jagg_frac=1.0,
                    report_to="none",
                    disable_tqdm=True,
                    use_cpu=not torch.cuda.is_available(),
                    seed=seed,
                    **video,
                )
                torch.manual_seed(seed)
                trainer = DDPOJaggTrainer(
                    model=model_dir,
                    reward_funcs="prompt_color",
                    args=config,
                    train_dataset=Dataset.from_dict(columns),
                    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["to_q", "to_k", "to_v"])
                    if lora
                    else None,
                )
                beta_results, rollouts[str(beta)] = time_variants(
                    trainer, group_sizes=group_sizes, jagg_fracs=jagg_fracs, repeats=repeats, memory=memory
                )
                results.extend(beta_results)
                del trainer
                gc.collect()
    report = {
        "config": {
            "family": family,
            "num_frames": num_frames if family == "wan" else None,
            "num_inference_steps": num_inference_steps,
            "trained_steps": num_trained,
            "resolution": resolution,
            "image_tokens": (resolution // 16) ** 2 * ((num_frames - 1) // 4 + 1 if family == "wan" else 1),
            "reference_tokens": (resolution // 16) ** 2 if family == "flux_kontext" else 0,
            "text_tokens": max_sequence_length,
            "batch": batch,
            "num_layers": num_layers,
            "num_single_layers": num_single_layers,
            "group_sizes": list(group_sizes),
            "jagg_fracs": list(jagg_fracs),
            "betas": list(betas),
            "repeats": repeats,
            "lora": lora,
            "torch_threads": num_threads,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "timer": "wall time (perf_counter)" if torch.cuda.is_available() else "process CPU time (process_time)",
            "memory_method": (
                "torch.cuda.max_memory_allocated"
                if torch.cuda.is_available()
                else "VmHWM growth over the update (Linux), after malloc_trim and clear_refs"
            ),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "rollout_s": {beta: spread(values) for beta, values in rollouts.items()},
        "results": results,
        "targets": _targets(results, betas),
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    if plot:
        _plot(report, out / PNG_NAME)
    _print_report(report)
    print(f"wrote {out / JSON_NAME}" + (f" and {out / PNG_NAME}" if plot else ""))
    return report


def _random_image(size: int, generator: torch.Generator) -> Any:
    """A ``size`` x ``size`` RGB PIL image of uniform random pixels."""
    from PIL import Image

    pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _instances(
    beta: float, group_sizes: Sequence[int], jagg_fracs: Sequence[float]
) -> list[tuple[str, int | None, float | None]]:
    """The (variant, W, jagg_frac) updates timed in every repeat; exact ones do not depend on W."""
    instances: list[tuple[str, int | None, float | None]] = [("exact", None, None)]
    if beta > 0:
        instances.append(("exact_batched", None, None))
    for w in group_sizes:
        for frac in jagg_fracs:
            # Sequential endpoints change memory, not the routing: timed at jagg_frac = 1 only.
            instances.extend((v, w, frac) for v in JAGG_VARIANTS if v != "jagg_cache_seq" or frac == 1.0)
    return instances


@contextlib.contextmanager
def _configured(trainer: Any, variant: str, group_size: int | None, jagg_frac: float | None) -> Iterator[None]:
    args = trainer.args
    settings = {"jagg_cache_velocities": True, "jagg_endpoint_backward": "joint", **VARIANTS[variant]}
    if group_size is not None:
        settings |= {"jagg_group_size": group_size, "jagg_frac": jagg_frac}
    saved = {k: getattr(args, k) for k in settings}
    for key, value in settings.items():
        setattr(args, key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(args, key, value)


def time_update(
    trainer: Any, rollout: dict[str, Any], variant: str, group_size: int | None = None, jagg_frac: float | None = None
) -> float:
    """Seconds of the update of ``rollout`` (the trainer's update stage on each of its ``steps_per_generation``
    micro-batches, as in training) with the settings of ``variant`` (see :data:`VARIANTS`), and ``group_size`` /
    ``jagg_frac`` for the JAGG ones; gradients are zeroed first and the config restored."""

    model = trainer.model
    device = trainer.accelerator.device
    micro_batches = rollout.split(trainer.args.steps_per_generation)
    model.zero_grad(set_to_none=True)
    model.train()
    clock = benchmark_clock(device)
    sync_device(device)
    start = clock()
    with _configured(trainer, variant, group_size, jagg_frac):
        for micro_batch in micro_batches:
            trainer.update_stage.run(
                model, micro_batch, micro_step=trainer._step, global_step=trainer.state.global_step,
                accumulation_steps=trainer.current_gradient_accumulation_steps,
            )  # fmt: skip
    sync_device(device)
    return clock() - start


def time_variants(
    trainer: Any, *, group_sizes: Sequence[int], jagg_fracs: Sequence[float], repeats: int, memory: bool = True
) -> tuple[list[dict[str, Any]], list[float]]:
    """Time every variant's update (see the module docstring) on ``trainer``, interleaved per repeat, each repeat on
    a fresh (timed) rollout; one warm-up repeat counts the backbone calls; then, with ``memory``, two more updates
    per variant at ``jagg_frac = 1`` (in opposite orders, the smaller peak kept) measure its peak memory.

    Returns the per-variant results (as in :func:`run_trainer_benchmark`'s report) and the rollout seconds of every
    timed repeat.
    """
    from trl_jagg.objectives.grpo import trained_steps

    model = trainer.model
    device = trainer.accelerator.device
    beta = trainer.args.beta
    batches = endless_batches(trainer)
    instances = _instances(beta, group_sizes, jagg_fracs)
    times: dict[tuple, list[float]] = {i: [] for i in instances}
    calls: dict[tuple, dict[str, int]] = {}
    rollout_times: list[float] = []

    clock = benchmark_clock(device)

    def sample() -> tuple[dict[str, Any], float]:
        sync_device(device)
        start = clock()
        with _configured(trainer, "jagg_cache", None, None):  # records the velocities
            rollout = trainer._generate_and_score(next(batches))
        sync_device(device)
        return rollout, clock() - start

    # Repeat 0 is the warm-up (and counts the backbone calls); then ABAB...BABA over the instances.
    for repeat in range(repeats + 1):
        rollout, rollout_s = sample()
        num_trained = len(
            trained_steps(trainer.args, rollout, micro_step=trainer._step, global_step=trainer.state.global_step)
        )
        order = instances if repeat % 2 == 0 else instances[::-1]
        for instance in order:
            if repeat == 0:
                with BackboneCallCounter(trainer) as counter:
                    time_update(trainer, rollout, *instance)
                calls[instance] = counter.take()
            else:
                times[instance].append(time_update(trainer, rollout, *instance))
        if repeat > 0:
            rollout_times.append(rollout_s)
        trainer._metrics.clear()
    peaks: dict[tuple, float | None] = {}
    if memory:
        # Two passes in opposite orders, the smaller reading kept: one-off allocations land on one variant only.
        rollout, _ = sample()
        measured = [i for i in instances if i[2] in (None, 1.0)]
        for order in (measured, measured[::-1]):
            for instance in order:
                peak = measure_peak_memory_mb(lambda i=instance: time_update(trainer, rollout, *i), device)
                peaks[instance] = peak if peaks.get(instance) is None else min(peaks[instance], peak)
        trainer._metrics.clear()
    model.zero_grad(set_to_none=True)

    exact = times[("exact", None, None)]
    by_repeat_jagg = {(w, f): times[("jagg", w, f)] for w in group_sizes for f in jagg_fracs}
    results = []
    for instance in instances:
        variant, w, frac = instance
        entry: dict[str, Any] = {
            "beta": beta,
            "variant": variant,
            "group_size": w,
            "jagg_frac": frac,
            "update_s": spread(times[instance]),
            "update_speedup": spread([e / t for e, t in zip(exact, times[instance])]),
            "step_speedup": spread([(r + e) / (r + t) for r, e, t in zip(rollout_times, exact, times[instance])]),
            "calls": calls[instance],
            "peak_memory_mb": peaks.get(instance),
            "theory_update_speedup": theory(variant, w or 1, num_trained, frac or 0.0),
        }
        if variant.startswith("jagg_cache"):
            entry["speedup_vs_jagg"] = spread([j / t for j, t in zip(by_repeat_jagg[w, frac], times[instance])])
        results.append(entry)
    return results, rollout_times


def _find(results: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in results if all(r.get(k) == v for k, v in match.items())), None)


def _targets(results: list[dict[str, Any]], betas: Sequence[float]) -> list[dict[str, Any]]:
    """Issue 9's targets (median ratios at ``jagg_frac = 1``) with the measured figures, where they were run."""
    kl_betas = [b for b in betas if b > 0]
    targets = []
    for what, beta, w, variant, baseline, minimum in TARGETS:
        beta = kl_betas[0] if beta == "kl" and kl_betas else beta
        entry = _find(results, beta=beta, group_size=w, jagg_frac=1.0, variant=variant)
        if entry is None:
            continue
        measured = entry["update_speedup" if baseline == "exact" else "speedup_vs_jagg"]["median"]
        targets.append({"target": what, "beta": beta, "minimum": minimum, "measured": measured,
                        "met": measured >= minimum})  # fmt: skip
    return targets


def _print_report(report: dict[str, Any]) -> None:
    config = report["config"]
    model = (
        f"tiny Wan2.1 ({config['num_layers']} blocks, {config['num_frames']}-frame videos)"
        if config["family"] == "wan"
        else f"tiny {config['family']} ({config['num_layers']}+{config['num_single_layers']} blocks)"
    )
    print(
        f"{model}, {config['trained_steps']} trained steps, batch {config['batch']}, {config['image_tokens']} "
        f"image + {config.get('reference_tokens', 0)} reference + {config['text_tokens']} text tokens, "
        f"{config['repeats']} interleaved repeats (median [min, max])"
    )
    for beta, rollout in report["rollout_s"].items():
        print(f"beta={beta}: rollout {rollout['median']:.3f}s [{rollout['min']:.3f}, {rollout['max']:.3f}]")
    header = "beta   W  frac variant          update s  speedup vs exact [min,max]  whole step  cost model  calls g/n/r/b  peak MiB"
    print(header)
    for r in report["results"]:
        u, s, st = r["update_s"], r["update_speedup"], r["step_speedup"]
        c = r["calls"]
        peak = r["peak_memory_mb"]
        print(
            f"{r['beta']:<5} {r['group_size'] or '-':>2} {r['jagg_frac'] if r['jagg_frac'] is not None else '-':>5} "
            f"{r['variant']:<15} {u['median']:8.3f}  {s['median']:5.2f}x [{s['min']:.2f}, {s['max']:.2f}]"
            f"{'':>10}{st['median']:5.2f}x {r['theory_update_speedup']:9.2f}x"
            f"  {c['graph_forwards']}/{c['no_grad_forwards']}/{c['reference_forwards']}/{c['backward_calls']:<6}"
            f" {'' if peak is None else f'{peak:8.1f}'}"
        )
    for t in report["targets"]:
        print(
            f"target {t['target']}: >= {t['minimum']}x, measured {t['measured']:.2f}x -> {'met' if t['met'] else 'NOT met'}"
        )


def _plot(report: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    results = report["results"]
    betas = [float(b) for b in report["rollout_s"]]
    figure = Figure(figsize=(5 * (len(betas) + 1), 4), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(betas) + 1)
    colors = {"jagg": "tab:blue", "jagg_cache": "tab:orange", "jagg_cache_seq": "tab:green"}
    for ax, beta in zip(axes, betas):
        for variant, color in colors.items():
            for frac, style in ((1.0, "o-"), (0.6, "s--")):
                rows = [r for r in results if r["beta"] == beta and r["variant"] == variant and r["jagg_frac"] == frac]
                if not rows:
                    continue
                sizes = [r["group_size"] for r in rows]
                med = [r["update_speedup"]["median"] for r in rows]
                low = [m - r["update_speedup"]["min"] for m, r in zip(med, rows)]
                high = [r["update_speedup"]["max"] - m for m, r in zip(med, rows)]
                ax.errorbar(sizes, med, yerr=[low, high], fmt=style, color=color, capsize=3,
                            label=f"{variant} (frac {frac})")  # fmt: skip
                if frac == 1.0 and variant != "jagg_cache_seq":
                    ax.plot(sizes, [r["theory_update_speedup"] for r in rows], ":", color=color, lw=1)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xlabel="JAGG group size W", ylabel="update-stage speedup over exact", title=f"beta = {beta}")
        ax.legend(fontsize=7)
    mem_ax = axes[-1]
    rows = [r for r in results if r["beta"] == betas[0] and r["peak_memory_mb"] is not None]
    if rows:
        labels = [r["variant"] if r["group_size"] is None else f"{r['variant']}\nW={r['group_size']}" for r in rows]
        mem_ax.bar(range(len(rows)), [r["peak_memory_mb"] for r in rows], color="tab:gray")
        mem_ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=7)
        mem_ax.set(ylabel="peak update memory (MiB)", title=f"peak memory, beta = {betas[0]}, frac 1.0")
    model = "Wan2.1 (video)" if report["config"]["family"] == "wan" else "Flux"
    figure.suptitle(f"DDPOJaggTrainer update stage on a tiny {model} (dotted: cost model)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)


def markdown_tables(report: dict[str, Any]) -> str:
    """The report as the Markdown tables of ``docs/benchmarks.md`` (speedups: median [min, max] over repeats)."""

    def spread(s: dict[str, Any]) -> str:
        return f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]"

    lines = [
        "| beta | W | jagg_frac | variant | update (median) | update speedup vs exact | vs today's JAGG | whole step "
        "| cost model | calls: graph / no-grad / ref / backward |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        c = r["calls"]
        lines.append(
            f"| {r['beta']} | {r['group_size'] or '-'} | {r['jagg_frac'] if r['jagg_frac'] is not None else '-'} "
            f"| {r['variant']} | {r['update_s']['median'] * 1000:.0f} ms | {spread(r['update_speedup'])} "
            f"| {spread(r['speedup_vs_jagg']) if 'speedup_vs_jagg' in r else ''} | {spread(r['step_speedup'])} "
            f"| {r['theory_update_speedup']:.2f}x | {c['graph_forwards']} / {c['no_grad_forwards']} / "
            f"{c['reference_forwards']} / {c['backward_calls']} |"
        )
    memory = [r for r in report["results"] if r["peak_memory_mb"] is not None]
    if memory:
        lines += ["", "| beta | W | variant | peak update memory |", "|---|---|---|---|"]
        lines += [
            f"| {r['beta']} | {r['group_size'] or '-'} | {r['variant']} | {r['peak_memory_mb']:.0f} MiB |"
            for r in memory
        ]
    lines += ["", "| target (jagg_frac 1) | required | measured (median) | met |", "|---|---|---|---|"]
    lines += [
        f"| {t['target']} (beta {t['beta']}) | >= {t['minimum']}x | {t['measured']:.2f}x | {'yes' if t['met'] else 'no'} |"
        for t in report["targets"]
    ]
    return "\n".join(lines)
