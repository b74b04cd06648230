"""Worker of ``tests/test_distributed.py::test_trainer_gradients_on_two_processes`` (run under torchrun, 2 CPU
processes), and the trainer setup the test's single-process reference shares with it.

Each rank builds the trainer of each KIND, computes the JAGG and the exact gradient of its half of the rollout the
test saved, and gathers the full gradients:
- ``lora`` / ``full``: ``fully_shard_backbone=True`` (KL on, so the reference runs under FSDP too); then two real
  training steps with a checkpoint after the first (gathered weights and optimizer state), the weights saved and an
  image rendered; a fresh sharded trainer resumes from the checkpoint and saves its weights after the second step;
- ``ddp-sequential``: LoRA under DDP with ``jagg_endpoint_backward="sequential"`` (the first endpoint's backward
  inside ``no_sync``);
- ``wan22-both``: Wan2.2 A14B's two experts, both trained (LoRA) under DDP: the high-noise expert's backward calls
  run inside ``no_sync``, the synced last one reaches the low-noise expert only.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]
RENDER_PROMPT = "a green circle"
KINDS = {
    "lora": {"lora": True, "shard": True},
    "full": {"lora": False, "shard": True},
    "ddp-sequential": {"lora": True, "shard": False, "jagg_endpoint_backward": "sequential"},
    # Flow-Factory's scales (CFG 4, then 3 on the low-noise expert), 5 frames; of 7 steps the first 3 are the
    # high-noise expert's, so the W = 3 groups are steps 0-2 and 3-5, one expert each.
    "wan22-both": {"lora": True, "shard": False, "model": "wan22", "num_frames": 5, "guidance_scale": 4.0,
                   "guidance_scale_2": 3.0, "negative_prompt": "dark", "num_inference_steps": 7},
}  # fmt: skip
MODELS = ("flux", "wan22")
"""The tiny pipelines the kinds train (``"model"``, Flux when unset), in the order the script takes their paths."""


def build_trainer(model_path: str, output_dir: str, kind: str, *, world_size: int, **overrides) -> DDPOJaggTrainer:
    """The trainer of ``kind`` both sides use; ``world_size`` processes share the same global batch of 4 images."""
    settings = dict(KINDS[kind])
    lora, shard = settings.pop("lora"), settings.pop("shard")
    settings.pop("model", None)
    defaults = {
        "max_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-2,
        "fully_shard_backbone": shard and world_size > 1,
        "num_inference_steps": 5,
    }
    settings = defaults | settings | overrides
    args = GRPOJaggConfig(
        output_dir=output_dir, per_device_train_batch_size=4 // world_size, num_generations=2,
        height=32, width=32, epsilon=0.1, jagg_group_size=3, jagg_frac=1.0, beta=0.05,
        max_sequence_length=16, report_to="none", use_cpu=True, disable_tqdm=True,
        seed=3, **settings,
    )  # fmt: skip
    # init_lora_weights=False: both LoRA factors random, so every LoRA gradient is non-zero.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False)
    return DDPOJaggTrainer(
        model=model_path, reward_funcs="prompt_color", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config if lora else None,
    )  # fmt: skip


def gradients(trainer: DDPOJaggTrainer, batch: dict, *, use_jagg: bool, model=None) -> dict[str, torch.Tensor]:
    """Full (gathered) gradients of one update on ``batch``, from zero; ``model`` is the wrapped model (DDP)."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.args.use_jagg = use_jagg
    trainer.update_stage.run(
        model if model is not None else trainer.model, batch, micro_step=trainer._step,
        global_step=trainer.state.global_step, accumulation_steps=trainer.current_gradient_accumulation_steps,
    )  # fmt: skip
    trainer.args.use_jagg = True
    grads = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            grad = p.grad
            grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    trainer.model.zero_grad(set_to_none=True)
    return grads


def main(work_dir: str, *model_paths: str) -> None:
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor

    report = {}
    for kind in KINDS:
        steps = {"max_steps": 2, "save_strategy": "steps", "save_steps": 1} if KINDS[kind]["shard"] else {}
        model_path = dict(zip(MODELS, model_paths))[KINDS[kind].get("model", "flux")]
        trainer = build_trainer(model_path, f"{work_dir}/{kind}", kind, world_size=2, **steps)
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        batch = torch.load(f"{work_dir}/{kind}_batch.pt", weights_only=False)
        local = batch.split(world)[rank]
        # DDP: the wrapper the Trainer's accelerator.prepare would build; FSDP2: the sharded module itself.
        model = trainer.model if KINDS[kind]["shard"] else trainer.accelerator.prepare_model(trainer.model)
        assert KINDS[kind]["shard"] or isinstance(model, torch.nn.parallel.DistributedDataParallel)
        grads = {mode: gradients(trainer, local, use_jagg=mode == "jagg", model=model) for mode in ("jagg", "exact")}
        if rank == 0:
            torch.save(grads, f"{work_dir}/{kind}_grads_2proc.pt")
        if KINDS[kind]["shard"]:
            trainer.train()  # 2 real steps (sharded rollout, update, clipping, optimizer step), a checkpoint at 1
            trainer.save_model(f"{work_dir}/{kind}_saved")
            image = np.asarray(trainer.sample_images([RENDER_PROMPT], seed=0)[0])
            if rank == 0:
                np.save(f"{work_dir}/{kind}_image.npy", image)
            resumed = build_trainer(model_path, f"{work_dir}/{kind}-resumed", kind, world_size=2, max_steps=2)
            resumed.train(resume_from_checkpoint=f"{work_dir}/{kind}/checkpoint-1")
            resumed.save_model(f"{work_dir}/{kind}_resumed")
        report[kind] = {
            "world": world,
            "sharded": all(isinstance(p, DTensor) for p in trainable) == KINDS[kind]["shard"],
            "num_trainable": len(trainable),
            "find_unused_parameters": getattr(model, "find_unused_parameters", None),
            "reference_sharded": trainer.ref_transformer is None
            or all(isinstance(p, DTensor) for p in trainer.ref_transformer.parameters()),
        }
    json.dump(report, open(f"{work_dir}/report{rank}.json", "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
