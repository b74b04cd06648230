"""The OCR text-rendering reward, with rapidocr-onnxruntime's real shipped models on PIL-rendered text."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw, ImageFont

import trl_jagg.rewards as rewards
from trl_jagg.rewards.ocr import edit_distance, quoted_text, text_match_score


def render(text: str, size: int = 288) -> Image.Image:
    """Black text on a white square, in Pillow's bundled font (no system fonts needed). Square and small because
    the detector upscales the short side to 736 px: a wide banner would cost several times more."""
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((16, size // 2 - 24), text, fill="black", font=ImageFont.load_default(size=40))
    return image


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3), ("flaw", "lawn", 2), ("hello", "hello", 0)],
)
def test_edit_distance(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a)


def test_text_match_score_hand_computed():
    assert text_match_score("HELLO JAGG", "hello jagg") == 1.0  # case and spaces ignored
    assert text_match_score("JAGG", "SALE: JAGG 50%") == 1.0  # contained in more text
    assert text_match_score("HELLO JAGG", "HELLO JAGS") == pytest.approx(1 - 1 / 9)  # 9 letters, 1 wrong
    assert text_match_score("HELLO", "") == 0.0
    assert text_match_score("AB", "XYZXYZ") == 0.0  # distance clamped to the target length


def test_quoted_text():
    assert quoted_text('a sign that says "HELLO JAGG" in neon') == "HELLO JAGG"
    assert quoted_text("a poster “OPEN” at night") == "OPEN"
    with pytest.raises(ValueError, match="double quotes"):
        quoted_text("a sign with no text")


def test_ocr_reward_reads_rendered_text_with_the_real_models():
    pytest.importorskip("rapidocr_onnxruntime")
    hello, blank = render("HELLO JAGG"), Image.new("RGB", (288, 288), "white")
    prompts = ['a sign that says "HELLO JAGG"', 'a sign that says "GOODBYE WORLD"', 'a sign that says "HELLO JAGG"']
    scores = rewards.ocr()(prompts, [hello, hello, blank])  # about 0.5-1 s per image on a CPU core
    assert scores[0] == pytest.approx(1.0)  # read correctly
    assert scores[1] < 0.5  # wrong text
    assert scores[2] == 0.0  # nothing written
