"""Worker of the DiffusionNFT tests with sharded weights (2 CPU processes, gloo), the LoRA backbone sharded by
``BACKEND``:
- ``fsdp2``: the trainer's own FSDP2 (``fully_shard_backbone``, at init), under torchrun (``tests/test_distributed.py``);
- ``fsdp2-plugin``: accelerate's FSDP2 plugin from the shipped ``fsdp2.yaml`` (in ``train()``, after the old policy
  was copied whole), the CPU state relabelled as ``fsdp2_plugin.py`` explains (``tests/test_distributed.py``);
- ``zero3``: DeepSpeed ZeRO-3 (in ``train()``), under ``accelerate launch --use_deepspeed --zero_stage 3``
  (``tests/test_deepspeed.py``).

An uninterrupted run of 3 optimizer steps saves a checkpoint after each; a callback writes the whole trainable
weights (torch's ``full_tensor``, DeepSpeed's ``GatheredParameters``; in the trainer's parameter order) at the start
and after each step. A second run resumes from ``checkpoint-2`` and saves ``checkpoint-3`` too. Each rank reports
the shapes of its old-policy parts against the whole weights'."""

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
BACKENDS = {
    "fsdp2": {"fully_shard_backbone": True, "use_cpu": True},
    "fsdp2-plugin": {"use_cpu": True, "accelerator_config": {"use_configured_state": True}},
    "zero3": {"ddp_backend": "gloo"},
}
"""The configuration of each sharding backend (besides what its launcher sets)."""


def redness(prompts, images, **kwargs):
    """Mean red minus the mean of the other channels (as tests/testing_utils.py's)."""
    pixels = [np.asarray(image, dtype=np.float32) / 255.0 for image in images]
    return [float(a[..., 0].mean() - a[..., 1:].mean()) for a in pixels]


class WholeWeights(TrainerCallback):
    """Writes the whole trainable weights (``w{t}.safetensors``, t = optimizer steps taken) from rank 0."""

    def __init__(self, trainer: DDPOJaggTrainer, folder: str):
        self.trainer, self.folder = trainer, folder

    def _write(self, step: int) -> None:
        params = self.trainer._trainable_parameters()
        if hasattr(params[0], "ds_tensor"):  # ZeRO-3: every process joins the gather
            import deepspeed

            with deepspeed.zero.GatheredParameters(params):
                weights = {str(i): p.detach().clone() for i, p in enumerate(params)}
        else:
            weights = {str(i): p.full_tensor().detach().clone() for i, p in enumerate(params)}
        if self.trainer.accelerator.is_main_process:
            save_file(weights, f"{self.folder}/w{step}.safetensors")

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._write(state.global_step)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._write(state.global_step)


def build(output_dir: str, model_path: str, backend: str) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    args = GRPOJaggConfig(
        output_dir=output_dir, objective="nft", per_device_train_batch_size=2, num_generations=2,
        num_inference_steps=5, height=32, width=32, max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant",
        max_sequence_length=16, report_to="none", save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True,
        train_timestep_fraction=0.8, jagg_group_size=2, jagg_frac=1.0, beta=1e-4, nft_decay_type=1,
        **BACKENDS[backend],
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=model_path, reward_funcs=redness, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


def main(work_dir: str, model_path: str, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "fsdp2-plugin":  # accelerate's FSDP2 code on the CPU (see fsdp2_plugin.py's docstring)
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType

        PartialState(cpu=True, backend="gloo").distributed_type = DistributedType.MULTI_GPU
    whole = build(f"{work_dir}/whole", model_path, backend)
    whole.add_callback(WholeWeights(whole, work_dir))
    whole.train()
    rank = whole.accelerator.process_index
    parts = [tuple(w.shape) for w in whole.update_stage.old_policy.weights]
    shapes = [list(getattr(p, "ds_shape", p.shape)) for p in whole._trainable_parameters()]
    resumed = build(f"{work_dir}/resumed", model_path, backend)
    resumed.train(resume_from_checkpoint=f"{work_dir}/whole/checkpoint-2")
    with open(f"{work_dir}/nft{rank}.json", "w") as f:
        json.dump(
            {
                "old_policy_parts": parts,
                "whole_shapes": shapes,
                "followed": resumed.update_stage.old_policy.followed_step,
            },
            f,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
