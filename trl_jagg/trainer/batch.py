"""The rollout batch: what the generation stage returns and the update stage consumes
(:class:`RolloutBatch`), and the seeds both derive from the run seed and the optimizer step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.models.base import Conditioning


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
    (the resolution may gather across processes), as the micro-batches of :meth:`RolloutBatch.split` do."""

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


@dataclass(eq=False)  # compared and hashed by identity: a micro-batch keys the caches the update stage keeps for it
class RolloutBatch:
    """A scored rollout of ``B`` samples over an ``N``-step schedule, or a micro-batch of one.

    Per-sample fields (indexed by :meth:`select`) are ``latents``, ``advantages``, ``cond``, ``log_probs`` and
    ``velocities``; the others describe the schedule and the forward path, shared by every sample.
    """

    latents: torch.Tensor
    """``(B, N + 1, ...)``: the trajectory, the initial noise first and the clean sample last."""
    advantages: torch.Tensor | PendingAdvantages
    """``(B,)``, or :class:`PendingAdvantages` while the last rewards are still scoring."""
    cond: Conditioning
    """The samples' prompt (and source-image) encodings."""
    sigmas: torch.Tensor
    """``(N + 1,)``: the schedule's flow times, on the device."""
    sigma_values: list[float]
    """``sigmas`` on the host: the group planner reads them without a device transfer per step."""
    timesteps: torch.Tensor
    """``(N,)``: the backbone's timestep of each step."""
    stochastic_steps: list[int] | None = None
    """The SDE window's steps (``None``: every step stochastic; empty: a deterministic ODE rollout)."""
    log_probs: torch.Tensor | None = None
    """``(B, N)``: each step's log-probability under the sampling policy (``None`` where the objective keeps
    none)."""
    velocities: torch.Tensor | None = None
    """``(B, N, ...)``: the guided velocities the sampler computed, when recorded for the velocity cache."""
    velocity_keys: list[tuple[Any, ...] | None] | None = None
    """Per step, the forward path its recorded velocities were computed on (:func:`velocity_key`; ``None``: the
    step ran on several batch shapes, never reused)."""
    velocity_step: int | None = None
    """The optimizer step whose parameters computed ``velocities``."""
    dropped_frac: float | None = None
    """The share of the micro-batch's samples :func:`without_zero_advantages` dropped (``None``: none dropped)."""

    @property
    def size(self) -> int:
        """``B``, the number of samples."""
        return self.latents.shape[0]

    def select(self, index: slice | torch.Tensor) -> RolloutBatch:
        """The samples ``index``: the per-sample fields indexed, the shared ones kept."""
        return dataclasses.replace(
            self,
            latents=self.latents[index],
            advantages=self.advantages[index],
            cond=self.cond.select(index),
            log_probs=None if self.log_probs is None else self.log_probs[index],
            velocities=None if self.velocities is None else self.velocities[index],
        )

    def split(self, num_chunks: int) -> list[RolloutBatch]:
        """``num_chunks`` micro-batches of consecutive samples (``B`` divides evenly)."""
        size = self.size // num_chunks
        return [self.select(slice(c * size, (c + 1) * size)) for c in range(num_chunks)]


def without_zero_advantages(chunk: RolloutBatch, num_processes: int) -> RolloutBatch:
    """The micro-batch without its zero-advantage samples (Flow-GRPO drops them before the update): their policy
    gradient is zero, so they would only cost a backward. ``dropped_frac`` records the share dropped."""
    keep = resolved(chunk.advantages) != 0
    if not keep.any() and num_processes > 1:
        # Every process must run the same backward calls (DDP/FSDP collectives): keep one sample, whose zero
        # advantage adds no policy gradient.
        keep[0] = True
    kept = chunk.select(keep.nonzero().flatten())
    kept.dropped_frac = 1.0 - kept.size / keep.numel()
    return kept
