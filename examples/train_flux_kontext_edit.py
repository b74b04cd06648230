"""GRPO on FLUX.1 Kontext (image editing), Flow-GRPO's recipe: LoRA, embedded guidance 2.5, JAGG in the update.

The `flow-grpo-kontext` preset (trl_jagg/recipes/, docs/models.md): 6 sampling steps at 512 px, SDE a = 0.9,
groups of 21 edits of one (instruction, source image), LoRA r 64 / alpha 128 on attention, feed-forward and the
single blocks' MLP; rewards: CLIP image similarity to the source + GenEval counting, 0.5 each. JAGG as in the paper:
of the 5 trained steps, one JAGG group of W = 4. The dataset has `prompt` (the instruction), `source_image` and
GenEval's metadata columns (`tag`, `include`, `exclude`), e.g. Flow-GRPO's dataset/counting_edit as JSON lines.

    accelerate launch --num_processes 8 examples/train_flux_kontext_edit.py --dataset train_metadata.jsonl
    python examples/train_flux_kontext_edit.py --tiny --output_dir /tmp/kontext-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import os

from datasets import Image, load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="flux-kontext-edit")
    parser.add_argument("--dataset", default="dataset/counting_edit/train_metadata.jsonl", help="JSON lines")
    parser.add_argument("--image_column", default="image", help="source image paths, relative to the file")
    parser.add_argument("--push_to_hub", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-kontext")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard",
                  push_to_hub=args.push_to_hub)  # fmt: skip
    config[recipe.mixed_precision] = True  # the peer's mixed precision (bf16 autocast, GPUs)
    model, rewards = "black-forest-labs/FLUX.1-Kontext-dev", list(recipe.reward_funcs)
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("flux_kontext")
        model, rewards, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        root = os.path.dirname(os.path.abspath(args.dataset))
        dataset = load_dataset("json", data_files=args.dataset, split="train")
        dataset = dataset.map(lambda row: {"source_image": os.path.join(root, row[args.image_column])})
        dataset = dataset.cast_column("source_image", Image(mode="RGB"))

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=rewards,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: FluxKontextPipeline.load_lora_weights(output_dir)
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=None if args.tiny else args.dataset)


if __name__ == "__main__":
    main()
