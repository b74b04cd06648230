"""FLUX.2 dev and klein: a text encoder's hidden states stacked per token behind its chat template (dev: Mistral-3's
10, 20, 30; klein: Qwen3's 9, 18, 27), 4-D position ids, 2x2-patchified latents normalised by the VAE's batch norm,
and an empirical shift fit. Dev embeds its guidance in the backbone; klein's base model takes CFG instead."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter


class Flux2Adapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.Flux2Pipeline` (FLUX.2 dev).

    Guidance-distilled: ``guidance_scale`` is the backbone's embedded guidance, one call per step as in the pipeline,
    which has no negative prompt (``true_cfg_scale`` must stay 1). The pipeline's ``encode_prompt`` renders each
    prompt behind its system message through Mistral's chat template, padded to ``max_sequence_length``. The
    schedule's shift ``mu`` is the pipeline's ``compute_empirical_mu`` of the sequence length and the number of steps.
    """

    pipeline_class = Flux2Pipeline

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        embeds, _ = self.pipeline.encode_prompt(
            list(prompts), device=self.device, max_sequence_length=max_sequence_length or 512
        )
        return {"prompt_embeds": embeds}

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float) -> float:
        if true_cfg_scale > 1:
            raise ValueError(
                f"true_cfg_scale={true_cfg_scale}: {self.pipeline_class.__name__} has no negative prompt nor "
                "classifier-free guidance; its guidance_scale is the embedded guidance. Set true_cfg_scale=1."
            )
        return 1.0

    def schedule_shift(self, num_steps: int, height: int, width: int) -> float:
        return compute_empirical_mu(self.image_seq_len(height, width), num_steps)

    def shared_inputs(self, per_sample: dict[str, torch.Tensor], height: int, width: int) -> dict[str, Any]:
        # (time, row, column, layer) ids: text tokens along the last axis, image tokens on the latent grid.
        text_ids = self.pipeline._prepare_text_ids(per_sample["prompt_embeds"][:1])
        return {"txt_ids": text_ids.to(self.device), "img_ids": self._latent_ids(1, height, width)}

    def _latent_ids(self, batch_size: int, height: int, width: int) -> torch.Tensor:
        scale = self.pipeline.vae_scale_factor * 2
        grid = torch.empty(batch_size, 1, height // scale, width // scale, device="meta")  # only the shape is read
        return self.pipeline._prepare_latent_ids(grid).to(self.device)

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
        guidance = self.embedded_guidance(latents.shape[0], guidance_scale)  # klein: None

        def branch_inputs(prefix: str) -> dict[str, Any]:
            return {
                "hidden_states": hidden,
                "timestep": timestep.to(self.dtype) / 1000,
                "guidance": guidance,
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
            }

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            # Both branches have the same text length (padded to max_sequence_length): the ids are shared.
            return transformer(**inputs, txt_ids=cond["txt_ids"], img_ids=cond["img_ids"], return_dict=False)[0]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # Tokens back onto the grid of 2x2 patches, the batch norm undone, the patches unfolded, then the VAE.
        pipe, vae = self.pipeline, self.pipeline.vae
        grid = pipe._unpack_latents_with_ids(latents, self._latent_ids(len(latents), height, width))
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(grid)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid)
        return vae.decode(pipe._unpatchify_latents(grid * std + mean).to(vae.dtype), return_dict=False)[0]


class Flux2KleinAdapter(Flux2Adapter):
    """Adapter for :class:`~diffusers.Flux2KleinPipeline` (FLUX.2 klein, base and step-distilled): FLUX.2 dev's
    adapter with Qwen3 prompts and no guidance embedding.

    ``guidance_scale`` is a CFG scale (``v_u + g (v_c - v_u)``, on from ``g > 1``; both branches in one backbone
    call on ``2B``, where the pipeline makes two) except for step-distilled checkpoints (``is_distilled``), which
    ignore it as the pipeline does. The pipeline's negative prompt is always ``""``: set ``negative_prompt=""`` to
    match it.
    """

    pipeline_class = Flux2KleinPipeline
    guidance_is_cfg = True

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float) -> float:
        if self.pipeline.config.is_distilled:
            return 1.0
        return FlowMatchingAdapter.cfg_scale(self, guidance_scale, true_cfg_scale)  # CFG, not dev's embedded guidance
