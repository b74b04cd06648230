"""GRPO on Wan2.2-T2V-A14B (two experts) with PickScore per frame (Flow-Factory's recipe): LoRA on both, JAGG.

The `flow-factory-wan2.2` preset (trl_jagg/recipes/flow_factory.py, docs/models.md): 5-frame 480x480 videos, 10
steps, CFG 4 on the high-noise expert `transformer` and 3 on the low-noise `transformer_2` (the pipeline's switch at
`boundary_ratio`), G = 16, LoRA r 64 / alpha 128 on both experts (`train_experts="both"`; or "high_noise" /
"low_noise"); JAGG groups of W = 4 on each side of the switch, never across it.

    accelerate launch --num_processes 8 examples/train_wan22_pickscore.py --dataset <prompts> --output_dir wan22
    python examples/train_wan22_pickscore.py --tiny --output_dir /tmp/wan22-tiny   # CPU smoke test
"""

from __future__ import annotations

import argparse

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="wan22")
    parser.add_argument("--dataset", required=False, help="Hub dataset of prompts (Flow-Factory: dataset/pickscore)")
    parser.add_argument("--prompt_column", default="prompt")
    parser.add_argument("--train_experts", default="both", choices=["both", "high_noise", "low_noise"])
    parser.add_argument("--tiny", action="store_true", help="tiny two-expert model built from config, colour reward")
    args = parser.parse_args()

    recipe = get_recipe("flow-factory-wan2.2")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  train_experts=args.train_experts)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's bf16 (GPUs)
    model, reward = "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "pickscore"
    if args.tiny:  # the same two-expert architecture built small from config, a weight-free reward
        tiny = tiny_run("wan22")
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        if not args.dataset:
            parser.error("--dataset is required without --tiny")
        dataset = load_dataset(args.dataset, split="train").rename_column(args.prompt_column, "prompt")

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128, on each trained expert
    )
    trainer.train()
    # One folder per trained expert: pipe.load_lora_weights(f"{output_dir}/transformer") and
    # pipe.load_lora_weights(f"{output_dir}/transformer_2", load_into_transformer_2=True).
    trainer.save_model()


if __name__ == "__main__":
    main()
