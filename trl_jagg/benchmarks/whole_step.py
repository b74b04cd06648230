"""Whole-step benchmark: rollout, rewards and update of :class:`DDPOJaggTrainer` at two recipe shapes.

Each variant is a trainer on the same tiny Flux pipeline (built from config); one repeat times, interleaved and in
alternating order, one whole step of every variant on the same prompts at the same optimizer step: the rollout with
its decode and rewards (``_generate_and_score``) and the update of its micro-batches (the optimizer step, equal for
all, is left out). Ratios are taken per repeat against a baseline and reported as median, min and max; times are
process CPU time on a CPU and synchronised wall time on a GPU (:func:`~trl_jagg.benchmarks.trainer.benchmark_clock`).

- DanceGRPO shape (16 steps, a random 60% of the first 15 trained, G = 12): ``dance_exact``, ``dance_jagg_cache``.
- Mix shape (16 steps, a 4-step SDE window, ODE elsewhere): ``mix_exact`` (MixGRPO's own cost: the mixed rollout
  with an exact update), ``mix_jagg_cache``, ``+_prefix`` (same-noise groups share the ODE before the window),
  ``+_dpm`` (DPM-Solver++ of order 2 on 40% of the ODE steps). The window slides between repeats.

Beside the measured ratios, the backbone work of every variant is counted by hooks over the timed steps (rows of
forwards with and without graph, rows of backwards) and turned into the ratio the backbone alone predicts, one
forward row = 1, one backward row = 2 units: what a real-size model approaches, where VAE, rewards and text encoders
are about 1% of a step.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from .trainer import PROMPTS, _endless, _spread, _sync, benchmark_clock

JSON_NAME = "whole_step_benchmark.json"
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
    "dance_jagg_cache": {**_DANCE, **_JAGG},
    "mix_exact": {**_MIX, "use_jagg": False},
    "mix_jagg_cache": {**_MIX, **_JAGG},
    "mix_jagg_cache_prefix": {**_MIX, **_JAGG, "same_group_noise": True},
    "mix_jagg_cache_prefix_dpm": {**_MIX, **_JAGG, "same_group_noise": True, "ode_solver_order": 2,
                                  "ode_step_ratio": 0.4},
}  # fmt: skip
"""The config fields of each variant (the rest is the benchmark's config)."""


def baselines(variant: str) -> list[str]:
    """What ``variant`` is compared with: the exact DanceGRPO step, and for the mixed rollouts the same rollout with
    an exact update (MixGRPO's own cost)."""
    return ["dance_exact"] + (["mix_exact"] if variant.startswith("mix") else [])


class RowCounter:
    """Rows of backbone forwards with and without an autograd graph, and rows of the backwards through it."""

    def __init__(self, transformer: torch.nn.Module):
        self.counts = {"graph_rows": 0, "no_grad_rows": 0, "backward_rows": 0}
        self._handles = [
            transformer.register_forward_pre_hook(self._before, with_kwargs=True),
            transformer.register_forward_hook(self._after),
        ]

    def _before(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        rows = kwargs["hidden_states"].shape[0]
        self.counts["graph_rows" if torch.is_grad_enabled() else "no_grad_rows"] += rows

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if output[0].requires_grad:
            output[0].register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.counts["backward_rows"] += grad.shape[0]

    def close(self) -> dict[str, int]:
        for handle in self._handles:
            handle.remove()
        return dict(self.counts)


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
    """
    from ..ddpo_jagg_trainer import DDPOJaggTrainer
    from ..grpo_jagg_config import GRPOJaggConfig
    from ..testing.tiny_models import save_tiny_pipeline

    unknown = sorted(set(variants) - set(WHOLE_STEP_VARIANTS))
    if unknown:
        raise ValueError(f"Unknown `variants` {unknown}: use names of {list(WHOLE_STEP_VARIANTS)}.")
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    clock = benchmark_clock(device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    rows: dict[str, dict[str, int]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = save_tiny_pipeline(
                "flux", str(Path(tmp) / "flux"), seed=seed,
                transformer={"num_layers": num_layers, "num_single_layers": num_single_layers},
            )  # fmt: skip
            trainers = {}
            for name in variants:
                fields = WHOLE_STEP_VARIANTS[name]
                config = GRPOJaggConfig(
                    output_dir=str(Path(tmp) / name), per_device_train_batch_size=fields["num_generations"],
                    height=resolution, width=resolution, max_sequence_length=max_sequence_length, beta=0.0,
                    report_to="none", disable_tqdm=True, use_cpu=device.type == "cpu", seed=seed, **fields,
                )  # fmt: skip
                torch.manual_seed(seed)
                trainer = DDPOJaggTrainer(
                    model=model_dir, reward_funcs="prompt_color", args=config,
                    train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                )  # fmt: skip
                trainers[name] = (trainer, _endless(trainer))
            num_starts = WHOLE_STEP_VARIANTS["mix_exact"]["num_inference_steps"] - 1 - 4 + 1
            for repeat in range(repeats + 1):
                step = (7 * repeat) % num_starts  # the mix window's start moves over the schedule between repeats
                order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
                for name in order:
                    trainer, batches = trainers[name]
                    inputs = next(batches)
                    counter = RowCounter(trainer.adapter.transformer)  # a hook per call: negligible
                    _sync(device)
                    start = clock()
                    _whole_step(trainer, inputs, step)
                    _sync(device)
                    elapsed = clock() - start
                    counted = counter.close()
                    if repeat > 0:  # repeat 0 is the warm-up
                        times[name].append(elapsed)
                        rows[name] = {k: rows.get(name, {}).get(k, 0) + v for k, v in counted.items()}
            del trainers
            gc.collect()
    finally:
        torch.set_num_threads(previous_threads)

    def units(name: str) -> int:
        r = rows[name]
        return r["graph_rows"] + r["no_grad_rows"] + 2 * r["backward_rows"]

    results = []
    for name in variants:
        entry: dict[str, Any] = {"variant": name, "step_s": _spread(times[name]), "backbone_rows": rows[name]}
        for baseline in baselines(name):
            if baseline in times and baseline != name:
                entry[f"speedup_vs_{baseline}"] = _spread([b / t for b, t in zip(times[baseline], times[name])])
                entry[f"backbone_speedup_vs_{baseline}"] = units(baseline) / units(name)
        results.append(entry)
    report = {
        "config": {
            "resolution": resolution, "text_tokens": max_sequence_length, "num_layers": num_layers,
            "num_single_layers": num_single_layers, "repeats": repeats, "torch_threads": num_threads,
            "device": device.type, "torch": torch.__version__,
            "timer": "wall time (perf_counter)" if device.type != "cpu" else "process CPU time (process_time)",
            "variants": {name: WHOLE_STEP_VARIANTS[name] for name in variants},
        },
        "results": results,
    }  # fmt: skip
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    for entry in results:
        ratios = "  ".join(
            f"{key.removeprefix('speedup_vs_')}: {entry[key]['median']:.2f}x "
            f"[{entry[key]['min']:.2f}, {entry[key]['max']:.2f}] (backbone {entry['backbone_' + key]:.2f}x)"
            for key in entry
            if key.startswith("speedup_vs_")
        )
        print(f"{entry['variant']:28s} {entry['step_s']['median']:8.3f} s  {ratios}")
    print(f"wrote {out / JSON_NAME}")
    return report
