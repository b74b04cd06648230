"""Flux (FLUX.1-dev / schnell and fine-tunes): packed 2x2 latents, ``img_ids``/``txt_ids``, embedded guidance."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxPipeline

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter


class FluxAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.FluxPipeline`."""

    pipeline_class = FluxPipeline

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        kwargs = {"max_sequence_length": max_sequence_length} if max_sequence_length else {}
        embeds, pooled, _ = self.pipeline.encode_prompt(prompt=prompts, prompt_2=None, device=self.device, **kwargs)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def shared_inputs(self, per_sample: dict[str, torch.Tensor], height: int, width: int) -> dict[str, Any]:
        # Image token ids depend only on the resolution (packed latent grid), text ids (zeros) only on the length.
        pipe, embeds = self.pipeline, per_sample["prompt_embeds"]
        grid_h = height // (pipe.vae_scale_factor * 2)
        grid_w = width // (pipe.vae_scale_factor * 2)
        img_ids = pipe._prepare_latent_image_ids(1, grid_h, grid_w, self.device, embeds.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=embeds.dtype)
        return {"txt_ids": txt_ids, "img_ids": img_ids}

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
        hidden = self.with_reference_tokens(latents.to(self.dtype), cond)  # Kontext appends the reference image
        tokens = latents.shape[1]
        guidance = self.embedded_guidance(latents.shape[0], guidance_scale)

        def branch_inputs(prefix: str) -> dict[str, Any]:
            return {
                "hidden_states": hidden,
                "timestep": timestep.to(self.dtype) / 1000,
                "guidance": guidance,
                "pooled_projections": cond[f"{prefix}pooled_prompt_embeds"],
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
            }

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            # Both branches have the same text length (T5 pads to max_sequence_length): the ids are shared. Only the
            # generated tokens are denoised (Kontext's reference tokens follow them).
            out = transformer(**inputs, txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]
            return out[:, :tokens]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip
