"""Worker of ``tests/test_interrupts.py``: a tiny LoRA run of 4 optimizer steps that waits, after step 2, until a
signal reaches ``signal_rank`` (the test sends it once ``ready<rank>`` exists), then goes on as the trainer decides.

Run as ``python interrupted_run.py MODEL OUT_DIR SIGNAL_RANK`` (one process) or under torchrun (every rank waits for
the agreement the trainer makes after each optimizer step). ``done<rank>.json`` records how ``train()`` ended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.rewards import prompt_color
from trl_jagg.utils.errors import TrainingInterrupted

PROMPTS = ["a red circle", "a blue square", "a green circle", "a red square"]


def run_config(output_dir: str, max_steps: int, **overrides: Any) -> GRPOJaggConfig:
    """The run both the worker and the test's uninterrupted reference train (``overrides``: settings that do not
    change what it trains, e.g. ``reward_timeout``, ``save_steps``)."""
    return GRPOJaggConfig(
        output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, num_inference_steps=4, height=32,
        width=32, max_steps=max_steps, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=16, report_to="none", seed=0, disable_tqdm=True,
        **{"save_strategy": "steps", "save_steps": 100, **overrides},
    )  # fmt: skip


def run_trainer(
    model_path: str, output_dir: str, max_steps: int, reward: Callable[..., Any] | None = None, **overrides: Any
) -> DDPOJaggTrainer:
    """The run's trainer; ``reward`` (default: prompt_color's scores) must score as prompt_color does."""
    torch.manual_seed(0)
    score = prompt_color()
    return DDPOJaggTrainer(
        model=model_path, reward_funcs=reward or (lambda prompts, images, **kw: score(prompts, images)),
        args=run_config(output_dir, max_steps, **overrides), train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


class WaitForSignal(TrainerCallback):
    """After optimizer step 2, says it is ready and waits (at most 120 s) until the signal has reached this
    process, on the rank that is sent one."""

    def __init__(self, trainer: DDPOJaggTrainer, ready: Path, signalled: bool):
        self.trainer, self.ready, self.signalled = trainer, ready, signalled

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2:
            return
        self.ready.touch()
        deadline = time.monotonic() + 120
        while self.signalled and self.trainer.interrupts.signal_number is None and time.monotonic() < deadline:
            time.sleep(0.05)


def main(model_path: str, work_dir: str, signal_rank: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    work = Path(work_dir)
    (work / f"pid{rank}").write_text(str(os.getpid()))  # under torchrun, the worker's own pid (not the launcher's)
    trainer = run_trainer(model_path, str(work / "out"), max_steps=4)
    trainer.add_callback(WaitForSignal(trainer, work / f"ready{rank}", signalled=rank == int(signal_rank)))
    try:
        trainer.train()
        outcome = {"interrupted": False, "global_step": trainer.state.global_step}
    except TrainingInterrupted as stop:
        outcome = {"interrupted": True, "message": str(stop), "checkpoint": stop.checkpoint,
                   "exit_code": stop.exit_code, "global_step": trainer.state.global_step}  # fmt: skip
    (work / f"done{rank}.json").write_text(json.dumps(outcome))
    sys.exit(outcome.get("exit_code", 0))


if __name__ == "__main__":
    main(*sys.argv[1:])
