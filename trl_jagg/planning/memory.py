"""Per-process GPU memory of a training run, component by component, under each way of sharding it.

Every size comes from the modules built on the ``meta`` device (:class:`ModelSizes`) and from the measured
activations (:mod:`trl_jagg.planning.measure`); this module only places them: which copies a run keeps and which
of them a sharding strategy divides by the number of processes.

- ``ddp``: every process holds everything; DDP's gradient buckets are a second copy of the gradients
  (accelerate's default ``gradient_as_bucket_view=False``).
- ``zero2`` (DeepSpeed ZeRO-2): gradients and optimizer state sharded.
- ``fsdp2`` (``fully_shard``) and ``zero3``: weights (the frozen base of a LoRA too), gradients, optimizer state and
  the trainer's float32 copies (EMA, DiffusionNFT's old policy: ``trainer/sharding.py``'s ``aligned_parts``)
  sharded; the block being run is gathered whole, and the next one prefetched (two blocks' weights).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

STRATEGIES = ("ddp", "zero2", "fsdp2", "zero3")
"""The sharding strategies a plan prices (the accelerate configs shipped in ``trl_jagg/configs/accelerate``)."""
SHARDS_WEIGHTS = ("fsdp2", "zero3")
FROZEN_ROW = "text encoders + VAE"
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ModelSizes:
    """Bytes and parameter counts of a run's modules, counted on the ``meta`` device."""

    backbone_params: int
    backbone_bytes: int
    """Every backbone weight (a LoRA run's adapters included), in the dtype the run loads it."""
    trainable_params: int
    trainable_bytes: int
    largest_block_bytes: int
    """The largest transformer block's weights: what FSDP2 / ZeRO-3 gather whole while it runs."""
    frozen_bytes: Mapping[str, int] = field(default_factory=dict)
    """The text encoders' and the VAE's weights, by component name."""


@dataclass(frozen=True)
class RunCopies:
    """What a run keeps besides the backbone and its optimizer (from the training config)."""

    optimizer_state_bytes_per_param: float
    """AdamW: two moments in the parameters' dtype; 8-bit AdamW: 2 bytes."""
    ema: bool = False
    ema_offload: bool = False
    old_policy: bool = False
    reference_copy: bool = False
    """Full fine-tuning with ``beta > 0`` keeps a frozen copy of the backbone for the KL term."""
    offload_frozen_modules: bool = False


@dataclass(frozen=True)
class MemoryRow:
    """One line of the table: a component's bytes per process, and how the strategy treats it."""

    component: str
    bytes: int
    note: str = ""


def _sharded(value: float, sharded: bool, num_processes: int) -> int:
    return int(round(value / num_processes)) if sharded else int(value)


def memory_rows(
    sizes: ModelSizes,
    copies: RunCopies,
    activation_bytes: int,
    *,
    strategy: str,
    num_processes: int,
) -> list[MemoryRow]:
    """The per-process table, the same components under every strategy (0 where it has none); the last row is
    the peak: the static copies plus the larger of one micro-batch's activations and, with
    ``offload_frozen_modules``, the largest frozen module while it visits the GPU."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy is {strategy!r}. Use one of {', '.join(STRATEGIES)}.")
    if num_processes < 1:
        raise ValueError(f"num_processes is {num_processes}. Use 1 or more.")
    weights = strategy in SHARDS_WEIGHTS
    state = strategy != "ddp"
    n = num_processes
    trainable, frozen = sizes.trainable_bytes, sizes.backbone_bytes - sizes.trainable_bytes
    fp32_copy = sizes.trainable_params * FLOAT32_BYTES
    optimizer = sizes.trainable_params * copies.optimizer_state_bytes_per_param
    frozen_total = sum(sizes.frozen_bytes.values())
    name, visiting = max(sizes.frozen_bytes.items(), key=lambda item: item[1], default=("", 0))
    if not copies.offload_frozen_modules:
        visiting = 0
    rows = [
        MemoryRow("backbone, trained weights", _sharded(trainable, weights, n), "sharded by fsdp2, zero3"),
        MemoryRow("backbone, frozen weights", _sharded(frozen, weights, n), "sharded by fsdp2, zero3"),
        MemoryRow("gradients", _sharded(trainable, state, n), "sharded by zero2, fsdp2, zero3"),
        MemoryRow("optimizer state", _sharded(optimizer, state, n), "AdamW's two moments; sharded as gradients"),
        MemoryRow("DDP gradient buckets", trainable if strategy == "ddp" else 0, "ddp: a second copy of the gradients"),
        MemoryRow("gathered blocks", 2 * sizes.largest_block_bytes if weights else 0,
                  "fsdp2, zero3: the running block and the next, whole"),
        MemoryRow("EMA (float32)", 0 if not copies.ema or copies.ema_offload else _sharded(fp32_copy, weights, n),
                  "on the CPU (ema_offload)" if copies.ema and copies.ema_offload else "ema_decay > 0"),
        MemoryRow("old policy (float32)", _sharded(fp32_copy, weights, n) if copies.old_policy else 0,
                  "objective nft"),
        MemoryRow("KL reference backbone", _sharded(sizes.backbone_bytes, weights, n) if copies.reference_copy else 0,
                  "full fine-tuning with beta > 0"),
        MemoryRow(FROZEN_ROW, 0 if copies.offload_frozen_modules else frozen_total,
                  f"on the CPU; {name} visits the GPU while it runs" if copies.offload_frozen_modules
                  else "on the GPU: " + ", ".join(sizes.frozen_bytes)),
        MemoryRow("activations, one micro-batch", activation_bytes, "measured on meta"),
    ]  # fmt: skip
    static = sum(row.bytes for row in rows) - activation_bytes
    rows.append(MemoryRow("peak", static + max(activation_bytes, visiting)))
    return rows
