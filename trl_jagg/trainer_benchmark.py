"""Trainer-level benchmark: the update stage of :class:`DDPOJaggTrainer` with exact backward vs JAGG.

Unlike the engine benchmark (a stand-in network), this one runs the real path on a small Flux-architecture
pipeline built from config: the adapter's backbone call, the SDE log-prob, the PPO loss and ``accelerator.backward``.
One rollout is sampled; then the same update is timed alternately with ``use_jagg=False`` and ``use_jagg=True``
for each group size, and the whole-step speedup follows from the measured rollout time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

PROMPTS = ["a red circle", "a green square", "a blue triangle", "a red square"]
JSON_NAME = "trainer_benchmark.json"
PNG_NAME = "trainer_benchmark.png"


def _zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def run_trainer_benchmark(
    output_dir: str,
    *,
    group_sizes: Sequence[int] = (2, 4, 8),
    num_inference_steps: int = 9,
    resolution: int = 64,
    batch: int = 4,
    num_layers: int = 2,
    num_single_layers: int = 4,
    repeats: int = 5,
    lora: bool = False,
    seed: int = 0,
    num_threads: int = 1,
) -> dict[str, Any]:
    """Time the update stage of the real trainer, exact vs JAGG (``jagg_frac=1``), on a tiny Flux pipeline.

    Returns (and writes as JSON + PNG) per group size: median update seconds of both, their ratio, the whole-step
    speedup including the rollout, the backward calls, the per-group gradient cosine (calibration) and, on CUDA, the
    peak memory of the update with each.

    Args:
        output_dir: where ``trainer_benchmark.json`` and ``trainer_benchmark.png`` go.
        group_sizes: the JAGG group sizes W to compare with exact backward.
        num_inference_steps: denoising steps; all but the last are trained.
        resolution: image height and width in pixels (a multiple of 16).
        batch: images per micro-batch (2 prompts x 2 generations for the default 4).
        num_layers: double-stream blocks of the Flux transformer.
        num_single_layers: single-stream blocks of the Flux transformer.
        repeats: timed exact/JAGG pairs per group size (after one warm-up pair); the median is reported.
        lora: train a LoRA adapter instead of the full backbone.
        seed: seed of the model weights and the rollout.
        num_threads: torch CPU threads while timing (1: on a shared machine more threads mostly time the
            scheduler); restored afterwards.
    """
    from peft import LoraConfig

    from .ddpo_jagg_trainer import DDPOJaggTrainer
    from .grpo_jagg_config import GRPOJaggConfig
    from .tiny_models import save_tiny_pipeline

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_pipeline(
            "flux",
            str(Path(tmp) / "flux"),
            seed=seed,
            transformer={"num_layers": num_layers, "num_single_layers": num_single_layers},
        )
        for group_size in group_sizes:
            config = GRPOJaggConfig(
                output_dir=str(Path(tmp) / "run"),
                per_device_train_batch_size=batch,
                num_generations=2,
                num_inference_steps=num_inference_steps,
                height=resolution,
                width=resolution,
                jagg_group_size=group_size,
                jagg_frac=1.0,
                report_to="none",
                disable_tqdm=True,
                seed=seed,
            )
            peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["to_q", "to_k", "to_v"]) if lora else None
            trainer = DDPOJaggTrainer(
                model=model_dir,
                reward_funcs="prompt_color",
                args=config,
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                peft_config=peft_config,
            )
            trainer.create_optimizer_and_scheduler(num_training_steps=1)
            model = trainer.model
            inputs = next(iter(trainer.get_train_dataloader()))
            start = time.perf_counter()
            rollout = trainer._generate_and_score(inputs)
            rollout_s = time.perf_counter() - start
            times: dict[bool, list[float]] = {False: [], True: []}
            calls: dict[bool, int] = {}
            peak_mb: dict[bool, float | None] = {False: None, True: None}
            # One warm-up pair, then interleaved pairs in alternating order (the machine's load drifts).
            for repeat in range(repeats + 1):
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for use_jagg in order:
                    trainer.args.use_jagg = use_jagg
                    _zero_grads(model)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    result = trainer._update(model, rollout)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                        peak_mb[use_jagg] = torch.cuda.max_memory_allocated() / 2**20
                    elapsed = time.perf_counter() - start
                    calls[use_jagg] = result.num_backward
                    if repeat > 0:
                        times[use_jagg].append(elapsed)
            calibration = trainer.calibrate_jagg(threshold=0.0)
            exact_s, jagg_s = statistics.median(times[False]), statistics.median(times[True])
            results.append(
                {
                    "group_size": group_size,
                    "update_exact_s": exact_s,
                    "update_jagg_s": jagg_s,
                    "update_speedup": exact_s / jagg_s,
                    "rollout_s": rollout_s,
                    "step_speedup": (rollout_s + exact_s) / (rollout_s + jagg_s),
                    "backward_calls_exact": calls[False],
                    "backward_calls_jagg": calls[True],
                    "group_cosine": calibration["group_cosine"],
                    # JAGG keeps two endpoint graphs alive: higher peak than one step at a time (CUDA only).
                    "peak_memory_exact_mb": peak_mb[False],
                    "peak_memory_jagg_mb": peak_mb[True],
                    "theory": 3 * group_size / (group_size + 4),
                }
            )
    torch.set_num_threads(previous_threads)
    report = {
        "config": {
            "num_inference_steps": num_inference_steps,
            "trained_steps": num_inference_steps - 1,
            "resolution": resolution,
            "batch": batch,
            "num_layers": num_layers,
            "num_single_layers": num_single_layers,
            "repeats": repeats,
            "lora": lora,
            "torch_threads": num_threads,
        },
        "results": results,
    }
    (out / JSON_NAME).write_text(json.dumps(report, indent=2))
    _plot(results, out / PNG_NAME)
    for r in results:
        cos = " ".join(f"{c:.3f}" for c in r["group_cosine"])
        print(
            f"W={r['group_size']}: update {r['update_exact_s']:.3f}s -> {r['update_jagg_s']:.3f}s "
            f"({r['update_speedup']:.2f}x, theory {r['theory']:.2f}x), whole step {r['step_speedup']:.2f}x, "
            f"backward calls {r['backward_calls_exact']} -> {r['backward_calls_jagg']}, group cosine {cos}"
            + (
                f", peak memory {r['peak_memory_exact_mb']:.0f} -> {r['peak_memory_jagg_mb']:.0f} MiB"
                if r["peak_memory_jagg_mb"] is not None
                else ""
            )
        )
    print(f"wrote {out / JSON_NAME} and {out / PNG_NAME}")
    return report


def _plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["group_size"] for r in results]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(sizes, [r["theory"] for r in results], "k--", label="theory 3W/(W+4)")
    ax.plot(sizes, [r["update_speedup"] for r in results], "o-", label="update stage (measured)")
    ax.plot(sizes, [r["step_speedup"] for r in results], "s-", label="whole step incl. rollout")
    ax.set_xlabel("JAGG group size W")
    ax.set_ylabel("speedup over exact")
    ax.set_title("DDPOJaggTrainer on a tiny Flux (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
