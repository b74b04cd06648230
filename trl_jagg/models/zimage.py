"""Z-Image (Tongyi-MAI/Z-Image, Z-Image-Turbo): a Qwen3 text encoder behind its chat template, prompts of their own
lengths, a single-stream DiT taking lists of latent images, and the reversed time ``(1000 - t) / 1000``."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ZImagePipeline

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter, padded_prompt_batch, unpadded_prompt_rows


class ZImageAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.ZImagePipeline`.

    Differs from the base in four ways. The backbone takes one ``(channels, 1, h, w)`` latent and one
    ``(tokens, dim)`` prompt embedding per sample and predicts ``-v`` at time ``(1000 - t) / 1000``. Prompts keep
    their own lengths (the pipeline drops the padding), so a batch is right-padded with a mask that is removed again
    at each call. ``guidance_scale`` ``g`` is a CFG scale applied as ``v_c + g (v_c - v_u)``, i.e. the scale
    ``1 + g`` of :func:`~trl_jagg.models.base.classifier_free_guidance`, on from ``g > 0`` (Z-Image-Turbo samples with
    0); both branches run in one call on ``2B`` lists (unconditional half first, where the pipeline puts the
    conditional one first: rows are independent). The pipeline's ``cfg_truncation`` and ``cfg_normalization`` keep
    their defaults (off).
    """

    pipeline_class = ZImagePipeline
    guidance_is_cfg = True
    packed_latents = False  # the transformer patchifies latent images itself
    prompt_mask_dtype = torch.bool

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        rows, _ = self.pipeline.encode_prompt(
            list(prompts),  # the pipeline rewrites the list it is given into chat-templated prompts
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length or 512,  # the pipeline's default
        )
        return padded_prompt_batch(rows, self.prompt_mask_dtype)

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float) -> float:
        # v_c + g (v_c - v_u) = v_u + (1 + g)(v_c - v_u).
        return super().cfg_scale(guidance_scale, true_cfg_scale) + 1

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
        frames = list(latents.to(self.dtype).unsqueeze(2).unbind(0))  # one (C, 1, h, w) latent per sample
        time = (1000 - timestep) / 1000  # float32, as the pipeline passes it

        def branch_inputs(prefix: str) -> dict[str, Any]:
            # Lists of per-sample inputs: each prompt without its padding, as the pipeline passes them.
            mask = cond.get(f"{prefix}prompt_embeds_mask")
            return {"x": frames, "t": time, "cap_feats": unpadded_prompt_rows(cond[f"{prefix}prompt_embeds"], mask)}

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            out = transformer(**inputs, return_dict=False)[0]
            return -torch.stack(out).squeeze(2)  # the backbone predicts noise minus data

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip
