"""GRPO on FLUX.2 dev with CLIP and PickScore rewards (Flow-Factory's recipe): LoRA, embedded guidance 4, JAGG.

The `flow-factory-flux2-dev` preset (trl_jagg/recipes/, docs/models.md): 8 sampling steps at 512 px with embedded
guidance 4 (one backbone call per step, no negative prompt), SDE noise level a = 1.0, G = 16, CLIP (weight 1) and
PickScore (0.5) aggregated with GDPO, LoRA r 64 / alpha 128 on the attention and feed-forward of both streams; JAGG as
in the paper, W = 4 and jagg_frac = 0.6 (of the 7 trained steps, one JAGG group of 4; the remaining 3 run exact).

    accelerate launch --num_processes 8 examples/train_flux2_dev_clip_pickscore.py --output_dir flux2-dev-grpo
    python examples/train_flux2_dev_clip_pickscore.py --tiny --output_dir /tmp/flux2-dev-tiny   # CPU smoke test
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux2-dev-grpo")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-factory-flux2-dev")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    model, rewards = "black-forest-labs/FLUX.2-dev", list(recipe.reward_funcs)  # clipscore, pickscore
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux2_dev")
        model, rewards, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=rewards,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: Flux2Pipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
