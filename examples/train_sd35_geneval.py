"""Flow-GRPO's GenEval recipe on Stable Diffusion 3.5 Medium (LoRA) with the GenEval-style reward, JAGG in the update.

The `flow-grpo-sd35-geneval` preset (trl_jagg/recipes/, docs/models.md), Flow-GRPO's geneval_sd3 config: 512 px,
10 steps, CFG 4.5, SDE a = 0.7, G = 24, LoRA r 32 / alpha 64, lr 3e-4, KL beta 0.04, every step but the last
trained (two JAGG groups of W = 4 and one exact step). The prompts are Flow-GRPO's dataset/geneval
train_metadata.jsonl: each line's prompt, tag, include and exclude become dataset columns, and the reward reads the
last three. `geneval` runs GenEval's rules on OWLv2 detections and CLIP colours in process; Flow-GRPO's reward is
GenEval's Mask2Former pipeline: serve that with examples/flow_grpo_sidecar.py and pass its URL as --reward.

    accelerate launch --num_processes 8 examples/train_sd35_geneval.py --output_dir sd35-geneval \\
        --train_metadata flow_grpo/dataset/geneval/train_metadata.jsonl \\
        --test_metadata flow_grpo/dataset/geneval/test_metadata.jsonl
    python examples/train_sd35_geneval.py --tiny --output_dir /tmp/sd35-geneval-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import os

from datasets import load_dataset

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.recipes import get_recipe
from trl_jagg.testing.tiny_models import temporary_folder, tiny_run
from trl_jagg.testing.tiny_rewards import TINY_GENEVAL_METADATA, save_tiny_geneval_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="sd35-geneval")
    parser.add_argument("--train_metadata", default="dataset/geneval/train_metadata.jsonl", help="GenEval jsonl")
    parser.add_argument("--test_metadata", default=None, help="GenEval jsonl that evaluate() scores")
    parser.add_argument("--reward", default="geneval", help="geneval, or the sidecar's URL (.../score/geneval)")
    parser.add_argument("--tiny", action="store_true", help="tiny SD3 and tiny random OWLv2 + CLIP, CPU")
    args = parser.parse_args()

    recipe = get_recipe("flow-grpo-sd35-geneval")
    config = dict(output_dir=args.output_dir, max_steps=1000, save_steps=120, report_to="tensorboard")
    config[recipe.mixed_precision] = True  # the peer's mixed precision (fp16 autocast, GPUs)
    if args.test_metadata:  # Flow-GRPO evaluates every 60 epochs of 2 optimizer steps
        config.update(eval_strategy="steps", eval_steps=120)
    model = "stabilityai/stable-diffusion-3.5-medium"
    if args.tiny:  # the same architectures built small from config: the reward's real code on random weights
        tiny = tiny_run("sd3")
        model, folder = tiny.model, temporary_folder("tiny-geneval-")  # removed at exit
        detector_dir, clip_dir = save_tiny_geneval_models(folder)
        # Random logits put most boxes near 0.5: a higher threshold keeps the counts small and varied.
        tiny_geneval = {"detector_id": detector_dir, "clip_id": clip_dir, "threshold": 0.6, "counting_threshold": 0.6}
        config.update(tiny.config, reward_kwargs={"geneval": tiny_geneval})
        args.train_metadata = os.path.join(folder, "train_metadata.jsonl")
        with open(args.train_metadata, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in TINY_GENEVAL_METADATA)
    train = load_dataset("json", data_files=args.train_metadata, split="train")  # prompt, tag, include, exclude
    test = load_dataset("json", data_files=args.test_metadata, split="train") if args.test_metadata else None

    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=args.reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, **config),
        train_dataset=train,
        eval_dataset=test,
        peft_config=recipe.lora_config(),  # LoRA r 32 / alpha 64
    )
    trainer.train()
    trainer.save_model()  # StableDiffusion3Pipeline.load_lora_weights(output_dir)


if __name__ == "__main__":
    main()
