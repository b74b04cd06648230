"""Worker of ``tests/test_distributed.py::test_nft_with_the_backbone_sharded_on_two_processes`` (torchrun, 2 CPU
processes): DiffusionNFT (``objective="nft"``) with the LoRA backbone sharded by FSDP2 (``fully_shard_backbone``).

An uninterrupted run of 3 optimizer steps saves a checkpoint after each; a callback writes the whole trainable
weights (torch's ``full_tensor``, in the trainer's parameter order) at the start and after each step. A second run
resumes from ``checkpoint-2`` and saves ``checkpoint-3`` too. Each rank reports the shapes of its old-policy parts
against the whole weights'."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import save_file
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]


def redness(prompts, images, **kwargs):
    """Mean red minus the mean of the other channels (as tests/testing_utils.py's)."""
    pixels = [np.asarray(image, dtype=np.float32) / 255.0 for image in images]
    return [float(a[..., 0].mean() - a[..., 1:].mean()) for a in pixels]


class WholeWeights(TrainerCallback):
    """Writes the whole trainable weights (``w{t}.safetensors``, t = optimizer steps taken) from rank 0."""

    def __init__(self, trainer: DDPOJaggTrainer, folder: str):
        self.trainer, self.folder = trainer, folder

    def _write(self, step: int) -> None:
        weights = {
            str(i): p.full_tensor().detach().clone() for i, p in enumerate(self.trainer._trainable_parameters())
        }
        if self.trainer.accelerator.is_main_process:
            save_file(weights, f"{self.folder}/w{step}.safetensors")

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._write(state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._write(state.global_step)


def build(output_dir: str) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    args = GRPOJaggConfig(
        output_dir=output_dir, objective="nft", per_device_train_batch_size=2, num_generations=2,
        num_inference_steps=5, height=32, width=32, max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant",
        max_sequence_length=16, report_to="none", save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True,
        train_timestep_fraction=0.8, jagg_group_size=2, jagg_frac=1.0, beta=1e-4, nft_decay_type=1,
        fully_shard_backbone=True, use_cpu=True,
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=sys.argv[2], reward_funcs=redness, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


def main(work_dir: str, model_path: str) -> None:
    torch.set_num_threads(1)
    whole = build(f"{work_dir}/whole")
    whole.add_callback(WholeWeights(whole, work_dir))
    whole.train()
    rank = whole.accelerator.process_index
    parts = [tuple(w.shape) for w in whole.old_policy.weights]
    shapes = [tuple(p.shape) for p in whole._trainable_parameters()]
    resumed = build(f"{work_dir}/resumed")
    resumed.train(resume_from_checkpoint=f"{work_dir}/whole/checkpoint-2")
    with open(f"{work_dir}/nft{rank}.json", "w") as f:
        json.dump({"old_policy_parts": parts, "whole_shapes": shapes, "followed": resumed.old_policy.followed_step}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
