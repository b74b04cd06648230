"""Rewards computed from pixels and prompt text alone: no weights, exact, instant. For demos and tests."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from PIL import Image

from trl_jagg.rewards.base import RewardFunc, register_reward
from trl_jagg.rewards.lazy import check_pairs, to_rgb

COLOR_CHANNELS = {"red": 0, "green": 1, "blue": 2}
_COLOR_WORD = re.compile(r"\b(red|green|blue)\b", re.IGNORECASE)
# ITU-R BT.601 luma weights, the ones PIL uses for its "L" conversion.
_LUMA_WEIGHTS = np.array([0.299, 0.587, 0.114])


def _pixels(image: Image.Image) -> np.ndarray:
    """``(H, W, 3)`` float64 array with channels in [0, 1]."""
    return np.asarray(to_rgb(image), dtype=np.float64) / 255.0


def _luma(image: Image.Image, reward: str = "", min_size: int = 1) -> np.ndarray:
    """``(H, W)`` BT.601 luma in [0, 1]; an image under ``min_size`` pixels a side is a ``ValueError`` naming
    ``reward``."""
    luma = _pixels(image) @ _LUMA_WEIGHTS
    height, width = luma.shape
    if height < min_size or width < min_size:
        raise ValueError(f"{reward} needs images of at least {min_size} x {min_size} pixels, got {width} x {height}.")
    return luma


def _per_image_reward(name: str, score: Callable[[Image.Image], float]) -> RewardFunc:
    """A reward named ``name`` that scores each image with ``score`` and ignores the prompt."""

    def reward(prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        check_pairs(prompts, images)
        return [score(image) for image in images]

    reward.__name__ = reward.__qualname__ = name
    return reward


def named_color(prompt: str) -> str | None:
    """The first of "red", "green", "blue" that ``prompt`` names as a whole word (any case), else ``None``."""
    match = _COLOR_WORD.search(prompt)
    return match.group(1).lower() if match else None


def color_margin(image: Image.Image, color: str) -> float:
    """Mean over pixels of ``target channel - max(other two channels)``, in [-1, 1].

    Using the max of the others (not their mean) gives no credit to mixed colours: yellow scores 0 for red.
    """
    pixels = _pixels(image)
    channel = COLOR_CHANNELS[color]
    others = np.delete(pixels, channel, axis=-1).max(axis=-1)
    return float((pixels[..., channel] - others).mean())


@register_reward("prompt_color")
def prompt_color() -> RewardFunc:
    """The demo's reward: how much the image is dominated by the colour its prompt names.

    For a prompt naming "red", "green" or "blue" (whole word, case-insensitive; the first one if several), the
    score is :func:`color_margin` for that colour; a prompt naming none scores 0.0. A policy that draws saturated
    colours at random, ignoring the prompt, scores about -margin/3 on average (grey or blank images score 0, a
    shortcut to watch for), so a reward rising well above 0 means the model reads the colour word.
    """

    def prompt_color(prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        check_pairs(prompts, images)
        scores = []
        for prompt, image in zip(prompts, images):
            color = named_color(prompt)
            scores.append(0.0 if color is None else color_margin(image, color))
        return scores

    return prompt_color


@register_reward("brightness")
def brightness() -> RewardFunc:
    """Mean luminance of the image in [0, 1] (BT.601 luma); the prompt is ignored. A sanity-check reward."""
    return _per_image_reward("brightness", lambda image: float(_luma(image).mean()))


def high_frequency_energy(image: Image.Image) -> float:
    """Mean over the interior pixels of ``|luma - mean of its 3 x 3 neighbourhood|``, in [0, 8/9].

    The part of the image a 3 x 3 box blur removes: 0 for a flat image, 4/9 for a one-pixel checkerboard of black
    and white. Border pixels, which lack a full neighbourhood, are left out.
    """
    luma = _luma(image, "high_frequency", min_size=3)
    height, width = luma.shape
    box = sum(luma[i : height - 2 + i, j : width - 2 + j] for i in range(3) for j in range(3)) / 9.0
    return float(np.abs(luma[1:-1, 1:-1] - box).mean())


@register_reward("high_frequency")
def high_frequency() -> RewardFunc:
    """Fine detail: :func:`high_frequency_energy`, the luma a 3 x 3 box blur removes; the prompt is ignored.

    Edges, texture and grain score; flat areas do not. A flow model settles such detail in its last, low-noise
    denoising steps, so this is the demo's second task (``trl-jagg bench quality --task detail``): a rollout whose
    trained steps are only the first, high-noise ones must reach it through the shared weights.
    """
    return _per_image_reward("high_frequency", high_frequency_energy)


def horizontal_detail_energy(image: Image.Image) -> float:
    """Mean ``|luma step|`` between vertical neighbours minus that between horizontal neighbours, in [-1, 1].

    Horizontal edges and stripes score (1 for one-pixel rows alternating black and white), vertical ones count
    against (-1 for such columns); a flat image or an isotropic texture scores about 0.
    """
    luma = _luma(image, "horizontal_detail", min_size=2)
    return float(np.abs(np.diff(luma, axis=0)).mean() - np.abs(np.diff(luma, axis=1)).mean())


@register_reward("horizontal_detail")
def horizontal_detail() -> RewardFunc:
    """Oriented detail: :func:`horizontal_detail_energy`, horizontal edges and stripes against vertical ones; the
    prompt is ignored.

    The third task of ``trl-jagg bench quality`` (``--task stripes``): unlike ``high_frequency`` it is far from its
    ceiling on the demo's model (about +0.001 before training, against 1 for the ideal image), so no objective
    saturates it within the race's 100 steps.
    """
    return _per_image_reward("horizontal_detail", horizontal_detail_energy)
