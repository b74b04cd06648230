"""GRPO update stage at FLUX.1-dev size on one GPU: exact vs JAGG vs JAGG + on-policy velocity cache.

Builds a ``FluxTransformer2DModel`` from FLUX.1-dev's published config (19 double- and 38 single-stream blocks, 24
heads of 128, 12B parameters) with random weights directly on the GPU in bfloat16 (nothing is downloaded), puts
Flow-GRPO's LoRA on it (rank 64, alpha 128, the preset's attention and feed-forward targets) and runs Flow-GRPO's
FLUX.1-dev setting through ``DDPOJaggTrainer``: 512 x 512 images (1024 image tokens), 512 text tokens, 6 denoising
steps (5 trained: one JAGG group of W = 4 and one exact step), G = 8 images of a prompt per rollout in micro-batches of
``--batch``. The text encoders and the VAE are tiny random models whose outputs have the real shapes (T5 tokens of
width 4096, a pooled CLIP vector of 768), so prompt embeddings are random at the real shapes. The reward is the
weight-free ``prompt_color``.

It prints, per variant (interleaved over ``--repeats`` repeats after a warm-up, each on a fresh rollout), the update
time of the whole rollout, the whole-step time (rollout + update), the speedup over exact and the peak memory of the
update, and writes ``gpu_benchmark.json``. On one H100/H200 it should take about 5 minutes (not measured yet).

``--whole_step`` times instead the whole-step variants of :mod:`trl_jagg.benchmarks.whole_step` (each preset
trained by ``train()`` at its own cadence, one rollout at a time: ``dancegrpo-flux`` exact and as shipped,
``mixgrpo-flux`` as MixGRPO-Flash with an exact update and as shipped), with the same variant definitions,
interleaving and hook counts, on the FLUX.1-dev-size transformer with full fine-tuning (as DanceGRPO and MixGRPO
train it; every trainer shares the one pipeline and steps it with plain SGD, which keeps no optimizer state). It
reports synchronised wall time per rollout, the peak CUDA memory of an untimed rollout per variant and beside each
measured ratio the FLOP model's predictions for the counted work (:mod:`trl_jagg.benchmarks.flops`, activation
checkpointing as each preset sets it), and writes ``gpu_whole_step_benchmark.json``.

    python -m trl_jagg.benchmarks.gpu --output_dir runs/gpu_bench            # one GPU, about 5 minutes
    python -m trl_jagg.benchmarks.gpu --output_dir runs/gpu_bench --tiny     # the same code on a CPU, seconds
    python -m trl_jagg.benchmarks.gpu --output_dir runs/gpu_bench --whole_step
    python -m trl_jagg.benchmarks.gpu --output_dir runs/gpu_bench --whole_step --tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trl_jagg.benchmarks.flops import (
    FLUX_DEV_TRANSFORMER,
    TRAINING,
    StepCosts,
    backbone_costs,
    flux_dev_costs,
    flux_dev_lora,
)
from trl_jagg.benchmarks.whole_step import (
    WHOLE_STEP_VARIANTS,
    build_trainers,
    flop_model,
    format_table,
    summarize,
    time_rollouts,
    variant_checkpointing,
    with_baselines,
)

TINY_TRANSFORMER = FLUX_DEV_TRANSFORMER | {
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}


def build_pipeline(transformer_config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """A ``FluxPipeline`` with tiny random text encoders and VAE (outputs at the transformer's widths) and a
    randomly initialised transformer of ``transformer_config``, built on ``device`` in ``dtype``."""
    from diffusers import FluxTransformer2DModel

    from trl_jagg.testing.tiny_models import build_tiny_pipeline

    clip_width, t5_width = transformer_config["pooled_projection_dim"], transformer_config["joint_attention_dim"]
    pipe = build_tiny_pipeline(
        "flux",
        # Small everywhere except the output widths the transformer reads.
        text_encoder={"hidden_size": clip_width, "num_attention_heads": 2, "intermediate_size": 64},
        text_encoder_2={"d_model": t5_width, "d_kv": 8, "num_heads": 2, "d_ff": 64, "num_layers": 1},
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise the 12B parameters in bf16 on the GPU, never in fp32 on the host
    try:
        with torch.device(device):
            torch.manual_seed(0)
            transformer = FluxTransformer2DModel(**transformer_config)
    finally:
        torch.set_default_dtype(previous)
    pipe.register_modules(transformer=transformer)
    return pipe.to(device)


def run(
    output_dir: str,
    *,
    tiny: bool = False,
    resolution: int = 512,
    max_sequence_length: int = 512,
    num_generations: int = 8,
    batch: int = 2,
    lora_rank: int = 64,
    repeats: int = 3,
    gradient_checkpointing: bool = False,
) -> dict[str, Any]:
    """Build the model and trainer and time the variants; returns (and writes) the report."""
    from datasets import Dataset
    from peft import LoraConfig

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.benchmarks.trainer import time_variants
    from trl_jagg.recipes import get_recipe

    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TINY_TRANSFORMER if tiny else FLUX_DEV_TRANSFORMER
    start = time.perf_counter()
    pipe = build_pipeline(config, device, dtype)
    num_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"[gpu-bench] transformer {num_params / 1e9:.2f}B parameters on {device} ({dtype}), "
          f"built in {time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    recipe = get_recipe("flow-grpo-flux")
    lora = recipe.lora | {"r": lora_rank, "lora_alpha": 2 * lora_rank}
    if num_generations % batch:
        raise ValueError(f"`batch` ({batch}) must divide `num_generations` ({num_generations}).")
    args = GRPOJaggConfig(
        output_dir=os.path.join(output_dir, "run"),
        num_generations=num_generations,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=num_generations // batch,  # one rollout of G images = one optimizer step
        height=resolution,
        width=resolution,
        max_sequence_length=max_sequence_length,
        num_inference_steps=recipe.config["num_inference_steps"],
        guidance_scale=recipe.config["guidance_scale"],
        noise_level=recipe.config["noise_level"],
        train_timesteps=recipe.config["train_timesteps"],
        epsilon=recipe.config.get("epsilon", 1e-4),
        jagg_group_size=4,
        jagg_frac=1.0,
        activation_checkpointing=gradient_checkpointing,
        use_cpu=not cuda,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = DDPOJaggTrainer(
        model=pipe,
        reward_funcs="prompt_color",
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue triangle"]}),
        peft_config=LoraConfig(**lora),
    )
    results, rollout_s = time_variants(trainer, group_sizes=(4,), jagg_fracs=(1.0,), repeats=repeats)
    report = {
        "config": {
            "transformer": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
            "parameters": num_params,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "dtype": str(dtype),
            "resolution": resolution,
            "image_tokens": (resolution // 16) ** 2,
            "text_tokens": max_sequence_length,
            "num_inference_steps": args.num_inference_steps,
            "num_generations": num_generations,
            "micro_batch": batch,
            "lora": {k: v for k, v in lora.items() if k != "target_modules"}
            | {"targets": list(lora["target_modules"])},
            "gradient_checkpointing": gradient_checkpointing,
            "repeats": repeats,
            "torch": torch.__version__,
        },
        "rollout_s": rollout_s,
        "results": results,
        "total_s": time.perf_counter() - start,
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_benchmark.json").write_text(json.dumps(report, indent=2))
    rollout_median = sorted(rollout_s)[len(rollout_s) // 2]
    print(f"[gpu-bench] rollout of {num_generations} images: {rollout_median:.2f} s (median)")
    print(f"{'variant':<16} {'update s':>9} {'speedup':>8} {'whole step s':>13} {'step speedup':>13} {'peak MiB':>9}")
    for r in results:
        peak = r["peak_memory_mb"]
        print(
            f"{r['variant']:<16} {r['update_s']['median']:9.2f} {r['update_speedup']['median']:7.2f}x "
            f"{rollout_median + r['update_s']['median']:13.2f} {r['step_speedup']['median']:12.2f}x "
            f"{'' if peak is None else f'{peak:9.0f}'}"
        )
    print(f"[gpu-bench] wrote {out / 'gpu_benchmark.json'} in {report['total_s']:.0f} s")
    return report


def run_whole_step(
    output_dir: str,
    *,
    tiny: bool = False,
    variants: Sequence[str] = tuple(WHOLE_STEP_VARIANTS),
    resolution: int = 512,
    max_sequence_length: int = 512,
    repeats: int = 3,
) -> dict[str, Any]:
    """Train the whole-step variants' presets one rollout at a time on the transformer of FLUX.1-dev's config (see
    the module docstring); returns (and writes) the report. ``tiny`` runs the tiny transformer on the CPU, its work
    priced at its own counted FLOPs (the tiny VAE and text encoders are not priced)."""
    cuda = torch.cuda.is_available() and not tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = TINY_TRANSFORMER if tiny else FLUX_DEV_TRANSFORMER
    start = time.perf_counter()
    pipe = build_pipeline(config, device, dtype)
    print(f"[gpu-bench] whole step: {sum(p.numel() for p in pipe.transformer.parameters()) / 1e9:.2f}B parameters "
          f"on {device} ({dtype})", flush=True)  # fmt: skip
    names = with_baselines(variants)
    # Every trainer shares the one pipeline; plain SGD keeps no optimizer state (AdamW's for 12B parameters per
    # trainer would not fit), and the step itself is elementwise, a small share of a rollout.
    trainers = build_trainers(
        pipe, names, os.path.join(output_dir, "run"), rollouts=repeats + 2, height=resolution, width=resolution,
        max_sequence_length=max_sequence_length, optim="sgd", use_cpu=not cuda, seed=0,
    )  # fmt: skip
    measured = time_rollouts(trainers, repeats=repeats)
    if tiny:
        lora = flux_dev_lora() | {"r": 4, "lora_alpha": 8}  # the preset's targets, at a rank below the tiny width
        costs = {
            training: StepCosts(
                **backbone_costs(config, image_tokens=(resolution // 16) ** 2, text_tokens=max_sequence_length,
                                 lora=lora if training == "lora" else None),
                vae_decode=0.0, text_encode=0.0,
            )
            for training in TRAINING
        }  # fmt: skip
        model = flop_model(costs, model="tiny transformer", resolution=resolution, text_tokens=max_sequence_length,
                           lora=lora)  # fmt: skip
    else:
        costs = flux_dev_costs(resolution, max_sequence_length)
        model = flop_model(costs, resolution=resolution, text_tokens=max_sequence_length)
    checkpointing = {name: {t: variant_checkpointing(name, t) for t in costs} for name in names}
    baselines = {name: WHOLE_STEP_VARIANTS[name].baselines for name in names}
    report = {
        "config": {
            "transformer": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": str(dtype),
            "resolution": resolution, "text_tokens": max_sequence_length, "repeats": repeats,
            "torch": torch.__version__, "optimizer": "sgd",
            "timer": "wall time (perf_counter), synchronised" if cuda else "process CPU time (process_time)",
            "variants": {name: WHOLE_STEP_VARIANTS[name].preset for name in names}, "flop_model": model,
        },
        "results": summarize(measured, costs, baselines, checkpointing),
        "total_s": time.perf_counter() - start,
    }  # fmt: skip
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_whole_step_benchmark.json").write_text(json.dumps(report, indent=2))
    print(format_table(report["results"], "tiny model's FLOPs" if tiny else f"FLUX.1-dev at {resolution} px"))
    for entry in report["results"]:
        peak = entry["peak_memory_mb"]
        print(f"{entry['variant']:28s} peak {'-' if peak is None else f'{peak:.0f} MiB'}")
    print(f"[gpu-bench] wrote {out / 'gpu_whole_step_benchmark.json'} in {report['total_s']:.0f} s")
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="runs/gpu_bench")
    parser.add_argument("--tiny", action="store_true", help="A tiny transformer on the CPU (checks the script).")
    parser.add_argument("--resolution", type=int, default=None, help="Pixels (512; 64 with --tiny).")
    parser.add_argument("--max_sequence_length", type=int, default=None, help="Text tokens (512; 16 with --tiny).")
    parser.add_argument("--num_generations", type=int, default=None, help="G, images per rollout (8; 4 with --tiny).")
    parser.add_argument("--batch", type=int, default=2, help="Images per micro-batch.")
    parser.add_argument("--lora_rank", type=int, default=None, help="LoRA rank (64; 4 with --tiny).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed repeats after a warm-up (3; 1 with --tiny).")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="Checkpoint the backbone's blocks.")
    parser.add_argument(
        "--whole_step", action="store_true",
        help="Time the whole-step variants at their presets' cadence (--batch, --num_generations, --lora_rank and "
        "--gradient_checkpointing unused: the presets set them).",
    )  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=list(WHOLE_STEP_VARIANTS), help="Whole-step variants.")
    ns = parser.parse_args(argv)
    defaults = {"resolution": (512, 64), "max_sequence_length": (512, 16), "num_generations": (8, 4),
                "lora_rank": (64, 4), "repeats": (3, 1)}  # fmt: skip
    kwargs = {k: v if v is not None else defaults[k][ns.tiny] for k, v in vars(ns).items() if k in defaults}
    common = {"tiny": ns.tiny, "batch": ns.batch, "gradient_checkpointing": ns.gradient_checkpointing}
    if ns.whole_step:
        keep = ("resolution", "max_sequence_length", "repeats")
        return run_whole_step(ns.output_dir, tiny=ns.tiny, variants=ns.variants, **{k: kwargs[k] for k in keep})
    return run(ns.output_dir, **common, **kwargs)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(0 if main() else 1)
