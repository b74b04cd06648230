"""GRPO on Qwen-Image-Edit (Flow-GRPO's counting-edit recipe): LoRA, true CFG 4, JAGG on the high-noise groups.

The `flow-grpo-qwenimage-edit` preset (trl_jagg/recipes/, docs/models.md): 10 steps, SDE a = 1.0 on every step but
the last, G = 16, LoRA r 64 / alpha 128 on attention and MLPs, the GenEval reward (Flow-GRPO adds 0.2 of an image
similarity reward, which trl_jagg does not have). The dataset is Flow-GRPO's dataset/counting_edit: JSON lines with
an instruction (`prompt`), the image it edits (`image`, a path relative to the folder) and GenEval's metadata.

    accelerate launch --config_file fsdp.yaml examples/train_qwen_image_edit_flow_grpo.py --dataset counting_edit
    python examples/train_qwen_image_edit_flow_grpo.py --tiny --output_dir /tmp/qwen-edit-tiny   # CPU, seconds
"""

from __future__ import annotations

import argparse
import os

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import tiny_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="qwen-image-edit-geneval")
    parser.add_argument("--dataset", default="dataset/counting_edit", help="folder with train_metadata.jsonl")
    parser.add_argument("--tiny", action="store_true", help="tiny model built from config, colour reward, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-qwenimage-edit")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=100, report_to="tensorboard")
    config[recipe.mixed_precision] = True  # the peer's bf16 autocast (GPUs)
    model, reward = "Qwen/Qwen-Image-Edit", list(recipe.reward_funcs)
    if args.tiny:  # the same architecture built small from config, a weight-free reward: seconds on a CPU
        tiny = tiny_run("qwenimage_edit")
        model, reward, dataset = tiny.model, tiny.reward, tiny.dataset
        config.update(tiny.config)
    else:
        dataset = load_dataset("json", data_files=os.path.join(args.dataset, "train_metadata.jsonl"), split="train")
        # Paths relative to the folder; Flow-GRPO resizes every source to the training resolution (one grid).
        dataset = dataset.map(lambda row: {"source_image": os.path.join(args.dataset, row["image"])})

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=dataset,
        peft_config=recipe.lora_config(),  # LoRA r 64 / alpha 128
    )
    trainer.train()
    trainer.save_model()  # pytorch_lora_weights.safetensors: QwenImageEditPipeline.load_lora_weights(output_dir)


if __name__ == "__main__":
    main()
