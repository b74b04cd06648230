"""FLUX.1 Kontext (image editing): Flux whose sequence carries the source image's latents as extra tokens at
position-id frame 1; only the generated tokens are denoised, scored and trained."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from trl_jagg.models.base import Conditioning
from trl_jagg.models.flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    """Adapter for :class:`~diffusers.FluxKontextPipeline`.

    Each sample's source image is resized to the output size, encoded by the VAE at its mode (no noise drawn, as
    the pipeline's ``sample_mode="argmax"``), normalised and 2x2-packed into ``reference_latents``; its position ids
    are the image grid's with the first axis set to 1. The backbone sees ``[generated, reference]`` tokens and its
    output is cut to the generated ones. This is the pipeline called with ``_auto_resize=False`` on a source image
    of the output size (its default resizes the source to one of Kontext's preferred resolutions first).
    """

    pipeline_class = FluxKontextPipeline
    edits_images = True

    def encode_source_images(self, images: Sequence[Image.Image], height: int, width: int) -> Conditioning:
        pipe = self.pipeline
        pixels = pipe.image_processor.preprocess(list(images), height, width).to(self.device, pipe.vae.dtype)
        latents = pipe._encode_vae_image(pixels, generator=None)  # argmax: the mode, no noise drawn
        batch, channels, rows, columns = latents.shape
        return Conditioning({"reference_latents": pipe._pack_latents(latents, batch, channels, rows, columns)})

    def source_call_kwargs(self, height: int, width: int) -> dict[str, Any]:
        # The pipeline's default resizes the source to one of Kontext's preferred resolutions first.
        return {"max_area": height * width, "_auto_resize": False}

    def shared_inputs(self, per_sample: dict[str, torch.Tensor], height: int, width: int) -> dict[str, Any]:
        inputs = super().shared_inputs(per_sample, height, width)
        if "reference_latents" in per_sample:  # the reference has the output's grid, at frame 1
            reference_ids = inputs["img_ids"].clone()
            reference_ids[:, 0] = 1
            inputs["img_ids"] = torch.cat([inputs["img_ids"], reference_ids])
        return inputs
