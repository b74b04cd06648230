"""Stable Diffusion 3 / 3.5 (Medium, Large, Large Turbo): three text encoders, latent images (no packing), raw
scheduler timesteps and true classifier-free guidance scaled by ``guidance_scale``.

SD3.5 checkpoints use the same :class:`~diffusers.StableDiffusion3Pipeline` class, so this adapter serves both.
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter


class SD3Adapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.StableDiffusion3Pipeline` (SD3 and SD3.5).

    Differs from the base in three ways: the scheduler builds its own sigmas (``linspace_sigmas = False``), the
    backbone takes ``(batch, 16, h, w)`` latent images (``packed_latents = False``), and ``guidance_scale`` is the
    CFG scale.
    """

    pipeline_class = StableDiffusion3Pipeline
    linspace_sigmas = False
    guidance_is_cfg = True
    packed_latents = False

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        # CLIP-L and CLIP-G token embeddings (zero-padded to T5's width) stacked before T5's; pooled = both CLIPs'.
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length or 256,  # the pipeline's default
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

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

        def branch_inputs(prefix: str) -> dict[str, torch.Tensor]:
            # SD3's timestep embedding takes the scheduler timestep (0..1000) as is.
            return {
                "hidden_states": hidden,
                "timestep": timestep,
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
                "pooled_projections": cond[f"{prefix}pooled_prompt_embeds"],
            }

        def call(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return transformer(**inputs, return_dict=False)[0]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip
