"""Flow-GRPO's text-rendering reward: OCR the image and compare with the text quoted in the prompt.

Recognition runs on ``rapidocr-onnxruntime`` (PP-OCRv4 detection + recognition, ONNX models shipped in the
wheel, CPU), the same model family as Flow-GRPO's PaddleOCR, so it works offline with real weights.
"""

from __future__ import annotations

import re
from typing import Any

from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.lazy import LazyModelReward, to_rgb
from trl_jagg.utils.prompts import prompt_text

# Straight or curly double quotes; Flow-GRPO prompts look like: a sign that says "OPEN 24 HOURS".
_QUOTED = re.compile(r"[\"“”](.+?)[\"“”]")


def quoted_text(prompt: str) -> str:
    """All double-quoted spans of ``prompt``, concatenated; raises ValueError if there is none."""
    spans = _QUOTED.findall(prompt)
    if not spans:
        raise ValueError(f"The OCR reward needs the text to render in double quotes in the prompt: {prompt!r}")
    return "".join(spans)


def normalize_text(text: str) -> str:
    """Lower case, all whitespace removed: the comparison ignores case and spacing, as Flow-GRPO's does."""
    return re.sub(r"\s+", "", text).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def text_match_score(target: str, recognized: str) -> float:
    """``1 - edit_distance / len(target)`` on normalised text, clamped to [0, 1]; 1.0 if the target occurs
    anywhere in the recognised text (extra text elsewhere in the image is not penalised, as in Flow-GRPO)."""
    target, recognized = normalize_text(target), normalize_text(recognized)
    if not target:
        raise ValueError("The quoted text to render is empty.")
    if target in recognized:
        return 1.0
    distance = min(edit_distance(recognized, target), len(target))
    return 1.0 - distance / len(target)


class OcrReward(LazyModelReward):
    """Text-rendering accuracy in [0, 1] of the text quoted in each prompt (see :func:`text_match_score`)."""

    def __init__(self, min_confidence: float = 0.5, engine_kwargs: dict[str, Any] | None = None) -> None:
        # rapidocr reads one image per call, so there is nothing to gain from larger batches.
        super().__init__("ocr", batch_size=1)
        self.min_confidence = min_confidence
        self.engine_kwargs = dict(engine_kwargs or {})

    def _load(self) -> None:
        from rapidocr_onnxruntime import RapidOCR

        self.engine = RapidOCR(text_score=self.min_confidence, **self.engine_kwargs)

    def recognize(self, image: Image.Image) -> str:
        """All text the OCR engine reads in ``image``, in reading order, concatenated."""
        self.load()
        # Passed as a PIL image: rapidocr converts it from RGB to the BGR its models expect (a numpy array
        # would be taken as BGR already).
        result, _ = self.engine(to_rgb(image))
        return "".join(text for _box, text, _confidence in result or [])

    def check_dataset(self, dataset: Any, *, name: str, edits_images: bool) -> None:
        """Before training: every prompt of ``dataset`` quotes non-blank text to render (an unquoted prompt would
        fail the first scoring, after a whole rollout)."""
        for i, value in enumerate(dataset["prompt"]):
            prompt = prompt_text(value, f"{name} row {i} 'prompt'")
            if not normalize_text("".join(_QUOTED.findall(prompt))):
                raise ValueError(
                    f"{name} row {i} 'prompt' quotes no text to render, which the OCR reward compares the image's "
                    f'text with: {prompt!r}. Put the text in double quotes (a sign that says "OPEN"), or drop the '
                    "row."
                )

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> list[float]:
        return [text_match_score(quoted_text(p), self.recognize(im)) for p, im in zip(prompts, images)]


@register_reward("ocr")
def ocr(min_confidence: float = 0.5, engine_kwargs: dict[str, Any] | None = None) -> OcrReward:
    """Flow-GRPO's OCR reward on rapidocr-onnxruntime (CPU, ~0.5 s per 512x256 image).

    Args:
        min_confidence: Recognised lines below this confidence are dropped (rapidocr's ``text_score``).
        engine_kwargs: Passed to ``rapidocr_onnxruntime.RapidOCR`` (e.g. ``{"det_use_cuda": True}``).
    """
    return OcrReward(min_confidence, engine_kwargs)
