"""Weights that FSDP2 or DeepSpeed ZeRO-3 split over the processes: this process's part, that part of a full tensor,
and the full tensor again; shared by the EMA, the old policy and the checkpoint writer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sharding:
    """How the EMA reaches weights that a sharding kind splits over the processes, so each process averages only
    its own part: ``local(param)``, this process's part (a view: writing it writes the parameter); ``split(full,
    param)``, that part of a full tensor; ``gather(part, param)``, the full tensor from every process's part (a
    collective: every process calls it, in the same order)."""

    local: Callable[[torch.Tensor], torch.Tensor]
    split: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _fsdp2_split(full: torch.Tensor, param: Any) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every process holds the same full tensor and keeps its slice, without communication.
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None).to_local()


def _fsdp2_gather(part: torch.Tensor, param: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    # The global shape and stride: FSDP2 shards dim 0 unevenly when it does not divide by the processes.
    local = DTensor.from_local(
        part.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
    return local.full_tensor()


FSDP2 = Sharding(local=lambda param: param.to_local(), split=_fsdp2_split, gather=_fsdp2_gather)
"""FSDP2 (``fully_shard``, by the trainer or accelerate's plugin): parameters are ``DTensor`` shards."""


def _zero3_split(full: torch.Tensor, param: Any) -> torch.Tensor:
    # DeepSpeed's partitioning: the flattened weight, zero-padded to a multiple of the processes, rank r keeping
    # the slice at r x partition size (`Init._partition_param`, deepspeed 0.19.8).
    size = param.ds_tensor.numel()
    start = torch.distributed.get_rank(group=param.ds_process_group) * size
    part = full.reshape(-1)[start : start + size]
    return torch.nn.functional.pad(part, (0, size - part.numel()))


def _zero3_gather(part: torch.Tensor, param: Any) -> torch.Tensor:
    group = param.ds_process_group
    part = part.to(param.ds_tensor.device).contiguous()
    parts = [torch.empty_like(part) for _ in range(torch.distributed.get_world_size(group=group))]
    torch.distributed.all_gather(parts, part, group=group)
    return torch.cat(parts)[: param.ds_numel].view(param.ds_shape)


ZERO3 = Sharding(local=lambda param: param.ds_tensor, split=_zero3_split, gather=_zero3_gather)
"""DeepSpeed ZeRO-3: each process holds a flat partition (``ds_tensor``) of every parameter, which is itself empty
outside a gather."""


def sharding_of(param: torch.Tensor) -> Sharding | None:
    """The sharding kind of a trained parameter, ``None`` when every process holds it whole (ZeRO-2 included)."""
    from torch.distributed.tensor import DTensor

    if hasattr(param, "ds_tensor"):
        return ZERO3
    return FSDP2 if isinstance(param, DTensor) else None


def local_parts(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This process's part of each parameter (:class:`Sharding`'s ``local``), else the parameter itself."""
    return [kind.local(p) if (kind := sharding_of(p)) is not None else p for p in params]


def aligned_parts(
    copies: list[torch.Tensor], params: list[torch.Tensor], device: torch.device | str | None = None
) -> list[torch.Tensor]:
    """This process's part of each parameter (:func:`local_parts`), with each of ``copies`` (one float32 copy per
    parameter, the EMA's average or DiffusionNFT's old policy) that was taken whole cut to that part, in place, on
    ``device`` (``None``: the part's): accelerate's FSDP2 plugin and DeepSpeed's ZeRO-3 engine shard the backbone
    in ``train()``, after the trainer made the copies, and a checkpoint holds whole tensors."""
    parts = local_parts(params)
    for i, (copy, part, param) in enumerate(zip(copies, parts, params)):
        if copy.shape != part.shape and (kind := sharding_of(param)) is not None:
            copies[i] = kind.split(copy, param).to(device=device or part.device, dtype=torch.float32)
    return parts


def whole(copy: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``copy``, this process's part of ``param`` (:func:`aligned_parts`): under sharding a
    collective that every process joins, in the same order; else ``copy`` itself."""
    kind = sharding_of(param)
    return kind.gather(copy, param) if kind is not None else copy


def whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole parameter, whichever part of it this process holds."""
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
