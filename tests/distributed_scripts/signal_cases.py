"""Worker of ``tests/test_interrupts.py`` for the signal cases ``interrupted_run.py`` does not cover; the run is
``interrupted_run.py``'s (4 optimizer steps of a tiny LoRA).

Run as ``python signal_cases.py MODEL WORK_DIR CASE [SIGNALLED]`` (one process, or under torchrun). ``CASE``:

- ``hung-reward``: the reward of step 3's rollout never returns (default ``reward_timeout``); it touches
  ``in_reward<rank>`` when it starts, and the test sends the signal then.
- ``second-signal``: the same reward, with ``reward_timeout=None`` (it runs in the trainer's thread and cannot be
  abandoned); it touches ``first_signal<rank>`` once the first signal is recorded, and the test sends a second one.
- ``straight``: trained to step 4 uninterrupted; ``weights<rank>.pt`` holds the trained weights.
- ``resumed``: waits after step 2 until a signal reaches the ranks ``SIGNALLED`` names (``all``, or one rank),
  stops as the trainer decides, then resumes in the same process from the checkpoint it names to step 4, and writes
  ``weights<rank>.pt``.

``done<rank>.json`` records how the (first) ``train()`` ended.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from interrupted_run import WaitForSignal, run_trainer

from trl_jagg.rewards import prompt_color
from trl_jagg.utils.errors import TrainingInterrupted

HANG_AT = 2
"""The reward hangs in the rollout of the step after optimizer step ``HANG_AT``."""


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def hanging_reward(work: Path, rank: int, trainer_ref: list):
    """prompt_color's scores, except for step 3's rollout, where the reward never returns."""
    score = prompt_color()

    def reward(prompts, images, trainer_state=None, **kwargs):
        if trainer_state is None or trainer_state.global_step != HANG_AT:
            return score(prompts, images)
        (work / f"in_reward{rank}").touch()
        while True:  # what a stuck server client or a deadlocked lock looks like from here
            if trainer_ref and trainer_ref[0].interrupts.signal_number is not None:
                (work / f"first_signal{rank}").touch()
            time.sleep(0.05)

    return reward


def train_once(trainer) -> dict:
    try:
        trainer.train()
        return {"interrupted": False, "global_step": trainer.state.global_step}
    except TrainingInterrupted as stop:
        return {"interrupted": True, "message": str(stop), "checkpoint": stop.checkpoint,
                "exit_code": stop.exit_code, "global_step": trainer.state.global_step}  # fmt: skip


def main(model_path: str, work_dir: str, case: str, signalled: str = "") -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    work = Path(work_dir)
    (work / f"pid{rank}").write_text(str(os.getpid()))  # under torchrun, the worker's own pid
    out = str(work / "out")
    if case in ("hung-reward", "second-signal"):
        trainer_ref: list = []
        overrides = {"reward_timeout": None} if case == "second-signal" else {}
        trainer = run_trainer(model_path, out, 4, reward=hanging_reward(work, rank, trainer_ref), **overrides)
        trainer_ref.append(trainer)
    else:
        trainer = run_trainer(model_path, out, 4)
    if case == "resumed":
        wait = WaitForSignal(trainer, work / f"ready{rank}", signalled=signalled in ("all", str(rank)))
        trainer.add_callback(wait)
    outcome = train_once(trainer)
    (work / f"done{rank}.json").write_text(json.dumps(outcome))
    if case == "resumed" and outcome["interrupted"]:
        trainer = run_trainer(model_path, out, 4)
        trainer.train(resume_from_checkpoint=outcome["checkpoint"])
    if case in ("straight", "resumed"):
        torch.save(trained_weights(trainer), work / f"weights{rank}.pt")
    sys.exit(0 if case == "resumed" else outcome.get("exit_code", 0))


if __name__ == "__main__":
    main(*sys.argv[1:])
