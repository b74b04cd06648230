"""Worker of ``tests/test_deepspeed.py`` (``accelerate launch --use_deepspeed --zero_stage N``, 2 CPU processes, gloo),
and the trainer setup the test's single-process reference shares with it.

One launch runs every setup of its ZeRO stage in sequence and writes ``report{rank}.json``:
- the degraded launch first: without ``ddp_backend="gloo"`` accelerate counts 1 process and the trainer refuses;
- per KIND (LoRA, full fine-tuning; KL on, so full fine-tuning runs its reference model): 4 straight training steps
  (a checkpoint and its EMA at every step; the engine's ``step`` calls counted), then a fresh trainer resumed from
  checkpoint-2 trains to 4; then, on the straight run's engine at its final weights, the gradients that reach the
  optimizer (``safe_get_full_grad`` inside the engine's step, learning rate 0) for each MODE on this rank's half of
  the micro-batch the test saved; and how the KL reference of full fine-tuning is laid out on this rank.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for testing_utils
from testing_utils import run_update  # noqa: E402

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]
KINDS = ("lora", "full")
MODES = {
    "jagg": {"use_jagg": True, "jagg_endpoint_backward": "joint"},
    "jagg-sequential": {"use_jagg": True, "jagg_endpoint_backward": "sequential"},
    "exact": {"use_jagg": False},
}
EMA_DECAY = 0.7


def build_trainer(model_path: str, output_dir: str, kind: str, *, world_size: int, **overrides) -> DDPOJaggTrainer:
    """The trainer of ``kind``; ``world_size`` processes share a micro-batch of 2 images, 2 per optimizer step."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 1} | overrides
    args = GRPOJaggConfig(
        output_dir=output_dir, per_device_train_batch_size=2 // world_size, gradient_accumulation_steps=2,
        num_generations=2, num_inference_steps=5, height=32, width=32, learning_rate=1e-2, epsilon=0.5,
        jagg_group_size=3, jagg_frac=1.0, beta=0.05, ema_decay=EMA_DECAY, ema_update_interval=1,
        max_sequence_length=16, report_to="none", disable_tqdm=True, seed=3,
        ddp_backend="gloo" if world_size > 1 else None, use_cpu=world_size == 1, **settings,
    )  # fmt: skip
    # init_lora_weights=False: both LoRA factors random, so every LoRA gradient is non-zero.
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"], init_lora_weights=False)
    return DDPOJaggTrainer(
        model=model_path, reward_funcs="prompt_color", args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=peft_config if kind == "lora" else None,
    )  # fmt: skip


def call_before_engine_step(engine: torch.nn.Module, before: Callable[[], None]) -> None:
    """Call ``before()`` at every ``engine.step`` (DeepSpeed's optimizer step, which accelerate's backward calls at
    an accumulation boundary), before it runs: the gradients are complete and not yet cleared."""
    step = engine.step

    def stepped(*args, **kwargs):
        before()
        return step(*args, **kwargs)

    engine.step = stepped


class EngineStepCounter(TrainerCallback):
    """The Trainer's global step at each engine step of ``trainer``'s run (the engine is built when `train` starts)."""

    def __init__(self, trainer: DDPOJaggTrainer):
        self.trainer = trainer
        self.steps: list[int] = []

    def on_train_begin(self, *args, **kwargs) -> None:
        call_before_engine_step(self.trainer.model_wrapped, lambda: self.steps.append(self.trainer.state.global_step))


def reference_layout(reference: torch.nn.Module | None) -> dict[str, list[int | None]] | None:
    """Per parameter of the full fine-tuning KL reference (after its forwards): ``[numel, partition, held whole]``,
    the elements of the weight, of this process's ZeRO-3 partition (``None`` outside ZeRO-3) and of the whole
    weight this process holds (0 while only the partition is)."""
    if reference is None:
        return None
    return {
        name: [int(getattr(p, "ds_numel", p.numel())), p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None,
               p.numel()]
        for name, p in reference.named_parameters()
    }  # fmt: skip


def set_mode(trainer: DDPOJaggTrainer, mode: str) -> None:
    for name, value in MODES[mode].items():
        setattr(trainer.args, name, value)


def main(model_path: str, work_dir: str) -> None:
    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState, PartialState
    from deepspeed.utils import safe_get_full_grad

    report: dict = {}
    # The degraded launch: accelerate's own backend detection finds no accelerator and counts 1 process per rank.
    try:
        DDPOJaggTrainer(
            model="never-loaded", reward_funcs="prompt_color", train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            args=GRPOJaggConfig(f"{work_dir}/degraded", per_device_train_batch_size=2, num_generations=2, report_to="none"),
        )  # fmt: skip
        report["degraded"] = "accepted"
    except RuntimeError as error:
        report["degraded"] = str(error)
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()

    for kind in KINDS:
        straight = build_trainer(model_path, f"{work_dir}/{kind}", kind, world_size=2)
        counter = EngineStepCounter(straight)
        straight.add_callback(counter)
        straight.train()
        rank, world = straight.accelerator.process_index, straight.accelerator.num_processes
        engine = straight.model_wrapped
        trained_steps = (list(counter.steps), engine.global_steps)
        resumed = build_trainer(model_path, f"{work_dir}/{kind}-resumed", kind, world_size=2)
        resumed.train(resume_from_checkpoint=f"{work_dir}/{kind}/checkpoint-2")

        # The gradients reaching the optimizer, at the straight run's final weights, without moving them.
        for group in engine.optimizer.param_groups:
            group["lr"] = 0.0
        local = torch.load(f"{work_dir}/{kind}_batch.pt", weights_only=False).split(world)[rank]
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
        seen: list[dict[str, torch.Tensor]] = []
        record = lambda seen=seen, named=named: seen.append({n: safe_get_full_grad(p).clone() for n, p in named})  # noqa: E731
        call_before_engine_step(engine, record)
        grads = {}
        for mode in MODES:
            set_mode(straight, mode)
            seen.clear()
            straight.accelerator.gradient_state._set_sync_gradients(True)  # an accumulation boundary
            run_update(straight, engine, local)
            assert len(seen) == 1, f"{mode}: {len(seen)} engine steps for one micro-batch"
            grads[mode] = seen[0]
        if rank == 0:
            torch.save(grads, f"{work_dir}/{kind}_grads_2proc.pt")
        report[kind] = {
            "world": world,
            "distributed_type": str(straight.accelerator.distributed_type),
            "zero_stage": engine.zero_optimization_stage(),
            "engine_steps": trained_steps[0],  # the Trainer's global step at each engine step
            "engine_global_steps": trained_steps[1],
            "global_step": straight.state.global_step,
            "resumed_global_step": resumed.state.global_step,
            "num_trainable": len(named),
            "reference": reference_layout(straight.ref_transformer),
        }
        del straight, resumed, engine
    with open(f"{work_dir}/report{rank}.json", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
