"""Flux (FLUX.1-dev / schnell and fine-tunes): packed 2x2 latents, ``img_ids``/``txt_ids``, embedded guidance."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import FluxPipeline

from .base import Conditioning, FlowMatchingAdapter, classifier_free_guidance


class FluxAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.FluxPipeline`."""

    pipeline_class = FluxPipeline

    def condition(
        self,
        prompts: Sequence[str],
        *,
        height: int,
        width: int,
        negative_prompt: str | None = None,
        max_sequence_length: int | None = None,
    ) -> Conditioning:
        pipe = self.pipeline
        kwargs = {"device": self.device} | (
            {"max_sequence_length": max_sequence_length} if max_sequence_length else {}
        )
        with torch.no_grad():
            embeds, pooled, txt_ids = pipe.encode_prompt(prompt=list(prompts), prompt_2=None, **kwargs)
            per_sample = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
            if negative_prompt is not None:
                neg, neg_pooled, _ = pipe.encode_prompt(
                    prompt=[negative_prompt] * len(prompts), prompt_2=None, **kwargs
                )
                per_sample |= {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
        # Image token ids depend only on the resolution (packed latent grid), text ids on nothing but length.
        grid_h = height // (pipe.vae_scale_factor * 2)
        grid_w = width // (pipe.vae_scale_factor * 2)
        img_ids = pipe._prepare_latent_image_ids(1, grid_h, grid_w, self.device, embeds.dtype)
        return Conditioning(per_sample, {"txt_ids": txt_ids, "img_ids": img_ids})

    def prepare_latents(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        channels = self.transformer.config.in_channels // 4
        latents, _ = self.pipeline.prepare_latents(
            batch_size, channels, height, width, torch.float32, self.device, generator
        )
        return latents

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
        hidden = latents.to(self.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            # The pipeline passes the guidance value as is; the transformer scales it by 1000 inside.
            guidance = torch.full((latents.shape[0],), guidance_scale, device=latents.device, dtype=torch.float32)

        def call(prefix: str) -> torch.Tensor:
            return transformer(
                hidden_states=hidden,
                timestep=timestep.to(self.dtype) / 1000,
                guidance=guidance,
                pooled_projections=cond[f"{prefix}pooled_prompt_embeds"],
                encoder_hidden_states=cond[f"{prefix}prompt_embeds"],
                txt_ids=cond["txt_ids"],
                img_ids=cond["img_ids"],
                return_dict=False,
            )[0]

        velocity = call("")
        if true_cfg_scale > 1 and "negative_prompt_embeds" in cond:
            velocity = classifier_free_guidance(velocity, call("negative_"), true_cfg_scale)
        return velocity

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        pipe = self.pipeline
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        return pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
