"""Qwen-Image: a Qwen2.5-VL text encoder behind a prompt template, a text mask, 2x2-packed latents described by
``img_shapes``, true CFG with norm rescaling, and a 5-D (video) VAE normalised by per-channel mean and std."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImagePipeline

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter, padded_prompt_batch, unpadded_prompt_rows


class QwenImageAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.QwenImagePipeline`.

    The two CFG branches run as one backbone call (the pipeline makes two): the negative prompt's embedding need not
    have the prompts' length, so both are right-padded to the longer and masked. The guided velocity is rescaled per
    token to the conditional one's norm. The text mask (``prompt_embeds_mask``) is present only when some prompt of
    the batch is padded; without it the backbone attends to every text token, exactly as the pipeline passes
    ``None``. Qwen-Image's schedule needs at least 2 steps (``shift_terminal`` turns a single sigma into NaN).
    """

    pipeline_class = QwenImagePipeline
    prompt_mask_dtype = torch.long  # the pipeline's mask

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        embeds, mask = self.pipeline.encode_prompt(
            prompts,
            device=self.device,
            max_sequence_length=max_sequence_length or 512,  # the pipeline's default
        )
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def batch_branches(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        # The negative prompt may have another length than the prompts: both right-padded to the longer, masked.
        rows = [
            row
            for branch in (first, second)
            for row in unpadded_prompt_rows(branch["encoder_hidden_states"], branch["encoder_hidden_states_mask"])
        ]
        text = padded_prompt_batch(rows, self.prompt_mask_dtype)
        rest = {k: v for k, v in first.items() if k not in ("encoder_hidden_states", "encoder_hidden_states_mask")}
        batched = super().batch_branches(rest, second)
        return batched | {
            "encoder_hidden_states": text["prompt_embeds"],
            "encoder_hidden_states_mask": text["prompt_embeds_mask"],
        }

    def shared_inputs(self, per_sample: dict[str, torch.Tensor], height: int, width: int) -> dict[str, Any]:
        # One (frames, rows, columns) grid of packed latent tokens; the per-batch list is built at each call.
        scale = self.pipeline.vae_scale_factor * 2
        return {"img_shape": (1, height // scale, width // scale)}

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
        hidden = self.with_reference_tokens(latents.to(self.dtype), cond)  # Qwen-Image-Edit appends the references
        tokens = latents.shape[1]
        guidance = self.embedded_guidance(latents.shape[0], guidance_scale)

        def branch_inputs(prefix: str) -> dict[str, Any]:
            return {
                "hidden_states": hidden,
                "timestep": timestep.to(self.dtype) / 1000,
                "guidance": guidance,
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
                "encoder_hidden_states_mask": cond.get(f"{prefix}prompt_embeds_mask"),
            }

        # One (frames, rows, columns) grid per image of the sequence: the generated one, then the references'.
        shapes = [cond["img_shape"], *cond.get("reference_shapes", ())]

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            rows = inputs["hidden_states"].shape[0]
            return transformer(**inputs, img_shapes=[shapes] * rows, return_dict=False)[0][:, :tokens]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad, rescale_to_cond_norm=True,
        )  # fmt: skip

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # The VAE is a causal video VAE: latents (batch, channels, 1 frame, h, w), normalised per channel.
        vae = self.pipeline.vae
        latents = self.unpack_latents(latents, height, width).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
        # Divided by the reciprocal, as the pipeline does, for identical rounding.
        return vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
