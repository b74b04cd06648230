"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (image editing): Qwen-Image whose prompts are encoded by Qwen2.5-VL
together with the source images, and whose sequence carries the source images' latents after the generated ones,
each with its own grid in ``img_shapes``; only the generated tokens are denoised, scored and trained."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus
from PIL import Image

from trl_jagg.models.base import Conditioning, padded_prompt_batch, unpadded_prompt_rows
from trl_jagg.models.qwenimage import QwenImageAdapter


def resized_size(area: int, image: Image.Image) -> tuple[int, int]:
    """``(width, height)`` of ``image`` resized to about ``area`` pixels at its aspect ratio, sides multiples of 32
    (the pipelines' ``calculate_dimensions``)."""
    return pipeline_qwenimage_edit_plus.calculate_dimensions(area, image.width / image.height)


class QwenImageEditAdapter(QwenImageAdapter):
    """Adapter for :class:`~diffusers.QwenImageEditPipeline` (one source image per sample).

    Each source image is resized to about ``source_image_area`` pixels at its aspect ratio (the pipeline's 1024^2;
    training often uses less, as Flow-Factory's ``condition_image_size``), then encoded by the VAE at its mode and
    2x2-packed into ``reference_latents``. The prompt and the negative prompt are encoded by Qwen2.5-VL with the
    resized image in the pipeline's template, sample by sample (the text depends on the image). Every sample of a
    batch must give the same reference grids (:meth:`reference_sizes`): the backbone takes one tensor of tokens and
    one ``img_shapes`` for the batch, and cannot mask image tokens (its attention processor refuses an external
    mask), so the trainer draws each rollout from rows of one grid (a bucket, see ``EpochSeededRepeatSampler``).
    """

    pipeline_class = QwenImageEditPipeline
    edits_images = True
    prompts_see_images = True
    default_source_image_area: ClassVar[int] = 1024 * 1024  # calculate_dimensions(1024 * 1024, ...) in __call__

    def __init__(self, pipeline: QwenImageEditPipeline):
        super().__init__(pipeline)
        self.source_image_area = self.default_source_image_area

    def sources_of(self, sample: Image.Image | Sequence[Image.Image]) -> list[Image.Image]:
        """One sample's source images as a list."""
        return [sample] if isinstance(sample, Image.Image) else list(sample)

    @property
    def vision_area(self) -> int:
        """The area (pixels) of the images Qwen2.5-VL reads: the VAE's, as the pipeline passes them."""
        return self.source_image_area

    def vision_images(self, sources: list[Image.Image]) -> list[Image.Image]:
        """The images Qwen2.5-VL reads with the prompt, resized to :attr:`vision_area`, as the pipeline passes them."""
        return [self.pipeline.image_processor.resize(image, *resized_size(self.vision_area, image)[::-1])
                for image in sources]  # fmt: skip

    def reference_sizes(self, sample: Image.Image | Sequence[Image.Image]) -> tuple[tuple[int, int], ...]:
        """The ``(width, height)`` each of a sample's source images is VAE-encoded at.

        Raises:
            ValueError: an image so elongated that a side resizes to 0 (for the VAE or the vision encoder).
        """
        sources = self.sources_of(sample)
        for image in sources:
            for area in sorted({self.source_image_area, self.vision_area}):  # the smaller fails first
                size = resized_size(area, image)
                if min(size) == 0:
                    raise ValueError(
                        f"a {image.width}x{image.height} source image resizes to {size[0]}x{size[1]} at {area} pixels "
                        "(sides are multiples of 32): a side rounds to 0, which cannot be encoded. Crop or pad it to "
                        f"an aspect ratio of at most {area // 256}:1"
                        + (", or raise source_image_area." if area == self.source_image_area else ".")
                    )
        return tuple(resized_size(self.source_image_area, image) for image in sources)

    def encode_prompts_with_images(
        self, prompts: list[str], images: Sequence[Any], negative_prompt: str | None
    ) -> dict[str, torch.Tensor]:
        texts = {"": prompts} | (
            {"negative_": [negative_prompt] * len(prompts)} if negative_prompt is not None else {}
        )
        inputs: dict[str, torch.Tensor] = {}
        for prefix, branch in texts.items():
            rows = []
            for text, sample in zip(branch, images, strict=True):  # one at a time: the pipelines' batch is one
                embeds, mask = self.pipeline.encode_prompt(
                    [text], image=self.vision_images(self.sources_of(sample)), device=self.device
                )
                rows.extend(unpadded_prompt_rows(embeds, mask))
            batch = padded_prompt_batch(rows, self.prompt_mask_dtype)
            inputs |= {f"{prefix}{key}": value for key, value in batch.items() if value is not None}
        return inputs

    def encode_source_images(self, images: Sequence[Any], height: int, width: int) -> Conditioning:
        pipe = self.pipeline
        sizes = {self.reference_sizes(sample) for sample in images}
        if len(sizes) > 1:
            raise ValueError(
                f"The source images of one batch resize to different sizes {sorted(sizes)} (width, height) at "
                f"source_image_area={self.source_image_area}: the backbone takes one grid per batch. Batch rows "
                "whose images give the same sizes (DDPOJaggTrainer draws each rollout from one such bucket)."
            )
        per_image = list(zip(*(self.sources_of(sample) for sample in images), strict=True))
        latents, shapes = [], []
        for (image_width, image_height), column in zip(sizes.pop(), per_image):
            pixels = pipe.image_processor.preprocess(list(column), image_height, image_width).unsqueeze(2)
            encoded = pipe._encode_vae_image(pixels.to(self.device, pipe.vae.dtype), generator=None)  # the mode
            batch, channels, _, rows, columns = encoded.shape
            latents.append(pipe._pack_latents(encoded, batch, channels, rows, columns))
            shapes.append((1, rows // 2, columns // 2))
        return Conditioning({"reference_latents": torch.cat(latents, dim=1)}, {"reference_shapes": tuple(shapes)})


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Adapter for :class:`~diffusers.QwenImageEditPlusPipeline` (Qwen-Image-Edit-2509/2511: one or several source
    images per sample, "Picture 1: ...", "Picture 2: ..." in the prompt).

    As :class:`QwenImageEditAdapter`, except that Qwen2.5-VL reads each source image resized to its own smaller area
    (the pipeline's ``CONDITION_IMAGE_SIZE``, 384^2), and the pipeline's batch of one is lifted: samples are encoded
    one at a time and batched, as the other families' are.
    """

    pipeline_class = QwenImageEditPlusPipeline
    max_source_images = None
    default_source_image_area = pipeline_qwenimage_edit_plus.VAE_IMAGE_SIZE
    vision_image_area: ClassVar[int] = pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE

    @property
    def vision_area(self) -> int:
        return self.vision_image_area
