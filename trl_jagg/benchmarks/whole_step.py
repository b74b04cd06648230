"""Whole-step benchmark: rollout, rewards and update of :class:`DDPOJaggTrainer` at two recipe shapes.

Each variant is a trainer on the same tiny Flux pipeline (built from config); one repeat times, interleaved and in
alternating order, one whole step of every variant on the same prompts at the same optimizer step: the rollout with
its decode and rewards (``_generate_and_score``) and the update of its micro-batches (the optimizer step, equal for
all, is left out). Ratios are taken per repeat against a baseline and reported as median, min and max; times are
process CPU time on a CPU and synchronised wall time on a GPU (:func:`~trl_jagg.benchmarks.trainer.benchmark_clock`).

- DanceGRPO shape (16 steps, a random 60% of the first 15 trained, G = 12): ``dance_exact``, ``dance_jagg`` (the
  paper's JAGG: intermediates recomputed without graph), ``dance_jagg_cache``.
- Mix shape (16 steps, a 4-step SDE window, ODE elsewhere): ``mix_exact`` (MixGRPO's own cost: the mixed rollout
  with an exact update), ``mix_jagg_cache``, ``+_prefix`` (same-noise groups share the ODE before the window),
  ``+_dpm`` (DPM-Solver++ of order 2 on 40% of the ODE steps). The window slides between repeats.

Beside each measured ratio stand the ratios predicted at FLUX.1-dev size (1024 px: 4096 image tokens, 512 text
tokens), for full fine-tuning (as the tiny model is trained here, and as DanceGRPO's and MixGRPO's presets train) and
for a LoRA on the frozen base (Flow-GRPO's presets): the work of the timed steps is counted by hooks (backbone rows
forward with and without a graph and backward, VAE decodes, prompt encodings) and priced by the FLOP model of the
real modules on the meta device (:mod:`~trl_jagg.benchmarks.flops`). Each prediction prices activation
checkpointing as the preset it stands for sets it (:func:`predicted_checkpointing`): full fine-tuning as the variant's
peer (``dancegrpo-flux``, ``mixgrpo-flux``: both checkpoint, so a backward row also recomputes the blocks' forward),
LoRA as ``flow-grpo-flux`` (no checkpointing). The tiny model is timed without it. On the tiny model the VAE decode,
rewards and Python overhead are a larger share of a step than at real size, so the measured ratios fall short of the
predicted ones. A LoRA backward costs about one forward instead of two, so the backwards JAGG saves are worth less
there.
``reprice`` recomputes a saved report's predictions from its counted work (nothing is timed).

The pieces (:func:`build_trainers`, :func:`time_whole_steps`, :func:`summarize`) also serve
:mod:`trl_jagg.benchmarks.gpu` at FLUX.1-dev size.
"""

from __future__ import annotations

import gc
import json
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .flops import LORA_PRESET, StepCosts, flux_dev_costs, flux_dev_lora, preset_checkpoints, step_flops
from .trainer import PROMPTS, _endless, _spread, _sync, benchmark_clock, measure_peak_memory_mb

JSON_NAME = "whole_step_benchmark.json"
PREDICTED_AT = (1024, 512)
"""The FLUX.1-dev setting the FLOP model prices the counted work at: pixels, text tokens."""
_DANCE = {
    "num_inference_steps": 16, "num_generations": 12, "train_timesteps": "random_but_last",
    "train_timestep_fraction": 0.6, "sampler": "dance", "noise_level": 0.3, "same_group_noise": True,
}  # fmt: skip
_MIX = {
    "num_inference_steps": 16, "num_generations": 12, "train_timesteps": "sde_window", "sde_window_size": 4,
    "sde_window_schedule": "progressive", "sde_window_shift_interval": 1, "sampler": "sde", "noise_level": 0.7,
}  # fmt: skip
_JAGG = {"use_jagg": True, "jagg_group_size": 4, "jagg_frac": 0.6, "jagg_cache_velocities": True}
WHOLE_STEP_VARIANTS: dict[str, dict[str, Any]] = {
    "dance_exact": {**_DANCE, "use_jagg": False},
    "dance_jagg": {**_DANCE, **_JAGG, "jagg_cache_velocities": False},
    "dance_jagg_cache": {**_DANCE, **_JAGG},
    "mix_exact": {**_MIX, "use_jagg": False},
    "mix_jagg_cache": {**_MIX, **_JAGG},
    "mix_jagg_cache_prefix": {**_MIX, **_JAGG, "same_group_noise": True},
    "mix_jagg_cache_prefix_dpm": {**_MIX, **_JAGG, "same_group_noise": True, "ode_solver_order": 2,
                                  "ode_step_ratio": 0.4},
}  # fmt: skip
"""The config fields of each variant (the rest is the benchmark's config)."""


PEER_PRESETS = {"dance": "dancegrpo-flux", "mix": "mixgrpo-flux"}
"""The preset whose full fine-tuning each shape of variants stands for (by the variant name's prefix)."""


def predicted_checkpointing(variant: str, training: str) -> bool:
    """Whether the ``training`` prediction (:data:`~trl_jagg.benchmarks.flops.TRAINING`) for ``variant`` prices
    activation checkpointing: as the preset it stands for does, the variant's peer (:data:`PEER_PRESETS`) for full
    fine-tuning, :data:`~trl_jagg.benchmarks.flops.LORA_PRESET` for LoRA."""
    return preset_checkpoints(LORA_PRESET if training == "lora" else PEER_PRESETS[variant.split("_")[0]])


def baselines(variant: str) -> list[str]:
    """What ``variant`` is compared with: the exact DanceGRPO step, and for the mixed rollouts the same rollout with
    an exact update (MixGRPO's own cost)."""
    return ["dance_exact"] + (["mix_exact"] if variant.startswith("mix") else [])


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


def _whole_step(trainer: Any, inputs: list[dict[str, Any]], step: int) -> None:
    """One rollout with rewards and the update of its micro-batches at optimizer step ``step``."""
    from ..trainer.batch import split_rollout

    trainer.state.global_step = step
    model = trainer.model
    rollout = trainer._generate_and_score(inputs)
    model.zero_grad(set_to_none=True)
    model.train()
    for micro_batch in split_rollout(rollout, trainer.args.steps_per_generation):
        trainer.update_stage.run(
            model, micro_batch, micro_step=trainer._step, global_step=step,
            accumulation_steps=trainer.current_gradient_accumulation_steps,
        )  # fmt: skip
    trainer._metrics.clear()


def build_trainers(
    model: Any, variants: tuple[str, ...], workdir: str, *, micro_batch: int | None = None, **config: Any
) -> dict[str, Any]:
    """A ``DDPOJaggTrainer`` per variant on ``model`` (a pipeline or its path): the variant's fields over
    ``config`` (``GRPOJaggConfig`` fields common to all), rollouts of one group of G in micro-batches of
    ``micro_batch`` (default G: one micro-batch) that the rollout also samples at, so the velocity cache applies."""
    from datasets import Dataset

    from ..ddpo_jagg_trainer import DDPOJaggTrainer
    from ..grpo_jagg_config import GRPOJaggConfig

    unknown = sorted(set(variants) - set(WHOLE_STEP_VARIANTS))
    if unknown:
        raise ValueError(f"Unknown `variants` {unknown}: use names of {list(WHOLE_STEP_VARIANTS)}.")
    trainers = {}
    for name in variants:
        fields = WHOLE_STEP_VARIANTS[name]
        batch = micro_batch or fields["num_generations"]
        if fields["num_generations"] % batch:
            raise ValueError(f"`micro_batch` ({batch}) must divide G = {fields['num_generations']}.")
        args = GRPOJaggConfig(
            output_dir=str(Path(workdir) / name), per_device_train_batch_size=batch,
            steps_per_generation=fields["num_generations"] // batch,
            gradient_accumulation_steps=fields["num_generations"] // batch, report_to="none", disable_tqdm=True,
            **config, **fields,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        trainer = DDPOJaggTrainer(
            model=model, reward_funcs="prompt_color", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        )  # fmt: skip
        trainers[name] = trainer
    return trainers


def time_whole_steps(trainers: dict[str, Any], *, repeats: int) -> dict[str, dict[str, Any]]:
    """Time ``repeats`` whole steps of every trainer after a warm-up, interleaved in alternating order, each step
    of a repeat on the same window; returns per variant the times, the work counted over the timed steps
    (:data:`WORK`) and the smallest peak memory growth of a timed step (MiB; ``None`` where not measurable)."""
    first = next(iter(trainers.values()))
    device = first.accelerator.device
    clock = benchmark_clock(device)
    batches = {name: _endless(trainer) for name, trainer in trainers.items()}
    measured: dict[str, dict[str, Any]] = {
        name: {"times": [], "work": dict.fromkeys(WORK, 0), "peak_memory_mb": None} for name in trainers
    }
    num_starts = WHOLE_STEP_VARIANTS["mix_exact"]["num_inference_steps"] - 1 - 4 + 1
    for repeat in range(repeats + 1):
        step = (7 * repeat) % num_starts  # the mix window's start moves over the schedule between repeats
        order = list(trainers) if repeat % 2 == 0 else list(trainers)[::-1]
        for name in order:
            trainer, inputs, elapsed = trainers[name], next(batches[name]), []
            counter = WorkCounter(trainer.adapter.pipeline)  # a hook per call: negligible

            def timed(trainer=trainer, inputs=inputs, elapsed=elapsed, step=step) -> None:
                _sync(device)
                start = clock()
                _whole_step(trainer, inputs, step)
                _sync(device)
                elapsed.append(clock() - start)

            peak = measure_peak_memory_mb(timed, device)  # its set-up runs before the clock starts
            counted = counter.close()
            if repeat > 0:  # repeat 0 is the warm-up
                entry = measured[name]
                entry["times"].append(elapsed[0])
                entry["work"] = {k: entry["work"][k] + counted[k] for k in WORK}
                if peak is not None:
                    entry["peak_memory_mb"] = (
                        peak if entry["peak_memory_mb"] is None else min(entry["peak_memory_mb"], peak)
                    )
    return measured


def summarize(
    measured: dict[str, dict[str, Any]],
    costs: Mapping[str, StepCosts],
    checkpointing: Callable[[str, str], bool] = predicted_checkpointing,
) -> list[dict[str, Any]]:
    """Per variant: the step time, the per-repeat ratios against its baselines (median, min, max), the counted work,
    and the FLOPs and ratios the FLOP model predicts for that work at each of ``costs`` (by way of training), with
    activation checkpointing where ``checkpointing(variant, training)`` says (recorded as
    ``predicted_checkpointing``)."""
    checkpointed = {name: {training: checkpointing(name, training) for training in costs} for name in measured}
    flops = {
        name: {
            training: step_flops(c, m["work"], checkpointing=checkpointed[name][training])
            for training, c in costs.items()
        }
        for name, m in measured.items()
    }
    results = []
    for name, m in measured.items():
        entry: dict[str, Any] = {
            "variant": name, "step_s": _spread(m["times"]), "counted": m["work"], "predicted_flops": flops[name],
            "predicted_checkpointing": checkpointed[name], "peak_memory_mb": m["peak_memory_mb"],
        }  # fmt: skip
        for baseline in baselines(name):
            if baseline in measured and baseline != name:
                times = zip(measured[baseline]["times"], m["times"])
                entry[f"speedup_vs_{baseline}"] = _spread([b / t for b, t in times])
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
        "checkpointing": "each backward row adds recompute_row where a result's predicted_checkpointing is true",
        "flops": {training: c.as_dict() for training, c in costs.items()},
    }  # fmt: skip


def reprice(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` (a whole-step report, as written) with its predictions recomputed from its counted work by
    today's FLOP model at :data:`PREDICTED_AT`; the measured times and ratios are unchanged."""
    costs = flux_dev_costs(*PREDICTED_AT)
    measured = {
        entry["variant"]: {
            "times": entry["step_s"]["per_repeat"],
            "work": entry["counted"],
            "peak_memory_mb": entry["peak_memory_mb"],
        }
        for entry in report["results"]
    }
    config = report["config"] | {"flop_model": flop_model(costs)}
    return report | {"config": config, "results": summarize(measured, costs)}


def print_table(results: list[dict[str, Any]], predicted_for: str = "FLUX.1-dev") -> None:
    """One line per variant: median step time, measured ratios [min, max] and the ones predicted for
    ``predicted_for`` (per way of training)."""
    for entry in results:
        ratios = "  ".join(
            f"{key.removeprefix('speedup_vs_')}: {entry[key]['median']:.2f}x "
            f"[{entry[key]['min']:.2f}, {entry[key]['max']:.2f}] ({predicted_for} "
            + ", ".join(f"{training} {ratio:.2f}x" for training, ratio in entry["predicted_" + key].items())
            + ")"
            for key in entry
            if key.startswith("speedup_vs_")
        )
        print(f"{entry['variant']:28s} {entry['step_s']['median']:8.3f} s  {ratios}")


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
    reprice_report: str | None = None,
) -> dict[str, Any]:
    """Time whole steps of every variant (see the module docstring); returns and writes the report as JSON.

    Args:
        output_dir: where ``whole_step_benchmark.json`` goes.
        variants: names of :data:`WHOLE_STEP_VARIANTS` to run.
        resolution: image height and width in pixels (a multiple of 16).
        max_sequence_length: text tokens.
        num_layers, num_single_layers: double- and single-stream blocks of the Flux transformer.
        repeats: timed repeats after one warm-up.
        seed: seed of the weights and rollouts.
        num_threads: torch CPU threads while timing; restored afterwards.
        reprice_report: a report written before (a path): instead of timing, its predictions are recomputed from
            its counted work by today's FLOP model (:func:`reprice`) and the report written to ``output_dir``.
    """
    out = Path(output_dir)
    if reprice_report is not None:
        report = reprice(json.loads(Path(reprice_report).read_text()))
    else:
        report = _timed_report(variants, resolution, max_sequence_length, num_layers, num_single_layers, repeats,
                               seed, num_threads)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    print_table(report["results"])
    print(f"wrote {out / JSON_NAME}")
    return report


def _timed_report(
    variants: tuple[str, ...], resolution: int, max_sequence_length: int, num_layers: int, num_single_layers: int,
    repeats: int, seed: int, num_threads: int,
) -> dict[str, Any]:  # fmt: skip
    """The whole-step report of :func:`run_whole_step_benchmark`'s timing (its arguments)."""
    from ..testing.tiny_models import save_tiny_pipeline

    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_tiny_pipeline(
                "flux", str(Path(tmp) / "flux"), seed=seed,
                transformer={"num_layers": num_layers, "num_single_layers": num_single_layers},
            )  # fmt: skip
            trainers = build_trainers(
                model_dir, variants, tmp, height=resolution, width=resolution, max_sequence_length=max_sequence_length,
                beta=0.0, use_cpu=device.type == "cpu", seed=seed,
            )  # fmt: skip
            measured = time_whole_steps(trainers, repeats=repeats)
            del trainers
            gc.collect()
    finally:
        torch.set_num_threads(previous_threads)
    costs = flux_dev_costs(*PREDICTED_AT)
    return {
        "config": {
            "resolution": resolution, "text_tokens": max_sequence_length, "num_layers": num_layers,
            "num_single_layers": num_single_layers, "repeats": repeats, "torch_threads": num_threads,
            "device": device.type, "torch": torch.__version__,
            "timer": "wall time (perf_counter)" if device.type != "cpu" else "process CPU time (process_time)",
            "variants": {name: WHOLE_STEP_VARIANTS[name] for name in variants}, "flop_model": flop_model(costs),
        },
        "results": summarize(measured, costs),
    }  # fmt: skip
