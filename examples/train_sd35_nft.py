"""DiffusionNFT on Stable Diffusion 3.5 Medium with the PickScore reward (LoRA): `objective="nft"`.

The `nft-sd35` preset (trl_jagg/recipes/diffusion_nft.py, docs/models.md): 512 px, 10 deterministic rollout steps with
DPM-Solver 2 and no CFG, sampled by an old policy that follows the trained weights after each rollout; 24 images per
prompt; the negative-aware flow-matching loss on 99% of the rollout's timesteps (beta 1, KL 1e-4); LoRA r 32 / alpha
64 on the attention projections; constant lr 3e-4; one optimizer step per rollout; fp16 autocast as DiffusionNFT.
JAGG across timesteps is an option (`--use_jagg`): it groups 4 of a sample's timesteps into one joint backward.

    accelerate launch --num_processes 8 examples/train_sd35_nft.py --output_dir sd35-nft
    python examples/train_sd35_nft.py --tiny --output_dir /tmp/sd35-nft-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="sd35-nft")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--use_jagg", action="store_true", help="JAGG across each sample's trained timesteps")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("nft-sd35")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  use_jagg=args.use_jagg, push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 autocast, GPUs)
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
