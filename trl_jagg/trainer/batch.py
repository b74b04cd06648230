"""The rollout batch: what the generation stage returns and the update stage consumes, and the seeds both derive
from the run seed and the optimizer step.

A rollout is a dict: per-sample entries (``latents`` ``(B, N + 1, ...)``, ``log_probs`` ``(B, N)``, ``advantages``
``(B,)`` (or :class:`PendingAdvantages`), ``velocities`` ``(B, N, ...)`` when recorded, ``cond``) and shared ones
(``sigmas``, ``sigma_values`` (the same on the host), ``timesteps``, ``stochastic_steps``, ``velocity_keys`` (one per
step) and ``velocity_step`` (the optimizer step the velocities were recorded at)). The update stage adds
``reference_means`` (step -> ``(B, ...)``), the KL reference's means kept for the micro-batch's later updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PER_SAMPLE_KEYS = ("latents", "log_probs", "advantages", "velocities")


def rng_seed(seed: int, global_step: int, *parts: int) -> int:
    """A seed that depends on the run seed, the optimizer step and ``parts``: resuming replays the same noise."""
    return hash((seed, global_step, *parts)) % (2**63)


def velocity_key(dtype: torch.dtype, device_type: str, batch_shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Identifies the forward path a velocity was computed with: the backbone dtype, the autocast state (accelerate's
    mixed precision wraps the forward in autocast) and the shape of the latents batch the backbone ran on (another
    batch shape may pick other kernels and round differently, on a GPU and on a CPU alike). A cached velocity is
    reused only while the key is unchanged; the parameters it was computed with are the rollout's
    ``velocity_step`` (``jagg_cache_mode`` says what happens after an optimizer step)."""
    autocast = torch.is_autocast_enabled(device_type)
    autocast_dtype = torch.get_autocast_dtype(device_type) if autocast else None
    return (dtype, autocast, autocast_dtype, tuple(batch_shape))


class PendingAdvantages:
    """A rollout's ``advantages`` while its last rewards are still being scored (``overlap_rewards``).

    ``resolve_rows(rows)`` waits for what this process's rows ``rows`` (a CPU index tensor) need and returns their
    advantages: all the rewards (whole-batch statistics), or only the rollout chunks that hold the rows' groups
    (:class:`~trl_jagg.trainer.reward_overlap.ChunkAdvantages`). Indexing selects rows without waiting, so the
    rollout splits into micro-batches as usual; the update stage calls :func:`resolved` where it first needs the
    values, after the work that does not depend on them. Every process must resolve the same rows in the same order
    (the resolution may gather across processes), as the micro-batches of :func:`split_rollout` do."""

    def __init__(self, resolve_rows: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor):
        self._resolve_rows, self.rows = resolve_rows, rows
        self._values: torch.Tensor | None = None

    def __getitem__(self, index: slice | torch.Tensor) -> PendingAdvantages:
        return PendingAdvantages(
            self._resolve_rows, self.rows[index.cpu() if isinstance(index, torch.Tensor) else index]
        )

    def resolve(self) -> torch.Tensor:
        """The rows' advantages, waiting for their rewards on the first call; later calls (one per trained step's
        loss) return the same tensor, since a resolved row's advantage is final."""
        if self._values is None:
            self._values = self._resolve_rows(self.rows)
        return self._values


def resolved(advantages: torch.Tensor | PendingAdvantages) -> torch.Tensor:
    """The advantages' values, waiting for the rewards if they are still pending."""
    return advantages.resolve() if isinstance(advantages, PendingAdvantages) else advantages


def select_samples(batch: dict[str, Any], index: slice | torch.Tensor) -> dict[str, Any]:
    """The samples ``index`` of a rollout or micro-batch: its per-sample entries indexed, the shared ones kept."""
    selected = dict(batch)
    for key in PER_SAMPLE_KEYS:
        if key in batch:
            selected[key] = batch[key][index]
    selected["cond"] = batch["cond"].select(index)
    if "reference_means" in batch:
        selected["reference_means"] = {k: mean[index] for k, mean in batch["reference_means"].items()}
    return selected


def split_rollout(rollout: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Split a rollout along the batch into ``num_chunks`` micro-batches (shared entries are kept as is)."""
    size = rollout["latents"].shape[0] // num_chunks
    return [select_samples(rollout, slice(c * size, (c + 1) * size)) for c in range(num_chunks)]


def without_zero_advantages(chunk: dict[str, Any], num_processes: int) -> dict[str, Any]:
    """The micro-batch without its zero-advantage samples (Flow-GRPO drops them before the update): their policy
    gradient is zero, so they would only cost a backward. ``dropped_frac`` records the share dropped."""
    keep = resolved(chunk["advantages"]) != 0
    if not keep.any() and num_processes > 1:
        # Every process must run the same backward calls (DDP/FSDP collectives): keep one sample, whose zero
        # advantage adds no policy gradient.
        keep[0] = True
    kept = select_samples(chunk, keep.nonzero().flatten())
    kept["dropped_frac"] = 1.0 - kept["latents"].shape[0] / keep.numel()
    return kept
