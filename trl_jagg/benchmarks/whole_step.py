"""Whole-step benchmark: each preset trained by ``DDPOJaggTrainer.train()`` at its own cadence, one rollout at a time.

Every variant is a preset of :mod:`trl_jagg.recipes` (:data:`WHOLE_STEP_VARIANTS`: the preset, the fields a
variant changes, the baselines it is compared with) on a tiny Flux pipeline built from config. Only what the tiny
model needs is changed (:data:`TINY_FIELDS`: the image size, the text tokens; the weight-free ``prompt_color``
reward): each preset keeps its optimizer steps per rollout (``steps_per_generation x num_iterations /
gradient_accumulation_steps``: 3 for ``dancegrpo-flux``, 4 for ``mixgrpo-flux``), micro-batches, trained-step draw,
window schedule and cadence, DPM-Solver++, scheduler shift and activation checkpointing.

Each variant's trainer runs ``train()`` itself, in a thread of its own that a callback (:class:`RolloutClock`)
parks at the start of every rollout, so that exactly one trainer runs at a time: one repeat lets every variant
train one rollout (its rollout, decode, rewards and all its optimizer steps, as ``train()`` runs them), in
alternating order (ABBA) after a warm-up rollout. The clock runs from the first optimizer step's
``on_step_begin`` to the last one's ``on_step_end``: process CPU time on a CPU (only the running thread works),
synchronised wall time on a GPU (:func:`~trl_jagg.benchmarks.measuring.benchmark_clock`). The timed rollouts run with
the objects alive after the warm-up frozen out of Python's garbage collector and a collection before each
(:func:`~trl_jagg.benchmarks.measuring.frozen_heap`): a full collection would otherwise traverse every variant's
trainer and be charged to whichever rollout triggered it. Ratios are taken per repeat
against each baseline and reported as median, min and max. Memory is measured afterwards, in one more rollout per
variant that is not timed (:class:`~trl_jagg.benchmarks.measuring.PeakMemory` trims the heap, which slows the steps
that follow it).

The baselines: ``dancegrpo-exact`` is ``dancegrpo-flux`` with ``use_jagg=False`` (DanceGRPO's own cost) and
``mixgrpo-flash`` is ``mixgrpo-flux`` with ``use_jagg=False``: MixGRPO-Flash as its script runs it
(Tencent-Hunyuan/MixGRPO@e5cdd6a ``finetune_flux_grpo_MixGRPO_Flash.sh``: DPM-Solver++ of order 2 on the ODE steps
after the window), so the ratio over it credits JAGG and the velocity cache only, not DPM-Solver++.

Beside each measured ratio stand the ratios the FLOP model predicts at FLUX.1-dev size (1024 px: 4096 image
tokens, 512 text tokens) for the work counted by hooks over the timed rollouts (backbone rows forward with and
without a graph and backward, VAE decodes, prompt encodings; :mod:`~trl_jagg.benchmarks.flops`), with activation
checkpointing as the variant's preset sets it; the rows a rollout counts do not depend on the image size, so the
cadence priced is the one timed. The optimizer step (elementwise) is timed but not priced. On the tiny model the VAE
decode, rewards and each backbone call's fixed overhead are a larger share of a step than at real size, so measured
and predicted ratios differ (at micro-batches of one sample the measured ones run above: JAGG saves calls as well as
rows). ``reprice`` recomputes a saved report's predictions from its counted work.

Adding a preset is one line in :data:`WHOLE_STEP_VARIANTS`.
"""

from __future__ import annotations

import gc
import json
import math
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from trl_jagg.benchmarks.engine import torch_threads
from trl_jagg.benchmarks.flops import (
    LORA_PRESET,
    StepCosts,
    flux_dev_costs,
    flux_dev_lora,
    preset_checkpointed_fraction,
    step_flops,
)
from trl_jagg.benchmarks.measuring import PeakMemory, benchmark_clock, interleaved, served_share, spread, sync_device
from trl_jagg.benchmarks.trainer import PROMPTS
from trl_jagg.recipes import get_recipe

JSON_NAME = "whole_step_benchmark.json"
PNG_NAME = "whole_step_benchmark.png"
PREDICTED_AT = (1024, 512)
"""The FLUX.1-dev setting the FLOP model prices the counted work at: pixels, text tokens."""
EXACT = "dancegrpo-exact"
FLASH = "mixgrpo-flash"
FAST_EXACT = "jagg-fast-exact"


@dataclass(frozen=True)
class PresetVariant:
    """A variant of the benchmark: the preset ``preset`` with ``fields`` changed, compared with ``baselines``."""

    preset: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    baselines: tuple[str, ...] = (EXACT,)


WHOLE_STEP_VARIANTS: dict[str, PresetVariant] = {
    EXACT: PresetVariant("dancegrpo-flux", {"use_jagg": False}, baselines=()),
    "dancegrpo-flux": PresetVariant("dancegrpo-flux"),
    FLASH: PresetVariant("mixgrpo-flux", {"use_jagg": False}),
    "mixgrpo-flux": PresetVariant("mixgrpo-flux", baselines=(EXACT, FLASH)),
    FAST_EXACT: PresetVariant("jagg-fast-flux", {"use_jagg": False}),
    "jagg-fast-flux": PresetVariant("jagg-fast-flux", baselines=(EXACT, FLASH, FAST_EXACT)),
}
"""The variants by name: a preset as shipped (JAGG + velocity cache) or with an exact update (the baselines). Each
preset is compared with its own rollout trained exactly (what JAGG earns) and with exact DanceGRPO (JAGG and what
the recipe changes: fewer trained steps, fewer sampling calls, DPM-Solver++); the ratio of the two is the recipe's
share."""
TINY_FIELDS = ("height", "width", "max_sequence_length")
"""The only preset fields the benchmark changes (besides the run's own: output directory, steps, seed, device)."""


def rollout_optimizer_steps(args: Any) -> int:
    """Optimizer steps per rollout of the config ``args``: its micro-batches per rollout over the accumulation."""
    micro_batches = args.steps_per_generation * args.num_iterations
    if micro_batches % args.gradient_accumulation_steps:
        raise ValueError(
            f"steps_per_generation x num_iterations ({micro_batches}) must be a multiple of "
            f"gradient_accumulation_steps ({args.gradient_accumulation_steps}): the benchmark times whole rollouts."
        )
    return micro_batches // args.gradient_accumulation_steps


class WorkCounter:
    """The work of a pipeline's calls, counted by hooks: rows of backbone forwards with and without an autograd
    graph and of the backwards through it, images the VAE decodes, prompts the (second) text encoder encodes."""

    def __init__(self, pipeline: Any):
        self.counts = dict.fromkeys(WORK, 0)
        self._handles = [
            pipeline.transformer.register_forward_pre_hook(self._backbone, with_kwargs=True),
            pipeline.transformer.register_forward_hook(self._after),
            pipeline.vae.decoder.register_forward_pre_hook(self._rows("decoded_images"), with_kwargs=True),
            pipeline.text_encoder_2.register_forward_pre_hook(self._rows("encoded_prompts"), with_kwargs=True),
        ]

    def _backbone(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        rows = kwargs["hidden_states"].shape[0]
        self.counts["graph_rows" if torch.is_grad_enabled() else "no_grad_rows"] += rows

    def _rows(self, key: str) -> Callable[..., None]:
        def count(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            self.counts[key] += (args[0] if args else next(iter(kwargs.values()))).shape[0]

        return count

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if output[0].requires_grad:
            output[0].register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.counts["backward_rows"] += grad.shape[0]

    def close(self) -> dict[str, int]:
        for handle in self._handles:
            handle.remove()
        return dict(self.counts)


WORK = ("graph_rows", "no_grad_rows", "backward_rows", "decoded_images", "encoded_prompts")
"""What :class:`WorkCounter` counts: the inputs of :func:`~trl_jagg.benchmarks.flops.step_flops`."""


class RolloutClock(TrainerCallback):
    """Times each rollout of a ``train()`` run and hands the turn back between rollouts.

    A rollout is ``optimizer_steps`` optimizer steps (the trainer samples it in the first one's first micro-batch).
    At the first one's ``on_step_begin`` the callback parks the training thread until :meth:`run_rollout` lets it
    go, then starts the clock; at the last one's ``on_step_end`` it records the elapsed time, the optimizer steps
    taken and the work counted in between. Rollouts from ``probe_from`` on are not timed: they measure peak memory.
    """

    def __init__(
        self,
        optimizer_steps: int,
        device: torch.device,
        counter: WorkCounter,
        probe_from: int,
        timeout_s: float,
        metrics: Mapping[str, list[float]],
    ):
        self.optimizer_steps = optimizer_steps
        self.metrics = metrics  # the trainer's, read at each rollout's end (train() clears them when it ends)
        self.device, self.clock, self.counter = device, benchmark_clock(device), counter
        self.probe_from, self.timeout_s = probe_from, timeout_s
        self.rollouts: list[dict[str, Any]] = []  # per rollout: time or peak memory, optimizer steps, work
        self._go, self._parked = threading.Event(), threading.Event()
        self._current: dict[str, Any] | None = None
        self._probe: PeakMemory | None = None
        self._start = 0.0
        self.error: BaseException | None = None

    # -- the training thread
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.optimizer_steps:
            return
        self._parked.set()
        self._go.wait()
        self._go.clear()
        rollout = state.global_step // self.optimizer_steps
        self._current = {"rollout": rollout, "first_step": state.global_step, "optimizer_steps": 0,
                         "work": dict(self.counter.counts)}  # fmt: skip
        if rollout >= self.probe_from:  # not timed: the probe trims the heap
            self._probe = PeakMemory(self.device)
            self._probe.start()
            return
        sync_device(self.device)
        self._start = self.clock()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._current is not None:
            self._current["optimizer_steps"] += 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.optimizer_steps or self._current is None:
            return
        entry, self._current = self._current, None
        if self._probe is not None:
            entry["peak_memory_mb"], self._probe = self._probe.stop(), None
        else:
            sync_device(self.device)
            entry["time_s"] = self.clock() - self._start
        entry["work"] = {k: self.counter.counts[k] - entry["work"][k] for k in WORK}
        # Summed over every micro-batch so far (never logged here: the benchmark's logging_steps).
        entry["cache"] = {k: sum(self.metrics.get(f"jagg/{k}", ())) for k in ("cached_velocities", "no_grad_forwards")}
        self.rollouts.append(entry)

    def run(self, trainer: Any) -> threading.Thread:
        """Start ``trainer.train()`` in a thread and wait until it is parked before its first rollout."""

        def train() -> None:
            try:
                trainer.train()
            except BaseException as error:  # re-raised in the scheduling thread
                self.error = error
            finally:
                self._parked.set()

        thread = threading.Thread(target=train, name=f"train-{trainer.args.output_dir}", daemon=True)
        thread.start()
        self._wait_parked(thread)
        return thread

    # -- the scheduling thread
    def run_rollout(self, thread: threading.Thread) -> None:
        """Let the parked trainer train one rollout; return when it is parked again before the next (or done)."""
        self._parked.clear()
        self._go.set()
        self._wait_parked(thread)

    def _wait_parked(self, thread: threading.Thread) -> None:
        if not self._parked.wait(self.timeout_s):
            raise TimeoutError(f"{thread.name}: no rollout finished within {self.timeout_s:.0f} s.")
        if self.error is not None:
            raise RuntimeError(f"{thread.name} failed: {self.error!r}") from self.error


def build_trainers(
    model: Any, variants: Sequence[str], workdir: str, *, rollouts: int, **fields: Any
) -> dict[str, Any]:
    """A ``DDPOJaggTrainer`` per variant on ``model`` (a pipeline or its path): the variant's preset with its
    fields and ``fields`` (the tiny model's, :data:`TINY_FIELDS`, and the run's) on top, the preset's scheduler
    override, the ``prompt_color`` reward, ``max_steps`` for ``rollouts`` rollouts."""
    from datasets import Dataset
    from diffusers import DiffusionPipeline

    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.trainer.ddpo_jagg_trainer import DDPOJaggTrainer

    unknown = sorted(set(variants) - set(WHOLE_STEP_VARIANTS))
    if unknown:
        raise ValueError(f"Unknown `variants` {unknown}: use names of {list(WHOLE_STEP_VARIANTS)}.")
    trainers = {}
    for name in variants:
        variant = WHOLE_STEP_VARIANTS[name]
        recipe = get_recipe(variant.preset)
        common = {"output_dir": str(Path(workdir) / name), "report_to": "none", "disable_tqdm": True,
                  "save_strategy": "no", "logging_steps": 10**6}  # fmt: skip
        args = GRPOJaggConfig.from_recipe(variant.preset, **{**variant.fields, **fields, **common})
        args.max_steps = rollouts * rollout_optimizer_steps(args)
        pipeline = DiffusionPipeline.from_pretrained(model) if isinstance(model, str) else model
        torch.manual_seed(args.seed)
        trainers[name] = DDPOJaggTrainer(
            model=recipe.apply_scheduler(pipeline), reward_funcs="prompt_color", args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )  # fmt: skip
    return trainers


def time_rollouts(trainers: dict[str, Any], *, repeats: int, timeout_s: float = 3600.0) -> dict[str, dict[str, Any]]:
    """Train every trainer one rollout at a time: a warm-up, ``repeats`` timed repeats in alternating order, then
    one rollout per variant that measures peak memory and is not timed. Returns per variant the timed rollouts'
    times, optimizer steps and summed work (:data:`WORK`) and the peak memory growth (MiB; ``None`` where not
    measurable). The trainers were built for ``repeats + 2`` rollouts (:func:`build_trainers`)."""
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    first = next(iter(trainers.values()))
    device = first.accelerator.device
    clocks, threads, counters = {}, {}, {}
    try:
        for name, trainer in trainers.items():  # set-up (optimizer, dataloader) one trainer at a time
            counters[name] = WorkCounter(trainer.adapter.pipeline)
            steps = rollout_optimizer_steps(trainer.args)
            clocks[name] = RolloutClock(
                steps, device, counters[name], probe_from=repeats + 1, timeout_s=timeout_s,
                metrics=trainer.update_stage.metrics,
            )  # fmt: skip
            trainer.add_callback(clocks[name])
            threads[name] = clocks[name].run(trainer)
        for name in trainers:  # the warm-up: every trainer's lasting state (optimizer, caches) exists after it
            clocks[name].run_rollout(threads[name])
        for name in interleaved(list(trainers), repeats):
            clocks[name].run_rollout(threads[name])
        for name in trainers:  # the memory pass, after every timed rollout
            clocks[name].run_rollout(threads[name])
            threads[name].join(timeout_s)
    finally:
        for name, counter in counters.items():
            counter.close()
            trainers[name].remove_callback(clocks[name])
    measured = {}
    for name, clock in clocks.items():
        timed = [r for r in clock.rollouts if "time_s" in r][1:]  # the first is the warm-up
        cache = clock.rollouts[-1]["cache"]  # every rollout's, warm-up and memory pass included: a count
        measured[name] = {
            "times": [r["time_s"] for r in timed],
            "optimizer_steps": [r["optimizer_steps"] for r in timed],
            "first_steps": [r["first_step"] for r in timed],
            "work": {k: sum(r["work"][k] for r in timed) for k in WORK},
            "peak_memory_mb": next((r["peak_memory_mb"] for r in clock.rollouts if "peak_memory_mb" in r), None),
            "probed_steps": [r["first_step"] for r in clock.rollouts if "peak_memory_mb" in r],
            "cache_served": served_share([cache["cached_velocities"]], [cache["no_grad_forwards"]]),
        }
    return measured


def variant_checkpointing(name: str, training: str) -> float:
    """The checkpointed fraction of the backbone's blocks that the ``training`` prediction
    (:data:`~trl_jagg.benchmarks.flops.TRAINING`) of ``name`` prices: as its preset for full fine-tuning,
    :data:`~trl_jagg.benchmarks.flops.LORA_PRESET` for LoRA."""
    return preset_checkpointed_fraction(LORA_PRESET if training == "lora" else WHOLE_STEP_VARIANTS[name].preset)


def summarize(
    measured: dict[str, dict[str, Any]],
    costs: Mapping[str, StepCosts],
    baselines: Mapping[str, Sequence[str]],
    checkpointing: Mapping[str, Mapping[str, float]],
) -> list[dict[str, Any]]:
    """Per variant: the rollout time, the per-repeat ratios against its ``baselines`` (median, min, max), the
    counted work, and the FLOPs and ratios the FLOP model predicts for that work at each of ``costs`` (by way of
    training), with the checkpointed fraction ``checkpointing[variant][training]`` (recorded as
    ``predicted_checkpointing``). The ``quality`` figure of the same configuration is left to ``bench quality``."""
    flops = {
        name: {t: step_flops(c, m["work"], checkpointing=checkpointing[name][t]) for t, c in costs.items()}
        for name, m in measured.items()
    }
    results = []
    for name, m in measured.items():
        entry: dict[str, Any] = {
            "variant": name, "rollout_s": spread(m["times"]), "optimizer_steps": m["optimizer_steps"],
            "first_steps": m["first_steps"], "counted": m["work"], "predicted_flops": flops[name],
            "predicted_checkpointing": dict(checkpointing[name]), "peak_memory_mb": m["peak_memory_mb"],
            "probed_steps": m["probed_steps"], "baselines": list(baselines[name]), "quality": None,
            "cache_served": m.get("cache_served"),
        }  # fmt: skip
        for baseline in baselines[name]:
            if baseline in measured:
                times = zip(measured[baseline]["times"], m["times"])
                entry[f"speedup_vs_{baseline}"] = spread([b / t for b, t in times])
                entry[f"predicted_speedup_vs_{baseline}"] = {
                    training: flops[baseline][training] / flops[name][training] for training in costs
                }
        results.append(entry)
    return results


def flop_model(
    costs: Mapping[str, StepCosts],
    *,
    model: str = "FLUX.1-dev",
    resolution: int = PREDICTED_AT[0],
    text_tokens: int = PREDICTED_AT[1],
    lora: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report's record of the FLOP model: what it prices (``model`` at ``resolution`` pixels and
    ``text_tokens`` text tokens; the LoRA ``lora``, by default :data:`~trl_jagg.benchmarks.flops.LORA_PRESET`'s)
    and its unit costs per way of training."""
    return {
        "model": model, "resolution": resolution, "text_tokens": text_tokens,
        "training": {"full": "every parameter (dancegrpo-flux, mixgrpo-flux)",
                     "lora": dict(lora) if lora is not None else {"preset": LORA_PRESET, **flux_dev_lora()}},
        "checkpointing": "each backward row adds predicted_checkpointing x recompute_row (the fraction of blocks "
                         "checkpointed)",
        "flops": {training: c.as_dict() for training, c in costs.items()},
    }  # fmt: skip


def _measured(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`summarize` reads, back from a report's result ``entry``."""
    keys = ("optimizer_steps", "first_steps", "peak_memory_mb", "probed_steps")
    return {
        "times": entry["rollout_s"]["per_repeat"], "work": entry["counted"], **{k: entry[k] for k in keys},
        "cache_served": entry.get("cache_served"),
    }  # fmt: skip


def reprice(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (a whole-step report, as written) with its predictions recomputed from its counted work by
    today's FLOP model at :data:`PREDICTED_AT`; the measured times and ratios are unchanged."""
    costs = flux_dev_costs(*PREDICTED_AT)
    results = report["results"]
    measured = {entry["variant"]: _measured(entry) for entry in results}
    baselines = {entry["variant"]: entry["baselines"] for entry in results}
    checkpointing = {entry["variant"]: entry["predicted_checkpointing"] for entry in results}
    repriced = summarize(measured, costs, baselines, checkpointing)
    for entry, new in zip(results, repriced):
        new["quality"] = entry["quality"]
    config = report["config"] | {"flop_model": flop_model(costs)}
    return report | {"config": config, "results": repriced}


def preset_training(name: str) -> str:
    """How the preset of variant ``name`` trains the backbone: ``"lora"`` or ``"full"``."""
    return "lora" if get_recipe(WHOLE_STEP_VARIANTS[name].preset).lora else "full"


def format_table(results: list[dict[str, Any]], predicted_for: str = "FLUX.1-dev") -> str:
    """A markdown table, one row per variant: optimizer steps per rollout, median rollout time, each measured ratio
    median [min, max] with the one predicted for ``predicted_for`` (as the variant's preset trains), the quality."""
    lines = [
        f"| variant | optimizer steps / rollout | rollout (s) | measured ratio | {predicted_for} predicted | "
        "cache served | quality |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in results:
        training = preset_training(entry["variant"]) if entry["variant"] in WHOLE_STEP_VARIANTS else "full"
        keys = [key for key in entry if key.startswith("speedup_vs_")]
        measured = "<br>".join(
            f"{entry[k]['median']:.2f}x [{entry[k]['min']:.2f}, {entry[k]['max']:.2f}] vs {k.removeprefix('speedup_vs_')}"
            for k in keys
        )
        predicted = "<br>".join(f"{entry['predicted_' + k][training]:.2f}x ({training})" for k in keys)
        steps = sorted(set(entry["optimizer_steps"]))
        quality = "-" if entry.get("quality") is None else entry["quality"]
        served = "-" if entry.get("cache_served") is None else f"{entry['cache_served']:.0%}"
        lines.append(
            f"| {entry['variant']} | {', '.join(map(str, steps))} | {entry['rollout_s']['median']:.2f} | "
            f"{measured or 'baseline'} | {predicted or '-'} | {served} | {quality} |"
        )
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    """Measured ratios (median, min-max bars) and the FLOP model's predictions per variant and baseline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bars = [(e, k.removeprefix("speedup_vs_")) for e in results for k in e if k.startswith("speedup_vs_")]
    figure = Figure(figsize=(1.2 * len(bars) + 3, 4), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for i, (entry, baseline) in enumerate(bars):
        spread = entry[f"speedup_vs_{baseline}"]
        training = preset_training(entry["variant"]) if entry["variant"] in WHOLE_STEP_VARIANTS else "full"
        ax.bar(i, spread["median"], color="tab:blue", label="measured (tiny, CPU)" if i == 0 else None)
        ax.errorbar(i, spread["median"], yerr=[[spread["median"] - spread["min"]], [spread["max"] - spread["median"]]],
                    color="black", capsize=4)  # fmt: skip
        predicted = entry[f"predicted_speedup_vs_{baseline}"][training]
        ax.plot(i, predicted, "D", color="tab:orange", label="FLOP model, FLUX.1-dev" if i == 0 else None)
    ax.set_xticks(range(len(bars)), [f"{e['variant']}\nvs {b}" for e, b in bars], fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="speed-up per rollout (all its optimizer steps)", title="Presets at their own cadence")
    ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def run_whole_step_benchmark(
    output_dir: str,
    *,
    variants: tuple[str, ...] = tuple(WHOLE_STEP_VARIANTS),
    resolution: int = 128,
    max_sequence_length: int = 64,
    num_layers: int = 2,
    num_single_layers: int = 4,
    repeats: int = 5,
    seed: int = 0,
    num_threads: int = 1,
    plot: bool = True,
    reprice_report: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Train every variant's preset one rollout at a time and time it (see the module docstring); returns and
    writes the report as JSON (and the PNG chart).

    Args:
        output_dir: where ``whole_step_benchmark.json`` and ``.png`` go.
        variants: names of :data:`WHOLE_STEP_VARIANTS` to run; the baselines they name are added.
        resolution: image height and width in pixels (a multiple of 16).
        max_sequence_length: text tokens.
        num_layers, num_single_layers: double- and single-stream blocks of the Flux transformer.
        repeats: timed rollouts per variant after one warm-up.
        seed: seed of the weights and rollouts.
        num_threads: torch CPU threads while timing; restored afterwards.
        plot: write the PNG chart.
        reprice_report: a report written before (a path): instead of timing, its predictions are recomputed from
            its counted work by today's FLOP model (:func:`reprice`) and the report written to ``output_dir``.
        model: a local pipeline folder to train instead of a random-initialised tiny Flux (``"demo"``: the CPU
            demo's pretrained pipeline, a model that has learnt its prompts); ``num_layers`` and
            ``num_single_layers`` then do not apply.
    """
    out = Path(output_dir)
    if reprice_report is not None:
        report = reprice(json.loads(Path(reprice_report).read_text()))
    else:
        report = _timed_report(variants, resolution, max_sequence_length, num_layers, num_single_layers, repeats,
                               seed, num_threads, model)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    if plot:
        _plot(report["results"], out / PNG_NAME)
    print(format_table(report["results"]))
    print(f"wrote {out / JSON_NAME}")
    return report


def with_baselines(variants: Sequence[str]) -> tuple[str, ...]:
    """``variants`` and the baselines they name, in the order of :data:`WHOLE_STEP_VARIANTS`."""
    unknown = sorted(set(variants) - set(WHOLE_STEP_VARIANTS))
    if unknown:
        raise ValueError(f"Unknown `variants` {unknown}: use names of {list(WHOLE_STEP_VARIANTS)}.")
    wanted = {b for v in variants for b in WHOLE_STEP_VARIANTS[v].baselines} | set(variants)
    return tuple(name for name in WHOLE_STEP_VARIANTS if name in wanted)


def _timed_report(
    variants: tuple[str, ...], resolution: int, max_sequence_length: int, num_layers: int, num_single_layers: int,
    repeats: int, seed: int, num_threads: int, model: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The whole-step report of :func:`run_whole_step_benchmark`'s timing (its arguments)."""
    from trl_jagg.demo.run import DEMO_ASSET_DIR
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    names = with_baselines(variants)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = {"height": resolution, "width": resolution, "max_sequence_length": max_sequence_length}
    with torch_threads(num_threads), tempfile.TemporaryDirectory() as tmp:
        if model is not None:
            model_dir = str(DEMO_ASSET_DIR) if model == "demo" else model
        else:
            model_dir = save_tiny_pipeline(
                "flux", str(Path(tmp) / "flux"), seed=seed,
                transformer={"num_layers": num_layers, "num_single_layers": num_single_layers},
            )  # fmt: skip
        trainers = build_trainers(
            model_dir, names, tmp, rollouts=repeats + 2, **tiny, use_cpu=device.type == "cpu", seed=seed
        )
        configs = {name: _scaled_config(trainer.args) for name, trainer in trainers.items()}
        measured = time_rollouts(trainers, repeats=repeats)
        del trainers
        gc.collect()
    costs = flux_dev_costs(*PREDICTED_AT)
    checkpointing = {name: {t: variant_checkpointing(name, t) for t in costs} for name in names}
    baselines = {name: WHOLE_STEP_VARIANTS[name].baselines for name in names}
    return {
        "config": {
            "model": model or "random-initialised tiny Flux", "resolution": resolution,
            "text_tokens": max_sequence_length, "num_layers": num_layers,
            "num_single_layers": num_single_layers, "repeats": repeats, "torch_threads": num_threads,
            "device": device.type, "torch": torch.__version__,
            "timer": "wall time (perf_counter)" if device.type != "cpu" else "process CPU time (process_time)",
            "variants": {name: {"preset": WHOLE_STEP_VARIANTS[name].preset, "fields": dict(WHOLE_STEP_VARIANTS[name].fields),
                                "baselines": list(baselines[name]), "as_trained": configs[name]} for name in names},
            "flop_model": flop_model(costs),
        },
        "results": summarize(measured, costs, baselines, checkpointing),
    }  # fmt: skip


def _scaled_config(args: Any) -> dict[str, Any]:
    """The cadence fields a variant trained with (for the report)."""
    keys = ("num_inference_steps", "num_generations", "per_device_train_batch_size", "steps_per_generation",
            "gradient_accumulation_steps", "num_iterations", "train_timesteps", "train_timestep_fraction",
            "sde_window_size", "sde_window_schedule", "sde_window_shift_interval", "ode_solver_order",
            "ode_step_ratio", "use_jagg", "jagg_cache_velocities", "height", "width", "max_sequence_length")  # fmt: skip
    values = {k: getattr(args, k) for k in keys}
    values["optimizer_steps_per_rollout"] = rollout_optimizer_steps(args)
    return {k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in values.items()}
