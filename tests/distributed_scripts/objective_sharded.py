"""Worker of the AWM / DGPO tests on 2 CPU processes (gloo, under torchrun): ``OBJECTIVE`` trained with DDP or with
the LoRA backbone sharded by FSDP2 (``fully_shard_backbone``).

An uninterrupted run of 3 optimizer steps saves a checkpoint after each; a second run resumes from
``checkpoint-2``. Rank 0 writes both runs' whole trainable weights (``whole.safetensors``, ``resumed.safetensors``);
every rank writes the whole weights of its objective state (the AWM KL-EMA, the DGPO old policy) after each run."""

from __future__ import annotations

import sys

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig
from safetensors.torch import save_file

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]
BACKENDS = {"ddp": {"use_cpu": True}, "fsdp2": {"fully_shard_backbone": True, "use_cpu": True}}
OBJECTIVES = {
    "awm": {"awm_num_train_timesteps": 4, "awm_ema_kl_beta": 0.5},
    "dgpo": {"dgpo_trunc_steps": 3, "dgpo_num_train_timesteps": 4, "epsilon": 0.05, "dgpo_sample_old_policy_after": 1},
}
"""The objective's settings: 4 trained timesteps of 5, two W = 2 JAGG groups; DGPO's old policy samples from step 1."""


def redness(prompts, images, **kwargs):
    """Mean red minus the mean of the other channels (as tests/testing_utils.py's)."""
    pixels = [np.asarray(image, dtype=np.float32) / 255.0 for image in images]
    return [float(a[..., 0].mean() - a[..., 1:].mean()) for a in pixels]


def build(output_dir: str, model_path: str, objective: str, backend: str) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    args = GRPOJaggConfig(
        output_dir=output_dir, objective=objective, per_device_train_batch_size=2, num_generations=2,
        num_inference_steps=5, height=32, width=32, max_steps=3, learning_rate=1e-2, lr_scheduler_type="constant",
        max_sequence_length=16, report_to="none", save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True,
        use_jagg=True, jagg_group_size=2, jagg_frac=1.0, beta=1e-4, **OBJECTIVES[objective], **BACKENDS[backend],
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=model_path, reward_funcs=redness, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


def whole_weights(trainer: DDPOJaggTrainer) -> dict[str, torch.Tensor]:
    """The trainable weights whole (every process joins FSDP2's gathers)."""
    params = trainer._trainable_parameters()
    return {
        str(i): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for i, p in enumerate(params)
    }


def state_of(trainer: DDPOJaggTrainer) -> list[torch.Tensor]:
    stage = trainer.update_stage
    return (stage.kl_ema if hasattr(stage, "kl_ema") else stage.old_policy).weights


def main(work_dir: str, model_path: str, objective: str, backend: str) -> None:
    torch.set_num_threads(1)
    runs = {}
    for name, resume in (("whole", None), ("resumed", f"{work_dir}/whole/checkpoint-2")):
        trainer = build(
            f"{work_dir}/{name}" if resume is None else f"{work_dir}/resumed", model_path, objective, backend
        )
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = whole_weights(trainer)
        rank = trainer.accelerator.process_index
        save_file(
            {str(i): w.contiguous() for i, w in enumerate(state_of(trainer))},
            f"{work_dir}/{name}_state{rank}.safetensors",
        )
        if trainer.accelerator.is_main_process:
            save_file(runs[name], f"{work_dir}/{name}.safetensors")


if __name__ == "__main__":
    main(*sys.argv[1:])
