"""Flow-GRPO on Qwen-Image with the HPSv2.1 reward: LoRA, FSDP2 across GPUs, JAGG in the update stage.

The `flow-grpo-qwenimage` preset (trl_jagg/recipes/, docs/models.md): true CFG 4 with norm rescaling, SDE noise
level a = 1.2 in a 2-step window of the 10 steps (the trained steps), G = 16, LoRA r 64 / alpha 128 on the attention
projections and both MLPs, two optimizer steps per rollout, bf16 over float32 weights, activation checkpointing; JAGG
with W = 2, the window (exact at W = 2: one joint backward instead of two). The preset's reward is PickScore; this
example trains on HPSv2.1 (`pip install -e ".[rewards]"`).

FSDP comes from the training arguments below (`fsdp`, `fsdp_config`): each QwenImageTransformerBlock is sharded,
and JAGG's joint backward gathers each block's parameters once for both endpoint forwards. The Trainer refuses
FSDP in a single process, so it is switched on only when launched on several:

    accelerate launch --num_processes 8 examples/train_qwenimage_hpsv2.py --output_dir qwenimage-hpsv2
    python examples/train_qwenimage_hpsv2.py --tiny --output_dir /tmp/qwen-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import os

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run

FSDP_CONFIG = {"version": 2, "transformer_layer_cls_to_wrap": ["QwenImageTransformerBlock"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="qwenimage-hpsv2")
    parser.add_argument("--dataset", default="nateraw/parti-prompts", help="Hub dataset of prompts")
    parser.add_argument("--prompt_column", default="Prompt")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe, distributed = get_recipe("flow-grpo-qwenimage"), int(os.environ.get("WORLD_SIZE", "1")) > 1
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
    if distributed:  # FSDP2, one shard unit per transformer block
        config.update(fsdp=True, fsdp_config=FSDP_CONFIG)
    model, reward = "Qwen/Qwen-Image", "hpsv2.1"
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("qwenimage")
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
    trainer.save_model()  # QwenImagePipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
