"""Where the pipeline's modules live: frozen text encoders and VAE on or off the accelerator, FSDP2 resharding, the
base weights of a LoRA backbone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.utils.distributed import is_fully_sharded


class FrozenModules:
    """The pipeline's frozen text encoders and VAE. With ``offload``, they live on the CPU and visit ``device`` only
    while they run (:meth:`on_accelerator`); otherwise they are moved to ``device`` once, by :meth:`place`."""

    def __init__(self, adapter: FlowMatchingAdapter, device: torch.device, *, offload: bool):
        self.adapter = adapter
        self.device = device
        self.offload = offload

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        components = self.adapter.pipeline.components
        return [c for name, c in components.items() if name.startswith("text_encoder") and c is not None]

    @property
    def vae(self) -> list[torch.nn.Module]:
        return [self.adapter.pipeline.vae]

    @property
    def conditioning(self) -> list[torch.nn.Module]:
        """The modules conditioning runs: the text encoders, and the VAE of editing families (it encodes the source
        images into reference latents)."""
        return self.text_encoders + (self.vae if self.adapter.edits_images else [])

    def place(self, trained: torch.nn.Module) -> None:
        """Put every module of the pipeline but ``trained`` (the Trainer places it) where it runs."""
        offloaded = self.text_encoders + self.vae if self.offload else []
        for component in self.adapter.pipeline.components.values():
            if isinstance(component, torch.nn.Module) and component is not trained:
                component.to("cpu" if any(component is m for m in offloaded) else self.device)

    @contextlib.contextmanager
    def on_accelerator(self, modules: list[torch.nn.Module]) -> Iterator[None]:
        """``modules`` on the accelerator for the block (a no-op without ``offload``)."""
        if not self.offload:
            yield
            return
        for module in modules:
            module.to(self.device)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")


def reshard(transformer: torch.nn.Module) -> None:
    """Free the gathered parameters of an FSDP2 root after forward-only (no-grad) use: FSDP2 keeps the root's
    parameters unsharded after forward, for the backward that would follow, and a no-grad pass has none."""
    if is_fully_sharded(transformer):
        transformer.reshard()


@contextlib.contextmanager
def adapters_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """The base weights of a LoRA-adapted diffusers backbone: the reference policy for the KL term."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


@contextlib.contextmanager
def eval_mode(transformer: torch.nn.Module) -> Iterator[None]:
    """``transformer`` in eval mode (no dropout) for the block, its training flag restored and FSDP2 resharded
    after: the rollout, sample images and evaluation run no backward."""
    was_training = transformer.training
    transformer.eval()
    try:
        yield
    finally:
        reshard(transformer)
        transformer.train(was_training)
