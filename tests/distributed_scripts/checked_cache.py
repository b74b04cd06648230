"""Worker of ``tests/test_distributed.py::test_checked_velocity_cache_agrees_across_sharded_processes`` (torchrun,
2 CPU processes): the sharded LoRA trainer of ``fsdp_trainer.py`` trains one rollout in two optimizer steps, so the
second update's cached velocities are the old policy's and ``jagg_cache_mode="checked"`` checks them.

The ranks are made to disagree: rank 1 adds 1 to its sensitivity before the agreement, so on its own it would
recompute (above the tolerance 0.5) while rank 0 would keep the correction. Each rank records, per check, the
sensitivity it brought and the one all ranks agreed on, and per update what the engine did."""

from __future__ import annotations

import json
import sys

import torch
from fsdp_trainer import build_trainer


def main(work_dir: str, model_path: str) -> None:
    torch.set_num_threads(1)
    trainer = build_trainer(
        model_path, f"{work_dir}/run", "lora", world_size=2, max_steps=2, steps_per_generation=2,
        jagg_cache_mode="checked", jagg_cache_tolerance=0.5,
    )  # fmt: skip
    rank = trainer.accelerator.process_index
    stage, checks, updates = trainer.update_stage, [], []
    agree, run = stage.largest_over_processes, stage.run

    def recorded_agree(value: float) -> float:
        local = value + rank  # rank 1 above the tolerance, rank 0 (about 1e-3) below it
        agreed = agree(local)
        checks.append({"local": local, "agreed": agreed})
        return agreed

    def recorded_run(*args, **kwargs):
        result = run(*args, **kwargs)
        updates.append({"rejected": result.num_rejected, "corrected": result.num_corrected,
                        "no_grad_forwards": result.num_no_grad_forwards})  # fmt: skip
        return result

    stage.largest_over_processes, stage.run = recorded_agree, recorded_run
    trainer.train()
    sharded = all(
        isinstance(p, torch.distributed.tensor.DTensor) for p in trainer.model.parameters() if p.requires_grad
    )
    with open(f"{work_dir}/checked{rank}.json", "w") as f:
        json.dump({"checks": checks, "updates": updates, "sharded": sharded}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
