"""Worker of ``tests/test_multinode.py``: one process per "node" of a 2-node job on one host (torchrun or
``accelerate launch`` with ``--nnodes 2`` / ``--num_machines 2``), a tiny LoRA run of 4 optimizer steps saving
``checkpoint-2`` and ``checkpoint-4``, under DDP or the trainer's FSDP2 (``fully_shard_backbone``).

``python multinode_run.py MODEL WORK BACKEND kill VICTIM_RANK``: trains ``WORK/straight`` to step 4, then
``WORK/run``, where the process of rank ``VICTIM_RANK`` writes its pid to ``WORK/victim`` in the update of optimizer
step 3 (its first forward with gradients) and waits there for the test's SIGKILL; the survivor's ``train()`` raises
``PeerLost``, recorded in ``WORK/survivor<rank>.json`` (with the time it was caught), printed on one line; exit 1.

``python multinode_run.py MODEL WORK BACKEND resume CHECKPOINT``: resumes ``WORK/run`` from ``CHECKPOINT`` to step 4
and saves the final weights there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.utils.errors import PeerLost

BACKENDS = {"ddp": {}, "fsdp2": {"fully_shard_backbone": True}}


def make_trainer(model_path: str, output_dir: str, backend: str) -> DDPOJaggTrainer:
    """The run every launch trains (the backend's settings besides); seeded, so that two runs draw alike."""
    torch.manual_seed(0)
    args = GRPOJaggConfig(
        output_dir=output_dir, per_device_train_batch_size=2, num_generations=2, num_inference_steps=3, height=32,
        width=32, max_steps=4, learning_rate=1e-2, epsilon=0.1, jagg_group_size=2, jagg_frac=1.0,
        max_sequence_length=16, report_to="none", save_strategy="steps", save_steps=2, seed=3, use_cpu=True,
        disable_tqdm=True, ddp_timeout=120, **BACKENDS[backend],
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=model_path, reward_funcs="prompt_color", args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


def wait_to_be_killed_in_step_3(trainer: DDPOJaggTrainer, victim_file: Path) -> None:
    """From the first forward with gradients of optimizer step 3 (the update, after the rollout), say so with this
    process's pid and wait (at most 120 s) for the SIGKILL; the other process waits meanwhile in a collective."""

    def hook(module, inputs):
        if trainer.state.global_step == 2 and torch.is_grad_enabled():
            victim_file.write_text(str(os.getpid()))
            time.sleep(120)

    trainer.model.register_forward_pre_hook(hook)


def main(model_path: str, work_dir: str, backend: str, mode: str, argument: str) -> None:
    torch.set_num_threads(1)
    work, rank = Path(work_dir), int(os.environ["RANK"])
    if mode == "resume":
        trainer = make_trainer(model_path, str(work / "run"), backend)
        trainer.train(resume_from_checkpoint=argument)
        trainer.save_model()
        return
    straight = make_trainer(model_path, str(work / "straight"), backend)
    straight.train()
    straight.save_model()
    trainer = make_trainer(model_path, str(work / "run"), backend)
    victim = int(argument)
    if rank == victim:
        wait_to_be_killed_in_step_3(trainer, work / "victim")
    try:
        trainer.train()
    except PeerLost as error:
        caught = time.time()
        record = {"message": str(error), "ranks": error.ranks, "nodes": error.nodes, "caught": caught}
        (work / f"survivor{rank}.json").write_text(json.dumps(record))
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    sys.exit(f"rank {rank}: train() returned although rank {victim} was killed")


if __name__ == "__main__":
    main(*sys.argv[1:])
