"""GRPO on FLUX.2 klein base with the PickScore reward (Flow-Factory's recipe): LoRA, CFG 4, JAGG in the update.

The `flow-factory-flux2-klein-base` preset (trl_jagg/recipes/, docs/models.md): 8 sampling steps at 384 px with
CFG 4 (the pipeline's empty negative prompt), SDE noise level a = 0.7, G = 16, LoRA r 64 / alpha 128 on the attention
and feed-forward of both streams; JAGG as in the paper, W = 4 and jagg_frac = 0.6 (of the 7 trained steps, one JAGG
group of 4; the remaining 3 run exact).

    accelerate launch --num_processes 8 examples/train_flux2_klein_pickscore.py --output_dir flux2-klein-pickscore
    python examples/train_flux2_klein_pickscore.py --tiny --output_dir /tmp/flux2-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux2-klein-pickscore")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-factory-flux2-klein-base")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    model, reward = "black-forest-labs/FLUX.2-klein-base-9B", "pickscore"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux2_klein")
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
    trainer.save_model()  # pytorch_lora_weights.safetensors: Flux2KleinPipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
