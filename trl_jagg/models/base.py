"""The model adapter interface: what differs between flow-matching pipeline families, and nothing about GRPO.

An adapter wraps a diffusers pipeline and answers four questions for the shared sampler and trainer:
how to turn prompts into backbone conditioning, how to draw initial latents, what the noise schedule is, and how
one backbone call (with guidance) maps latents to a velocity. Decoding latents to images is the fifth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image


@dataclass
class Conditioning:
    """Everything the backbone needs besides latents and timestep.

    Attributes:
        per_sample: tensors with the batch dimension first (prompt embeddings, masks, negative embeddings).
        shared: inputs common to the batch (e.g. Flux's ``txt_ids``/``img_ids``, Qwen-Image's ``img_shapes``).
    """

    per_sample: dict[str, torch.Tensor]
    shared: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.per_sample[key] if key in self.per_sample else self.shared[key]

    def __contains__(self, key: str) -> bool:
        return key in self.per_sample or key in self.shared

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> Conditioning:
        """The conditioning of a subset of the batch."""
        return Conditioning({k: v[index] for k, v in self.per_sample.items()}, self.shared)


def classifier_free_guidance(
    cond: torch.Tensor, uncond: torch.Tensor, scale: float, *, rescale_to_cond_norm: bool = False
) -> torch.Tensor:
    """``v = v_u + w (v_c - v_u)``; optionally rescaled per token to the conditional prediction's norm
    (Qwen-Image's true CFG), which keeps large scales from blowing up the latent scale."""
    guided = uncond + scale * (cond - uncond)
    if rescale_to_cond_norm:
        guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
    return guided


class FlowMatchingAdapter:
    """Base class of model adapters; subclasses implement the per-family pieces.

    Latents handed between sampler steps are float32 (log-probabilities are exact there); the adapter casts them
    to the backbone's dtype for each call.

    Class attributes:
        pipeline_class: the diffusers pipeline class this adapter serves (the registry key).
        linspace_sigmas: whether the pipeline passes ``sigmas = linspace(1, 1/N, N)`` to the scheduler (Flux,
            Qwen-Image) rather than letting it build its own (SD3).
        guidance_is_cfg: whether ``guidance_scale`` is a classifier-free guidance scale (SD3) rather than an
            embedded guidance value (Flux); ``true_cfg_scale`` is always true CFG.
        lora_target_modules: sensible default LoRA targets (the attention projections).
    """

    pipeline_class: ClassVar[type[DiffusionPipeline]]
    linspace_sigmas: ClassVar[bool] = True
    guidance_is_cfg: ClassVar[bool] = False
    lora_target_modules: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: DiffusionPipeline):
        if not isinstance(pipeline, self.pipeline_class):
            raise TypeError(
                f"{type(self).__name__} serves {self.pipeline_class.__name__}, got {type(pipeline).__name__}."
            )
        self.pipeline = pipeline

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    # ---- per family ----
    def condition(
        self,
        prompts: Sequence[str],
        *,
        height: int,
        width: int,
        negative_prompt: str | None = None,
        max_sequence_length: int | None = None,
    ) -> Conditioning:
        """Encode ``prompts`` (and the negative prompt when given) and add the resolution's spatial inputs."""
        raise NotImplementedError

    def prepare_latents(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """Initial noise in the backbone's latent layout, drawn as the pipeline draws it, in float32."""
        raise NotImplementedError

    def predict_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
    ) -> torch.Tensor:
        """One guided backbone evaluation: the velocity at ``latents`` and scheduler ``timestep`` (``(batch,)``).

        ``transformer`` is passed explicitly because the trainer calls the DDP/FSDP-wrapped module.
        """
        raise NotImplementedError

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """VAE-decode to pixel space in [-1, 1], ``(batch, 3, height, width)``."""
        raise NotImplementedError

    # ---- shared ----
    def needs_negative_prompt(self, guidance_scale: float, true_cfg_scale: float) -> bool:
        """Whether these guidance settings run an unconditional branch, so ``condition`` must encode the negative
        prompt."""
        return true_cfg_scale > 1 or (self.guidance_is_cfg and guidance_scale > 1)

    def image_seq_len(self, height: int, width: int) -> int:
        """Tokens of the packed latent image: the input of the dynamic schedule shift."""
        scale = self.pipeline.vae_scale_factor * 2
        return (height // scale) * (width // scale)

    def schedule(self, num_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's own schedule for ``num_steps`` at this resolution.

        Returns ``(sigmas, timesteps)``: ``num_steps + 1`` float32 flow times ending at 0, and the ``num_steps``
        scheduler timesteps the backbone is called with.
        """
        scheduler = self.pipeline.scheduler
        config = scheduler.config
        kwargs: dict[str, Any] = {}
        if config.get("use_dynamic_shifting", False):
            seq_len = self.image_seq_len(height, width)
            base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
            base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
            slope = (max_shift - base_shift) / (max_len - base_len)
            kwargs["mu"] = seq_len * slope + base_shift - slope * base_len
        if self.linspace_sigmas and not config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device=self.device, **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device=self.device, **kwargs)
        return scheduler.sigmas.float().clone(), scheduler.timesteps.clone()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        """Latents to PIL images, through the pipeline's own image processor."""
        pixels = self.decode_latents(latents, height, width)
        return self.pipeline.image_processor.postprocess(pixels.float(), output_type="pil")
