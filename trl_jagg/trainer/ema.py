"""The exponential moving average of the trained weights (Flow-GRPO's and DanceGRPO's ``ema``), kept in float32."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from diffusers.training_utils import EMAModel
from transformers import TrainerCallback

from ..distributed import zero3_init_disabled
from ..grpo_jagg_config import GRPOJaggConfig


def local_partitions(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """What this process averages: under DeepSpeed ZeRO-3 each parameter's own flat partition (``ds_tensor``; the
    parameter itself is empty outside a gather), else the parameter (ZeRO-2 leaves parameters whole)."""
    return [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in params]


class EMAWeights(EMAModel):
    """diffusers' :class:`~diffusers.training_utils.EMAModel` of ``parameters()`` (the trainable ones), on the CPU
    with ``ema_offload``; Flow-GRPO's warm-up ``min(decay, (1 + t) / (10 + t))`` when ``ema_warmup``. ``sharded``:
    the trained backbone is sharded by accelerate's FSDP plugin (refused for now). Under DeepSpeed ZeRO-3 each
    process averages its own partitions (:func:`local_partitions`), gathered on save."""

    def __init__(self, args: GRPOJaggConfig, parameters: Callable[[], list[torch.nn.Parameter]], *, sharded: bool):
        if sharded or args.fully_shard_backbone:
            raise ValueError(
                "GRPOJaggConfig.ema_decay > 0 is not supported with FSDP yet: the EMA would average one process's "
                "shards only. Set ema_decay=0, or train without FSDP."
            )
        super().__init__(
            local_partitions(parameters()),
            decay=args.ema_decay,
            min_decay=0.0 if args.ema_warmup else float(args.ema_decay),
        )
        self.args = args
        self.parameters = lambda: local_partitions(parameters())
        self.shadow_device = "cpu" if args.ema_offload else None
        # float32: a bf16 average would lose updates of (1 - decay) * difference.
        self.to(device=self.shadow_device, dtype=torch.float32)

    def update_at(self, global_step: int) -> None:
        """Average the current weights in, after optimizer step ``global_step``."""
        # EMAModel's warm-up decay at its update n is min(decay, n / (9 + n)); counting optimizer steps instead of
        # updates makes it Flow-GRPO's min(decay, (1 + t) / (10 + t)) at optimizer step t.
        self.optimization_step = global_step
        params = self.parameters()
        if self.args.ema_offload or not all(p.requires_grad for p in params):
            # EMAModel averages in place on the shadow's device, and copies the tensors without requires_grad
            # instead of averaging them (ZeRO-3's partitions have none).
            params = [
                p.detach().to(device=self.shadow_device or p.device, dtype=torch.float32).requires_grad_(True)
                for p in params
            ]
        # EMAModel would gather each parameter itself under ZeRO-3 (and fails to import deepspeed in diffusers 0.42).
        with zero3_init_disabled(self.args):
            self.step(params)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones for the duration of the block."""
        params = self.parameters()
        self.store(params)
        self.copy_to(params)
        try:
            yield
        finally:
            self.restore(params)

    def take_current_weights(self) -> None:
        """Make the current trainable weights the average (a resumed run loads the saved EMA into the model first)."""
        self.shadow_params = [
            p.detach().to(device=self.shadow_device, dtype=torch.float32).clone() for p in self.parameters()
        ]


@contextlib.contextmanager
def ema_swapped_in(ema: EMAWeights | None) -> Iterator[None]:
    """:meth:`EMAWeights.swapped_in`, a no-op without EMA."""
    with ema.swapped_in() if ema is not None else contextlib.nullcontext():
        yield


class EMACallback(TrainerCallback):
    """Updates the EMA on ``args.ema_schedule``: ``step``, after every ``ema_update_interval``-th optimizer step;
    ``flow_grpo``, as Flow-GRPO's loop, which calls ``ema.step(params, t)`` after every micro-batch with the optimizer
    steps taken so far ``t`` (scripts/train_sd3.py:960 at zhtmike/flow_grpo@9745241) and updates when
    ``(t + 1) % interval == 0`` (flow_grpo/ema.py:45): the micro-batch that completes step ``t`` and the
    ``gradient_accumulation_steps - 1`` that follow it, before step ``t + 1``, all see the weights after step ``t``."""

    def __init__(self, ema: EMAWeights):
        self.ema = ema

    def on_train_begin(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        # DeepSpeed ZeRO-3 partitions the weights when `train` builds the engine, after the average was taken from
        # the same (untrained) weights whole: take it again from this process's partitions.
        if [s.shape for s in self.ema.shadow_params] != [p.shape for p in self.ema.parameters()]:
            self.ema.take_current_weights()

    def on_pre_optimizer_step(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        # The weights are still those after step t = global_step: Flow-GRPO's calls inside step t + 1's window.
        t = state.global_step
        if args.ema_schedule == "flow_grpo" and (t + 1) % args.ema_update_interval == 0:
            for _ in range(args.gradient_accumulation_steps - 1):
                self.ema.update_at(t)

    def on_step_end(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        t = state.global_step
        due = (t + 1) if args.ema_schedule == "flow_grpo" else t
        if due % args.ema_update_interval == 0:
            self.ema.update_at(t)
