"""What a reward server accepts from an untrusted client: images checked from their header before any pixel is
decoded (format, pixel count). Used by the reward server's app (:mod:`~trl_jagg.rewards.server_app`); the client
side is :mod:`~trl_jagg.rewards.remote`."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MAX_PIXELS = 4096 * 4096
"""Default pixel limit per decoded image (width x height): a few-KB PNG may claim gigabytes of pixels."""


class RejectedImage(ValueError):
    """An image :func:`open_image` or :func:`load_image` refuses; ``status`` is the HTTP status a server answers with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def open_image(data: Any, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The image ``data`` holds, for untrusted input: base64 of a PNG, JPEG or WEBP image of at most ``max_pixels``
    pixels, checked from its header; no pixel is decoded yet (see :func:`load_image`), so that a server can bound
    the pixels of a whole request before decoding any.

    Raises:
        RejectedImage: not base64 (status 400), another format (415), too many pixels (413).
    """
    if not isinstance(data, str):
        raise RejectedImage(f"is a {type(data).__name__}, not a base64 string", 400)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise RejectedImage("is not valid base64", 400) from None
    try:
        # `formats` stops PIL from trying its other plugins (EPS would reach Ghostscript where installed).
        image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:  # PIL's own limit, checked from the header as ours is
        raise RejectedImage(
            f"claims more than {2 * Image.MAX_IMAGE_PIXELS} pixels (a decompression bomb)", 413
        ) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise RejectedImage(f"is not a {', '.join(IMAGE_FORMATS)} image", 415) from None
    width, height = image.size
    if width * height > max_pixels:
        raise RejectedImage(f"has {width} x {height} pixels, more than the {max_pixels} allowed", 413)
    return image


def load_image(image: Image.Image) -> Image.Image:
    """Decode the pixels of an image from :func:`open_image`.

    Raises:
        RejectedImage: truncated or corrupt data (status 400).
    """
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise RejectedImage("could not be decoded (truncated or corrupt)", 400) from None
    return image
