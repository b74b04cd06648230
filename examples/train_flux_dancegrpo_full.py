"""DanceGRPO on FLUX.1-dev with the HPSv2.1 reward: full fine-tuning, constant-eta SDE, a random 60% of steps trained.

The `dancegrpo-flux` preset (trl_jagg/recipes/, docs/models.md): 720 px, 16 sampling steps with a fixed time shift
3 (a scheduler override, applied to the pipeline below), eta 0.3, full fine-tuning at a constant lr 1e-5, a random
60% of the first 15 denoising steps trained per sample, G = 12 samples per process and three optimizer steps on them
(each used once), bf16 autocast over float32 weights; JAGG as in the paper, W = 4 and jagg_frac = 0.6 over the trained
steps. Full fine-tuning a 12B backbone needs its optimizer state sharded, so FSDP2 (per transformer block) is
switched on when launched on more than one process:

    accelerate launch --num_processes 8 examples/train_flux_dancegrpo_full.py --output_dir flux-dancegrpo
    python examples/train_flux_dancegrpo_full.py --tiny --output_dir /tmp/dance-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import load_dataset
from diffusers import FluxPipeline

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run

FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["FluxTransformerBlock", "FluxSingleTransformerBlock"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux-dancegrpo")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe, distributed = get_recipe("dancegrpo-flux"), int(os.environ.get("WORLD_SIZE", "1")) > 1
    config = dict(output_dir=args.output_dir, max_steps=300, save_steps=50, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    if distributed:  # FSDP2, one shard unit per transformer block
        config.update(fsdp=True, fsdp_config=FSDP_CONFIG)
    model, reward = "black-forest-labs/FLUX.1-dev", "hpsv2.1"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux", num_inference_steps=8)
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    config = GRPOJaggConfig.from_recipe(recipe.name, **config)
    # Float32 master weights for full fine-tuning; the recipe's fixed shift 3 replaces Flux's dynamic shift.
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(model, dtype=getattr(torch, config.dtype)))
    trainer = DDPOJaggTrainer(model=pipeline, reward_funcs=reward, args=config, train_dataset=dataset)
    trainer.train()
    trainer.save_model()  # the transformer in the diffusers layout: FluxTransformer2DModel.from_pretrained(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
