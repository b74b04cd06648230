"""What one backbone call costs, measured by running it: the tensors autograd saves for the backward (activation
memory) and the FLOPs of the forward and the backward.

Activations are the tensors handed to ``torch.autograd.graph.saved_tensors_hooks``' pack hook during a forward with
a graph, deduplicated by the storage they view and leaving the parameters out: what stays allocated from the forward
until the backward. On the ``meta`` device nothing is allocated, so a 20B backbone is measured in seconds; the same
count on the CPU measures a real run (the tests compare the two on a tiny model).

Attention runs as the GPU runs it, through a fused kernel that keeps its output and the log-sum-exp rather than the
``tokens x tokens`` probabilities: on ``meta`` (and without a fused kernel) ``scaled_dot_product_attention`` would take
the math path, which saves the whole attention matrix. The measurement swaps in the CPU flash kernel, whose saved
tensors are those of the GPU's flash attention (output and log-sum-exp), wherever no mask is passed.

The saved bytes are attributed to the transformer block running when they are saved (module hooks), with each
block's inputs, so that checkpointing any subset of the blocks is priced from the same run (:meth:`ActivationProfile
.checkpointed_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trl_jagg.trainer.backbone import repeated_blocks


def _root(tensor: torch.Tensor) -> torch.Tensor:
    while tensor._base is not None:
        tensor = tensor._base
    return tensor


def _nbytes(tensor: torch.Tensor) -> int:
    # A view's base holds its memory; meta tensors have no storage to ask, so count the base's elements.
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` through the flash kernel (what a GPU runs) while the block runs."""
    math_attention = F.scaled_dot_product_attention

    def flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or enable_gqa or query.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return math_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
        flash_kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash_kernel(query, key, value, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = math_attention


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The backbone's transformer blocks in module order: the blocks the trainer's activation checkpointing
    chooses every k-th of (:func:`~trl_jagg.trainer.backbone.repeated_blocks`; Flux: joint, then single-stream
    blocks; Z-Image: its refiner layers, then the main ones)."""
    return repeated_blocks(model)


def _call(model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The backbone's prediction as one tensor (Z-Image returns one tensor per sample: stacked)."""
    output = model(**inputs, return_dict=False)[0]
    return torch.stack(output) if isinstance(output, (list, tuple)) else output


@dataclass(frozen=True)
class ActivationProfile:
    """The bytes one forward with a graph keeps for its backward, by where they were saved."""

    outside_blocks: int
    """Saved by the embedders and the output layers."""
    per_block: tuple[int, ...]
    """Saved inside each transformer block."""
    block_inputs: tuple[int, ...]
    """The tensors each block takes that a checkpointed block keeps instead (those not kept for an earlier block)."""

    @property
    def total(self) -> int:
        """Every saved byte: the forward's activations without checkpointing."""
        return self.outside_blocks + sum(self.per_block)

    def checkpointed_bytes(self, every: int) -> int:
        """The peak of saved bytes with every ``every``-th block checkpointed (blocks ``0, every, 2 every, ...``;
        ``every=1``: all): the others keep their activations, a checkpointed block keeps its inputs and, during its
        backward, recomputes its own activations (one block at a time)."""
        if every < 1:
            raise ValueError(f"every is {every}. Use 1 (every block) or more.")
        checkpointed = range(0, len(self.per_block), every)
        kept = sum(saved for index, saved in enumerate(self.per_block) if index % every)
        inputs = sum(self.block_inputs[index] for index in checkpointed)
        recompute = max((self.per_block[index] for index in checkpointed), default=0)
        return self.outside_blocks + kept + inputs + recompute


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for value in values:
            yield from _tensors(value)
    elif isinstance(values, Mapping):
        for value in values.values():
            yield from _tensors(value)


def measure_activations(model: torch.nn.Module, inputs: Mapping[str, Any]) -> ActivationProfile:
    """Run ``model(**inputs)`` once with a graph and return what its backward would need (see the module
    docstring). Works on any device; on ``meta`` it allocates nothing."""
    parameters = {id(_root(parameter)) for parameter in model.parameters()}
    blocks = transformer_blocks(model)
    saved: dict[int, int] = {}  # id of the base tensor -> the block it was saved in (-1: outside)
    sizes: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # keeps every counted base alive so that no id is reused while counting
    inputs_of: list[int] = [0] * len(blocks)
    current = [-1]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = _root(tensor)
        if id(base) in parameters:
            return tensor
        if id(base) not in saved:
            sizes[id(base)] = _nbytes(base)
            alive.append(base)
            saved[id(base)] = current[0]
        elif saved[id(base)] <= -2:  # a block input, now saved: it stays until the backward either way
            saved[id(base)] = current[0]
        return tensor

    def entering(index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            current[0] = index
            for tensor in _tensors((args, kwargs)):
                base = _root(tensor)
                if id(base) not in parameters and id(base) not in saved:
                    saved[id(base)], sizes[id(base)] = -2 - index, _nbytes(base)  # a block input, not saved yet
                    alive.append(base)
                    inputs_of[index] += sizes[id(base)]

        return hook

    def leaving(module: torch.nn.Module, args: tuple, output: Any) -> None:
        current[0] = -1

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(entering(index), with_kwargs=True))
        handles.append(block.register_forward_hook(leaving))
    try:
        with fused_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = _call(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    del output
    per_block = [0] * len(blocks)
    outside = 0
    for key, where in saved.items():
        if where >= 0:
            per_block[where] += sizes[key]
        elif where == -1:
            outside += sizes[key]
    # A block input that autograd also saves counts where it is saved (and in ``block_inputs``); one it never
    # saves costs nothing without checkpointing, so only ``block_inputs`` holds it.
    return ActivationProfile(outside_blocks=outside, per_block=tuple(per_block), block_inputs=tuple(inputs_of))


@dataclass(frozen=True)
class CallFlops:
    """FLOPs of one backbone call, counted by ``torch.utils.flop_counter.FlopCounterMode``."""

    forward: int
    backward: int
    recompute_per_block: tuple[int, ...]
    """Each block's forward FLOPs: what its backward adds when it is checkpointed."""

    def backward_with_checkpointing(self, every: int | None) -> int:
        """The backward's FLOPs with every ``every``-th block checkpointed (``None``: none)."""
        if every is None:
            return self.backward
        return self.backward + sum(self.recompute_per_block[::every])


def count_flops(model: torch.nn.Module, inputs: Mapping[str, Any]) -> CallFlops:
    """Count one forward and its backward (on ``meta``: seconds of Python at any size), each block's forward apart."""
    from torch.utils.flop_counter import FlopCounterMode

    blocks = transformer_blocks(model)
    per_block = [0] * len(blocks)
    counter = FlopCounterMode(display=False)
    marks: list[int] = [0]

    def entering(module: torch.nn.Module, args: tuple) -> None:
        marks[0] = counter.get_total_flops()

    def leaving(index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            per_block[index] = counter.get_total_flops() - marks[0]

        return hook

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(entering))
        handles.append(block.register_forward_hook(leaving(index)))
    try:
        with counter:
            output = _call(model, inputs)
        forward = counter.get_total_flops()
    finally:
        for handle in handles:
            handle.remove()
    with FlopCounterMode(display=False) as backward_counter:
        output.float().sum().backward()
    return CallFlops(
        forward=forward, backward=backward_counter.get_total_flops(), recompute_per_block=tuple(per_block)
    )
