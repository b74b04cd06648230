"""Flow-GRPO on FLUX.1-dev with the PickScore reward: LoRA, JAGG on the high-noise 60% of the step groups.

The `flow-grpo-flux` preset (trl_jagg/recipes/, docs/models.md): 6 sampling steps, embedded guidance 3.5, SDE noise
level a = 0.9, LoRA r 64 / alpha 128 on the attention projections and the feed-forward layers, G = 24, every step
trained but the last, two optimizer steps per rollout, bf16 autocast over float32 weights; JAGG as in the paper, W = 4
and jagg_frac = 0.6 (the 5 trained steps make one JAGG group and one exact step).

    accelerate launch --num_processes 8 examples/train_flux_pickscore.py --output_dir flux-pickscore-grpo
    python examples/train_flux_pickscore.py --tiny --output_dir /tmp/flux-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux-pickscore-grpo")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-flux")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    model, reward = "black-forest-labs/FLUX.1-dev", "pickscore"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux")
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: FluxPipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
