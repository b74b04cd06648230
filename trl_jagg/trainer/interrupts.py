"""Ctrl-C and preemption: SIGINT / SIGTERM stop the run after the optimizer step in progress, with a checkpoint.

Schedulers send SIGTERM before they kill a job (Slurm's ``--signal``, Kubernetes' ``terminationGracePeriodSeconds``,
spot-instance notices), and Ctrl-C sends SIGINT. Without a handler both lose every step since the last save. With
:class:`InterruptCallback` the first signal is only recorded: the step in progress finishes (its rollout, rewards and
optimizer step: the state is consistent only between optimizer steps), the trainer saves ``checkpoint-<step>`` and
stops, and ``train()`` raises :class:`~trl_jagg.utils.errors.TrainingInterrupted`, which names the checkpoint and the
resume. A reward still scoring when the signal arrives is abandoned, as at its deadline
(:func:`~trl_jagg.rewards.calling.abandon_rewards_in_flight`): the rollout it scores is dropped, the steps trained
before it are saved, and ``train()`` raises the same error. A second signal gets the previous handler at once (SIGINT: ``KeyboardInterrupt``; SIGTERM: the process
ends). Under several processes the processes agree after every optimizer step on whether any of them was signalled
(one gather of one number, through accelerate), so a signal to one process and a signal to all end alike: one checkpoint, saved
by every rank.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl_jagg.rewards.calling import abandon_rewards_in_flight
from trl_jagg.trainer.guards import largest_over_processes
from trl_jagg.utils.errors import TrainingInterrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class InterruptCallback(TrainerCallback):
    """Records the first SIGINT / SIGTERM during ``train()`` and turns it into a save and a stop at the next
    optimizer step's end; ``signal_number`` is the signal that stopped the run (``None``: none did).

    Handlers are installed only from the main thread (Python delivers signals there; a ``train()`` run in another
    thread keeps the process's own handlers) and restored when training ends.
    """

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.signal_number: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_number is not None:  # the second signal: what would have happened without us
            self.restore()
            signal.raise_signal(signum)
            return
        self.signal_number = signum
        abandon_rewards_in_flight(signum)
        print(
            f"Received {signal.Signals(signum).name}: stopping after the optimizer step in progress (a reward still "
            "scoring is abandoned) and saving a checkpoint (send it again to stop at once).",
            flush=True,
        )

    def restore(self) -> None:
        """Put back the handlers that were installed before ``train()`` (also when training raised)."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.signal_number = None
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Every process stops at the same step, and saves: the largest signal number over them (0: none).
        received = int(largest_over_processes(self.accelerator, self.signal_number or 0))
        if received:
            self.signal_number = received
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.restore()


RESUME = (
    "Resume with `trainer.train(resume_from_checkpoint=True)` (`trl-jagg train ... --resume_from_checkpoint true`), "
    "the same config and output_dir."
)


def interrupted(signal_number: int, output_dir: str, global_step: int, during: str = "") -> TrainingInterrupted:
    """The error ``train()`` raises after the checkpoint of a signalled run: the signal, the step, the checkpoint
    and how to resume from it; ``during`` says what the signal abandoned (e.g. a reward's scoring at a step)."""
    checkpoint = f"{output_dir}/{PREFIX_CHECKPOINT_DIR}-{global_step}"
    name = signal.Signals(signal_number).name
    if during:
        where = f"{name} stopped training {during}, after optimizer step {global_step}"
    else:
        where = f"{name} stopped training after optimizer step {global_step}"
    if not global_step:  # nothing was trained, nothing saved
        return TrainingInterrupted(
            f"{where}: no step had been trained, nothing was saved. Start the run again.", signal_number, ""
        )
    return TrainingInterrupted(f"{where}; every step is in {checkpoint}. {RESUME}", signal_number, checkpoint)
