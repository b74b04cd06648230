"""Wan2.1 text-to-video (``WanPipeline``): UMT5 prompts, 5-D video latents ``(batch, 16, frames, h, w)`` denoised by
a 3-D DiT predicting the flow velocity, and the causal video VAE with per-channel latent statistics."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanPipeline
from PIL import Image

from .base import Conditioning, FlowMatchingAdapter

DEFAULT_NUM_FRAMES = 81
"""``WanPipeline``'s default ``num_frames``."""


class WanAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.WanPipeline` with one transformer (Wan2.1).

    Differs from the base in five ways. Latents are videos ``(batch, channels, latent frames, h, w)``, drawn by the
    pipeline's ``prepare_latents`` for :attr:`num_frames` pixel frames; the sampler, log-probs (means over every
    latent dimension) and the engine take them as they take images. ``guidance_scale`` is a CFG scale
    (``v_u + g (v_c - v_u)``, on from ``g > 1``; both branches in one backbone call on ``2B``, where the pipeline
    makes two). The schedule is the scheduler's own (``set_timesteps(N)`` with its shift), as the pipeline sets it.
    Decoding undoes the VAE's ``latents_mean`` / ``latents_std`` and returns ``(batch, 3, frames, H, W)`` pixels, and
    :meth:`to_images` one list of PIL frames per sample (a video; rewards score it per frame or whole, see
    :func:`~trl_jagg.rewards.takes_videos`).

    Wan2.2's two-expert checkpoints (``transformer_2``, ``boundary_ratio``) and TI2V's per-token timesteps
    (``expand_timesteps``) are refused with an error: not supported yet.
    """

    pipeline_class = WanPipeline
    linspace_sigmas = False  # the pipeline calls set_timesteps(num_inference_steps)
    guidance_is_cfg = True
    packed_latents = False  # the transformer patchifies 1x2x2 itself
    makes_videos = True
    # Flow-GRPO's Wan targets include `add_*_proj` (image-to-video cross-attention), absent from text-to-video.
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: WanPipeline):
        super().__init__(pipeline)
        if pipeline.transformer_2 is not None or pipeline.config.boundary_ratio is not None:
            raise ValueError(
                "This WanPipeline has two experts (Wan2.2 A14B: `transformer_2`, `boundary_ratio`), which trl_jagg "
                "does not train yet. Use a Wan2.1 checkpoint (one transformer)."
            )
        if pipeline.config.expand_timesteps:
            raise ValueError(
                "This WanPipeline samples with per-token timesteps (`expand_timesteps`, Wan2.2 TI2V), which trl_jagg "
                "does not train yet. Use a Wan2.1 checkpoint."
            )
        self._num_frames = DEFAULT_NUM_FRAMES

    @property
    def num_frames(self) -> int:
        """Pixel frames of each video (``GRPOJaggConfig.num_frames``): ``4 k + 1`` for the 4x temporal VAE."""
        return self._num_frames

    @num_frames.setter
    def num_frames(self, value: int) -> None:
        temporal = self.pipeline.vae_scale_factor_temporal
        if not isinstance(value, int) or value < 1 or (value - 1) % temporal:
            # The pipeline rounds such a value with a warning; a training run should not sample another length.
            raise ValueError(
                f"num_frames={value!r}: Wan's VAE compresses time {temporal}x, so videos have {temporal} k + 1 frames "
                f"(e.g. {DEFAULT_NUM_FRAMES}, or 33 as Flow-GRPO trains). Set GRPOJaggConfig.num_frames to one."
            )
        self._num_frames = value

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        embeds, _ = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length or 512,  # the pipeline's default; padded with zeros to it
            device=self.device,
        )
        return {"prompt_embeds": embeds}

    def prepare_latents(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        channels = self.transformer.config.in_channels
        return self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.num_frames, torch.float32, self.device, generator
        )

    def predict_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        uncond_grad: bool = True,
    ) -> torch.Tensor:
        hidden = latents.to(self.dtype)

        def branch_inputs(prefix: str) -> dict[str, Any]:
            return {
                "hidden_states": hidden,
                "timestep": timestep,
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
            }

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            return transformer(**inputs, return_dict=False)[0]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # The pipeline's `latents / (1 / std) + mean`, per latent channel.
        vae = self.pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]

    def to_images(self, pixels: torch.Tensor) -> list[list[Image.Image]]:
        """Decoded videos ``(batch, 3, frames, H, W)`` to one list of PIL frames per sample, through the pipeline's
        video processor."""
        return self.pipeline.video_processor.postprocess_video(pixels.float(), output_type="pil")
