"""The exponential moving average of the trained weights (Flow-GRPO's and DanceGRPO's ``ema``), kept in float32."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from diffusers.training_utils import EMAModel
from transformers import TrainerCallback

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.trainer.sharding import aligned_parts, local_parts, whole
from trl_jagg.utils.distributed import zero3_init_disabled


class EMAWeights(EMAModel):
    """diffusers' :class:`~diffusers.training_utils.EMAModel` of ``parameters()`` (the trainable ones), on the CPU
    with ``ema_offload``; Flow-GRPO's warm-up ``min(decay, (1 + t) / (10 + t))`` when ``ema_warmup``. Under
    sharding (FSDP2 or DeepSpeed ZeRO-3, :func:`sharding_of`) each process averages its own part of every weight
    (:func:`local_parts`); :meth:`full_weights` gathers the average for saving. Refused under accelerate's FSDP
    version 1 plugin."""

    def __init__(
        self, args: GRPOJaggConfig, parameters: Callable[[], list[torch.nn.Parameter]], *, accelerator: Any = None
    ):
        fsdp = accelerator is not None and getattr(accelerator.state, "fsdp_plugin", None) is not None
        if fsdp and not accelerator.is_fsdp2:  # FSDP1's flat parameters are neither whole weights nor DTensor shards
            raise ValueError(
                "GRPOJaggConfig.ema_decay > 0 is not supported with FSDP version 1. Use FSDP2 (fsdp_version: 2, as "
                "examples/accelerate_configs/fsdp2.yaml), or set ema_decay=0."
            )
        super().__init__(
            local_parts(parameters()),
            decay=args.ema_decay,
            min_decay=0.0 if args.ema_warmup else float(args.ema_decay),
        )
        self.args = args
        self.parameters = parameters
        self.shadow_device = "cpu" if args.ema_offload else None
        # float32: a bf16 average would lose updates of (1 - decay) * difference.
        self.to(device=self.shadow_device, dtype=torch.float32)

    def _parts(self) -> list[torch.Tensor]:
        """This process's part of each trainable weight, the average cut to the same parts if it was taken whole
        (:func:`aligned_parts`)."""
        return aligned_parts(self.shadow_params, self.parameters(), self.shadow_device)

    def update_at(self, global_step: int) -> None:
        """Average the current weights in, after optimizer step ``global_step``."""
        # EMAModel's warm-up decay at its update n is min(decay, n / (9 + n)); counting optimizer steps instead of
        # updates makes it Flow-GRPO's min(decay, (1 + t) / (10 + t)) at optimizer step t.
        self.optimization_step = global_step
        # EMAModel averages only tensors that require grad (a shard's local tensor and a ZeRO-3 partition do not)
        # and in place on the shadow's device.
        device, dtype = ("cpu", torch.float32) if self.args.ema_offload else (None, None)
        params = [p.detach().to(device=device, dtype=dtype).requires_grad_(True) for p in self._parts()]
        # EMAModel would gather each parameter itself under ZeRO-3 (and fails to import deepspeed in diffusers 0.42).
        with zero3_init_disabled(self.args):
            self.step(params)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones for the duration of the block (each process its part)."""
        params = self._parts()
        self.store(params)
        self.copy_to(params)
        try:
            yield
        finally:
            self.restore(params)

    def take_current_weights(self) -> None:
        """Make the current trainable weights the average (a resumed run loads the saved EMA into the model first)."""
        self.shadow_params = [
            p.detach().to(device=self.shadow_device, dtype=torch.float32).clone()
            for p in local_parts(self.parameters())
        ]

    def full_weights(self) -> list[torch.Tensor | None]:
        """The whole average of each trainable weight in its dtype, on the CPU of the main process (``None`` on
        the others); under sharding a collective, one weight at a time, that every process joins."""
        main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        params, weights = self.parameters(), []
        self._parts()
        for shadow, param in zip(self.shadow_params, params):
            full = whole(shadow, param)
            weights.append(full.to("cpu", param.dtype) if main else None)
        return weights


@contextlib.contextmanager
def ema_swapped_in(ema: EMAWeights | None) -> Iterator[None]:
    """:meth:`EMAWeights.swapped_in`, a no-op without EMA."""
    with ema.swapped_in() if ema is not None else contextlib.nullcontext():
        yield


def ema_weight_files(folder: str) -> list[str]:
    """The safetensors files of an ``ema/`` folder (a two-expert backbone's in its component folders too)."""
    return sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True))


def ema_stamp(step: int, args: GRPOJaggConfig) -> dict[str, str]:
    """What each EMA weights file carries in its safetensors metadata: the optimizer step of the average, the run
    (``run_name``, else ``output_dir``) and the objective, which a resume compares with its checkpoint's."""
    return {"ema_step": str(step), "ema_run": str(args.run_name or args.output_dir), "ema_objective": args.objective}


COPY_CHUNK_BYTES = 64 * 2**20


def add_safetensors_metadata(file: str, metadata: Mapping[str, str]) -> None:
    """Add ``metadata`` to the header of the safetensors ``file`` (which keeps its own, e.g. the LoRA config) without
    loading its tensors: the header is rewritten, the data copied after it (its offsets are relative to the data),
    and the new file replaces the old one at once."""
    staged = f"{file}.stamping"
    with open(file, "rb") as source:
        header = json.loads(source.read(int.from_bytes(source.read(8), "little")))
        header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data stays 8-byte aligned, as safetensors writes it
        with open(staged, "wb") as target:
            target.write(len(encoded).to_bytes(8, "little") + encoded)
            shutil.copyfileobj(source, target, COPY_CHUNK_BYTES)
    os.replace(staged, file)


def stamp_ema_files(folder: str, step: int, args: GRPOJaggConfig) -> None:
    """Stamp every EMA weights file in ``folder`` with :func:`ema_stamp` (the main process, after writing them)."""
    for file in ema_weight_files(folder):
        add_safetensors_metadata(file, ema_stamp(step, args))


class EMACallback(TrainerCallback):
    """Updates the EMA on ``args.ema_schedule``: ``step``, after every ``ema_update_interval``-th optimizer step;
    ``flow_grpo``, as Flow-GRPO's loop, which calls ``ema.step(params, t)`` after every micro-batch with the optimizer
    steps taken so far ``t`` (scripts/train_sd3.py:960 at zhtmike/flow_grpo@9745241) and updates when
    ``(t + 1) % interval == 0`` (flow_grpo/ema.py:45): the micro-batch that completes step ``t`` and the
    ``gradient_accumulation_steps - 1`` that follow it, before step ``t + 1``, all see the weights after step ``t``."""

    def __init__(self, ema: EMAWeights):
        self.ema = ema

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
