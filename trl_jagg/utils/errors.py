"""Exceptions of a training run that stopped for a reason the user can act on.

Their messages say what happened, where (the step, the quantity, the file) and the fix, on one line: the CLI prints
them without a traceback. Configuration and input mistakes stay ``ValueError`` / ``TypeError``, raised before
anything loads.
"""

from __future__ import annotations


class TrainingError(RuntimeError):
    """A run stopped: the message names what, where, and the fix."""


class NonFiniteError(TrainingError):
    """A NaN or infinity in the latents, the loss, the gradient norm or the weights: the run stops before the
    optimizer applies it or a checkpoint stores it."""


class CheckpointError(TrainingError):
    """A checkpoint to resume from is missing, truncated, or does not match the model being trained."""


class TrainingInterrupted(TrainingError):
    """SIGINT or SIGTERM stopped the run after an optimizer step, whose checkpoint was saved; ``exit_code`` is the
    shell's status for that signal (128 + its number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, signal_number: int, checkpoint: str):
        super().__init__(message)
        self.signal_number, self.checkpoint = signal_number, checkpoint
        self.exit_code = 128 + signal_number


class PeerLost(TrainingError):
    """Another process of the job died, froze or failed while this one trained (``ranks``, on ``nodes``): the
    message names them, the last complete checkpoint and the resume (:mod:`trl_jagg.trainer.peer_watch`)."""

    def __init__(self, message: str, ranks: list[int], nodes: list[int]):
        super().__init__(message)
        self.ranks, self.nodes = ranks, nodes


__all__ = ["CheckpointError", "NonFiniteError", "PeerLost", "TrainingError", "TrainingInterrupted"]
