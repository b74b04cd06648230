"""Worker of ``tests/test_distributed.py::test_fsdp2_plugin_path_on_two_processes``, started by
``accelerate launch --config_file examples/accelerate_configs/fsdp2.yaml --num_processes 2`` (2 CPU processes, gloo).

accelerate turns its FSDP plugin on only for its multi-accelerator types (``accelerate/state.py``, the
``DistributedType.MULTI_GPU, ...`` branch that reads ``ACCELERATE_USE_FSDP``), never for ``MULTI_CPU``, so on CPU the
plugin is silently dropped. Here the CPU state is relabelled ``MULTI_GPU`` before the trainer creates its
``Accelerator``: then accelerate's own FSDP2 code runs unchanged on CPU, from the plugin the launcher built out of the
shipped YAML (its ``FSDP_*`` variables) to ``fsdp2_prepare_model``, which shards the backbone inside ``train()``,
and ``get_state_dict`` at every save. Nothing else of the state changes (the device stays the CPU).

With the trainer setup of ``fsdp_trainer.py`` (EMA on, the trainer's own sharding off):
- ``lora``: 4 steps with checkpoints at 2 and 4, then the saved weights and ``ema/`` beside the full tensors gathered
  here with ``DTensor.full_tensor``; a fresh trainer resumes from ``checkpoint-2`` for steps 3-4 and saves;
- ``full``: the Trainer's own preparation (accelerate shards model and optimizer), then 2 updates on this rank's
  half of the test's batch, each an optimizer step and an EMA update, and a save (weights and ``ema/``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FSDPModule

EMA = {"ema_decay": 0.9, "ema_warmup": False, "fully_shard_backbone": False}
# Plain SGD for the full fine-tuning comparison: AdamW's first steps, about lr * sign(g), would turn the float32
# rounding differences of near-zero gradients into weight differences above the tolerance.
FULL = EMA | {"optim": "sgd", "learning_rate": 1.0}
# The relabelled state below, kept by the training arguments (which otherwise reset it).
CONFIGURED = {"accelerator_config": {"use_configured_state": True}}


def full_tensors(trainer) -> dict[str, torch.Tensor]:
    """The trainable weights gathered whole (a collective), without the trainer's save path."""
    return {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def wrapped_blocks(model: torch.nn.Module) -> dict[str, int]:
    """How many modules of each class the launcher named (``FSDP_TRANSFORMER_CLS_TO_WRAP``) are FSDP units."""
    names = os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return {name: sum(name in {c.__name__ for c in type(m).__mro__} for m in units) for name in names}


def main(model_path: str, work_dir: str) -> None:
    from fsdp_trainer import build_trainer  # beside this script (the test imports this module by path)

    torch.set_num_threads(1)
    state = PartialState(cpu=True, backend="gloo")  # what GRPOJaggConfig(use_cpu=True, ddp_backend="gloo") creates
    cpu_type = str(state.distributed_type)
    state.distributed_type = DistributedType.MULTI_GPU  # see the module docstring
    report = {"cpu_type": cpu_type}

    trainer = build_trainer(model_path, f"{work_dir}/lora", "lora", world_size=2, max_steps=4, save_strategy="steps",
                            save_steps=2, **EMA, **CONFIGURED)  # fmt: skip
    rank = trainer.accelerator.process_index
    report.update(world=trainer.accelerator.num_processes, plugin=trainer.accelerator.is_fsdp2,
                  sharded_before_train=isinstance(trainer.model, FSDPModule))  # fmt: skip
    trainer.train()
    report.update(sharded=isinstance(trainer.model, FSDPModule), wrapped_blocks=wrapped_blocks(trainer.model))
    weights, ema = full_tensors(trainer), trainer.ema.full_weights()
    trainer.save_model(f"{work_dir}/lora_saved")
    if rank == 0:
        torch.save({"weights": weights, "ema": dict(zip(weights, ema))}, f"{work_dir}/lora_full.pt")
    resumed = build_trainer(
        model_path, f"{work_dir}/lora-resumed", "lora", world_size=2, max_steps=4, **EMA, **CONFIGURED
    )
    resumed.train(resume_from_checkpoint=f"{work_dir}/lora/checkpoint-2")
    resumed.save_model(f"{work_dir}/lora_resumed")

    trainer = build_trainer(model_path, f"{work_dir}/full", "full", world_size=2, **FULL, **CONFIGURED)
    model, _ = trainer._prepare_for_training(2, trainer.get_train_dataloader(), None)
    report["full_sharded"] = isinstance(model, FSDPModule) and trainer.ref_transformer is not None
    local = torch.load(f"{work_dir}/full_batch.pt", weights_only=False).split(2)[rank]
    for step in range(2):
        trainer.update_stage.run(model, local, micro_step=step, global_step=step, accumulation_steps=1)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.state.global_step = step + 1
        trainer.ema.update_at(step + 1)
    trainer.save_model(f"{work_dir}/full_saved")
    json.dump(report, open(f"{work_dir}/report{rank}.json", "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
