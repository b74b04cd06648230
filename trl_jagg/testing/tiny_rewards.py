"""Tiny random reward models built offline from configs, saved in the layouts the rewards load from a Hub id.

``geneval`` loads an OWLv2 detector and a CLIP model with ``from_pretrained``; ``hpsv3`` builds its Qwen2-VL from a
base model's config and processor and loads every weight from the published ``HPSv3.safetensors``. These builders
write the same files with widths of a few dozen channels, so that the tests and the examples' ``--tiny`` run the
rewards' real code path (processors, detector or backbone, head, rules) in well under a second per image:

    >>> detector_dir, clip_dir = save_tiny_geneval_models("/tmp/tiny-geneval")
    >>> reward = load_reward_funcs("geneval", {"geneval": {"detector_id": detector_dir, "clip_id": clip_dir}})[0]

The weights are random (seeded): the scores exercise the code, not a judgement of the image.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.testing.components import mrope_section
from trl_jagg.testing.tokenizers import build_clip_tokenizer, build_qwen2_tokenizer

TINY_HPSV3_PIXELS = 56 * 56
"""The tiny HPSv3 processor's pixel budget (HPSv3's is 256 x 28 x 28): 4 x 4 patches, 4 image tokens."""

# Qwen2-VL's chat layout reduced to what HPSv3's one user message needs (the released template adds a system turn).
QWEN2VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_geneval_models(folder: str | os.PathLike[str], *, seed: int = 0) -> tuple[str, str]:
    """Save a tiny random ``Owlv2ForObjectDetection`` and ``CLIPModel`` (one layer of width 16 per tower, 32 x 32 px
    inputs in 8 x 8 patches: 16 boxes) with their processors under ``folder``.

    Returns:
        ``(detector_dir, clip_dir)``: the ``detector_id`` and ``clip_id`` of the ``geneval`` reward.
    """
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        Owlv2Config,
        Owlv2ForObjectDetection,
        Owlv2ImageProcessor,
        Owlv2Processor,
    )  # fmt: skip

    tokenizer = build_clip_tokenizer(model_max_length=16)
    text = dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)  # fmt: skip
    detector_dir, clip_dir = os.path.join(folder, "owlv2"), os.path.join(folder, "clip")
    torch.manual_seed(seed)
    detector = Owlv2ForObjectDetection(Owlv2Config(text_config=text, vision_config=vision, projection_dim=16))
    detector.save_pretrained(detector_dir)
    Owlv2Processor(Owlv2ImageProcessor(size={"height": 32, "width": 32}), tokenizer).save_pretrained(detector_dir)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(clip_dir)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor, tokenizer).save_pretrained(clip_dir)
    return detector_dir, clip_dir


@dataclass
class TinyHPSv3:
    """A tiny HPSv3 as :func:`save_tiny_hpsv3` writes it: the ``hpsv3`` reward's ``base_model`` and ``checkpoint``,
    and the backbone and head it holds (for tests that recompute the score by hand)."""

    base_model: str
    checkpoint: str
    model: Any
    head: dict[str, torch.Tensor]


def save_tiny_hpsv3(
    folder: str | os.PathLike[str], *, vocab_words: Sequence[str] = (), pixels: int = TINY_HPSV3_PIXELS, seed: int = 0
) -> TinyHPSv3:
    """Save a tiny random Qwen2-VL (one text layer of width 32, one vision block) and HPSv3 head under ``folder``:
    ``base/`` (config and processor, pixel budget ``pixels``) and ``HPSv3.safetensors`` in the published key layout
    (``visual.*``, ``model.*``, ``lm_head.*`` of the older transformers the ``hpsv3`` package pins, and ``rm_head.*``),
    the embeddings one row larger than the tokenizer for the ``<|Reward|>`` token the reward adds.

    Args:
        vocab_words: words that must be single tokens (see :func:`~.tokenizers.build_qwen2_tokenizer`).
        pixels: the processor's ``min_pixels`` = ``max_pixels``; the reward's own ``pixels`` overrides it per call.
    """
    from safetensors.torch import save_file
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )  # fmt: skip

    tokenizer = build_qwen2_tokenizer(list(vocab_words))
    text = dict(vocab_size=len(tokenizer) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(16)},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    base = os.path.join(folder, "base")
    config.save_pretrained(base)
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels), tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(), chat_template=QWEN2VL_CHAT_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(base)
    # Scaled so that the ReLUs pass part of their inputs and mu varies with the hidden state.
    head = {"rm_head.0.weight": torch.randn(1024, 32) / 6, "rm_head.0.bias": torch.randn(1024) / 6,
            "rm_head.3.weight": torch.randn(16, 1024) / 32, "rm_head.3.bias": torch.randn(16) / 6,
            "rm_head.5.weight": torch.randn(2, 16) / 4, "rm_head.5.bias": torch.randn(2)}  # fmt: skip
    published = {
        key.replace("model.visual.", "visual.").replace("model.language_model.", "model."): value.contiguous()
        for key, value in model.state_dict().items()
    }
    checkpoint = os.path.join(folder, "HPSv3.safetensors")
    save_file({**published, **head}, checkpoint)
    return TinyHPSv3(base, checkpoint, model, head)


# GenEval's metadata (the layout of its `evaluation_metadata.jsonl` and of Flow-GRPO's `train_metadata.jsonl`), one
# row per kind of clause the rules treat apart, in words that are single tokens of the tiny pipelines' tokenizers.
TINY_GENEVAL_METADATA: tuple[dict[str, Any], ...] = (
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "counting", "include": [{"class": "dog", "count": 2}], "exclude": [{"class": "dog", "count": 3}],
     "prompt": "a photo of two dogs"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {"tag": "position", "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1,
                                                                     "position": ["left of", 0]}],
     "prompt": "a photo of a cat left of a dog"},
)  # fmt: skip
"""GenEval metadata rows (``tag``, ``include``, ``exclude``, ``prompt``) for tiny runs: presence, counting with an
``exclude`` clause, colour and position; the examples' ``--tiny`` writes them to a ``.jsonl`` file."""
