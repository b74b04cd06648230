"""A console log of one short line per optimizer step, in place of transformers' printed metrics dict (the trackers
still get every scalar): the rewards, the KL and clipping, the latents' spread, and where the time went.

.. code-block:: python

    trainer = DDPOJaggTrainer(..., callbacks=[StepSummaryCallback()])
    trainer.remove_callback(PrinterCallback)  # or ProgressCallback: the dict printer transformers added

``trl-jagg train --log_format line`` does both.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

SUMMARY_KEYS: tuple[tuple[str, str, str], ...] = (
    ("kl", "kl", ".4f"),
    ("clip_fraction", "clipped", ".2f"),
    ("grad_norm", "grad", ".3g"),
    ("engine/latents/final_std", "latent std", ".2f"),
    ("time/rollout_s", "rollout", ".1f"),
    ("time/update_s", "update", ".1f"),
)
"""``(logged key, label, format)`` of the line after the rewards; a key not logged is left out."""


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def step_line(step: int, max_steps: int, logs: dict[str, Any]) -> str:
    """One line for the logs of one step: the total reward, each reward function's mean, then :data:`SUMMARY_KEYS`
    (times with an ``s``); an evaluation's logs (``eval_reward``) and the run's last summary read alike."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    prefix = "eval_" if "eval_reward" in logs else ""
    if _number(logs.get(f"{prefix}reward")):
        parts.append(f"{prefix.replace('_', ' ')}reward {logs[f'{prefix}reward']:+.3f}")
    rewards = f"{prefix}rewards/"
    for key, value in logs.items():
        if key.startswith(rewards) and key.endswith("/mean") and _number(value):
            parts.append(f"{key[len(rewards) : -len('/mean')]} {value:+.3f}")
    for key, label, spec in SUMMARY_KEYS:
        if _number(logs.get(key)):
            parts.append(f"{label} {logs[key]:{spec}}{'s' if key.startswith('time/') else ''}")
    if len(parts) == 1:  # neither a step nor an evaluation: the run's totals (train_runtime, ...)
        parts += [f"{key} {value:.4g}" for key, value in logs.items() if _number(value)]
    return "  ".join(parts)


class StepSummaryCallback(TrainerCallback):
    """Print :func:`step_line` for every log of the main process (replace transformers' ``PrinterCallback`` or
    ``ProgressCallback``, which print the whole dict)."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            print(step_line(state.global_step, state.max_steps, logs), flush=True)


def use_step_summary(trainer: Any) -> None:
    """Swap ``trainer``'s dict printer (``PrinterCallback`` or the tqdm ``ProgressCallback``) for a
    :class:`StepSummaryCallback`."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(StepSummaryCallback)
