"""Stable Diffusion 3 / 3.5 (Medium, Large, Large Turbo): three text encoders, latent images (no packing), raw
scheduler timesteps and true classifier-free guidance scaled by ``guidance_scale``.

SD3.5 checkpoints use the same :class:`~diffusers.StableDiffusion3Pipeline` class, so this adapter serves both.
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusion3Pipeline

from .base import Conditioning, FlowMatchingAdapter


class SD3Adapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.StableDiffusion3Pipeline` (SD3 and SD3.5).

    Differs from the base in three ways: the scheduler builds its own sigmas (``linspace_sigmas = False``), the
    backbone takes ``(batch, 16, h, w)`` latent images (``packed_latents = False``), and ``guidance_scale`` is the
    CFG scale. As in the pipeline, both CFG branches run in one backbone call on a batch of ``2B``, unconditional
    half first, and the gradient flows through both halves; with ``uncond_grad=False`` the conditional half runs
    with a graph and the unconditional one separately without.
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

        def call(prefixes: list[str]) -> torch.Tensor:
            # SD3's timestep embedding takes the scheduler timestep (0..1000) as is.
            return transformer(
                hidden_states=torch.cat([hidden] * len(prefixes)),
                timestep=torch.cat([timestep] * len(prefixes)),
                encoder_hidden_states=torch.cat([cond[f"{p}prompt_embeds"] for p in prefixes]),
                pooled_projections=torch.cat([cond[f"{p}pooled_prompt_embeds"] for p in prefixes]),
                return_dict=False,
            )[0]

        # Both branches in one call on 2B, unconditional half first, as the pipeline does.
        return self.guided_velocity(
            call, cond, guidance_scale, true_cfg_scale, uncond_grad=uncond_grad, batched=("negative_", "")
        )
