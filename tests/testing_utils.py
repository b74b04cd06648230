"""Helpers shared by several test modules (importable because pytest puts ``tests/`` on ``sys.path``)."""

from __future__ import annotations

import numpy as np
from PIL import Image

PROMPTS = ["a red circle", "a green square", "a blue circle", "a red square"]


def redness(prompts, images, **kwargs):
    """An independent reward: mean red minus mean of the other channels."""
    out = []
    for image in images:
        a = np.asarray(image, dtype=np.float32) / 255.0
        out.append(float(a[..., 0].mean() - a[..., 1:].mean()))
    return out


def solid(rgb: tuple[int, int, int], size: tuple[int, int] = (8, 8)) -> Image.Image:
    return Image.new("RGB", size, rgb)


def noise_image(seed: int = 0, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
