"""Flow-GRPO's GenEval recipe on Stable Diffusion 3.5 Medium (LoRA) with the GenEval-style reward, JAGG in the update.

The `flow-grpo-sd35-geneval` preset (trl_jagg/recipes/, docs/models.md), Flow-GRPO's geneval_sd3 config: 512 px,
10 steps, CFG 4.5, SDE a = 0.7, G = 24, LoRA r 32 / alpha 64, lr 3e-4, KL beta 0.04, every step but the last
trained (two JAGG groups of W = 4 and one exact step). The prompts are Flow-GRPO's dataset/geneval
train_metadata.jsonl: each line's prompt, tag, include and exclude become dataset columns, and the reward reads the
last three. `geneval` runs GenEval's rules on OWLv2 detections and CLIP colours in process; Flow-GRPO's reward is
GenEval's Mask2Former pipeline: serve that with examples/flow_grpo_sidecar.py and pass its URL as --reward_funcs.

    accelerate launch --num_processes 8 examples/train_sd35_geneval.py --output_dir sd35-geneval \\
        --dataset_name flow_grpo/dataset/geneval/train_metadata.jsonl \\
        --eval_dataset_name flow_grpo/dataset/geneval/test_metadata.jsonl
    python examples/train_sd35_geneval.py --tiny --output_dir /tmp/sd35-geneval-tiny   # CPU smoke test, seconds
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from trl_jagg.scripts.examples import Example, ExampleArguments

if TYPE_CHECKING:  # the heavy modules are imported where they are used: --help answers before them
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.testing.tiny_models import TinyRun


class GenEvalExample(Example):
    def tiny_setup(self, args: ExampleArguments, config: GRPOJaggConfig) -> TinyRun:
        """The tiny SD3, the geneval reward's real code on tiny random OWLv2 + CLIP, GenEval-style metadata."""
        from datasets import load_dataset

        from trl_jagg.testing.tiny_models import temporary_folder
        from trl_jagg.testing.tiny_rewards import TINY_GENEVAL_METADATA, save_tiny_geneval_models

        folder = temporary_folder("tiny-geneval-")  # removed at exit
        detector_dir, clip_dir = save_tiny_geneval_models(folder)
        # Random logits put most boxes near 0.5: a higher threshold keeps the counts small and varied.
        config.reward_kwargs = {"geneval": {"detector_id": detector_dir, "clip_id": clip_dir, "threshold": 0.6,
                                            "counting_threshold": 0.6}}  # fmt: skip
        metadata = os.path.join(folder, "train_metadata.jsonl")
        with open(metadata, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in TINY_GENEVAL_METADATA)
        dataset = load_dataset("json", data_files=metadata, split="train")  # prompt, tag, include, exclude
        return replace(super().tiny_setup(args, config), reward="geneval", dataset=dataset)


EXAMPLE = GenEvalExample(
    __file__,
    recipe="flow-grpo-sd35-geneval",
    model="stabilityai/stable-diffusion-3.5-medium",
    reward_funcs=["geneval"],  # or the sidecar's URL (.../score/geneval): --reward_funcs URL
    tiny="sd3",
    output_dir="sd35-geneval",
    dataset="dataset/geneval/train_metadata.jsonl",  # GenEval's jsonl: prompt, tag, include, exclude
    prompt_column="prompt",
    values={"save_steps": 120, "eval_steps": 120},  # Flow-GRPO evaluates every 60 epochs of 2 optimizer steps
)  # StableDiffusion3Pipeline.load_lora_weights(output_dir)

if __name__ == "__main__":
    EXAMPLE.main()
