"""GRPO on Wan2.1-T2V-1.3B text-to-video with the OCR reward per frame (Flow-GRPO's recipe): LoRA, JAGG.

The `flow-grpo-wan2.1` preset (trl_jagg/recipes.py, docs/models.md): 33-frame 240x416 videos, 20 steps, CFG 4.5
with both branches in one backbone call, G = 4, LoRA r 32 / alpha 64 on the attention projections; the OCR reward
scores every frame and a video gets the mean; JAGG as in the paper, W = 4 and jagg_frac = 0.6 on the 19 trained steps.

    accelerate launch --num_processes 8 examples/train_wan_ocr.py --output_dir wan-ocr
    python examples/train_wan_ocr.py --tiny --output_dir /tmp/wan-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="wan-ocr")
    parser.add_argument("--dataset", required=False, help="Hub dataset of prompts naming the text to render")
    parser.add_argument("--prompt_column", default="prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-wan2.1")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's bf16 autocast over float32 weights (GPUs)
    model, reward = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "ocr"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("wan")
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        if not args.dataset:
            parser.error("--dataset is required without --tiny (prompts such as Flow-GRPO's dataset/ocr)")
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 32 / alpha 64
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: WanPipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
