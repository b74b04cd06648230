"""DDPO's JPEG compressibility rewards: the size of the image saved as JPEG, in kilobytes."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from PIL import Image

from trl_jagg.rewards.base import RewardFunc, register_reward
from trl_jagg.rewards.lazy import check_pairs, to_rgb

JPEG_QUALITY = 95  # DDPO's setting


def jpeg_size_kb(image: Image.Image, quality: int = JPEG_QUALITY) -> float:
    """Size in kB (1000 bytes) of ``image`` encoded as an RGB JPEG at ``quality``."""
    buffer = io.BytesIO()
    to_rgb(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = JPEG_QUALITY) -> RewardFunc:
    """Reward = JPEG size in kB: favours detailed, high-frequency images (DDPO's incompressibility task)."""

    # The inner function is named like the factory because its __name__ becomes the metric name.

    def jpeg_incompressibility(prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        check_pairs(prompts, images)
        return [jpeg_size_kb(image, quality) for image in images]

    return jpeg_incompressibility


@register_reward("jpeg_compressibility")
def jpeg_compressibility(quality: int = JPEG_QUALITY) -> RewardFunc:
    """Reward = minus the JPEG size in kB: favours smooth, simple images (DDPO's compressibility task)."""

    def jpeg_compressibility(prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        check_pairs(prompts, images)
        return [-jpeg_size_kb(image, quality) for image in images]

    return jpeg_compressibility
