"""Flow-GRPO on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA), JAGG in the update stage.

The `flow-grpo-sd35` preset (trl_jagg/recipes/, docs/models.md): 512 px, 10 sampling steps, CFG 4.5, SDE noise
level a = 0.7, G = 24 images per prompt, LoRA r 32 / alpha 64 on the attention projections of `attn` (not SD3.5's
`attn2`), constant lr 3e-4, KL beta 0.01 (Flow-GRPO's PickScore value), every step trained but the last; JAGG as in
the paper, W = 4 and jagg_frac = 0.6 (the 9 trained steps make two JAGG groups and one exact step). Each process
samples 24 images, one whole group, per rollout and takes two optimizer steps on them (each image used once), in fp16
autocast over float32 weights, as Flow-GRPO.

    accelerate launch --num_processes 8 examples/train_sd35_flow_grpo.py --output_dir sd35-flow-grpo
    python examples/train_sd35_flow_grpo.py --tiny --output_dir /tmp/sd35-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="sd35-flow-grpo")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-sd35")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    model, reward = "stabilityai/stable-diffusion-3.5-medium", "pickscore"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("sd3")
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 32 / alpha 64
    )
    trainer.train()
    trainer.save_model()  # StableDiffusion3Pipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
