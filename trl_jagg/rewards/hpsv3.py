"""HPSv3 (Ma et al. 2025, MizzenAI/HPSv3) in process on transformers: a Qwen2-VL-7B-Instruct backbone whose hidden state
at a special ``<|Reward|>`` token goes through a small MLP head (``mu``, ``sigma``; the reward is ``mu``).

The ``hpsv3`` package pins old transformers; this loads the published ``HPSv3.safetensors`` into transformers'
``Qwen2VLForConditionalGeneration`` (its ``visual.*`` / ``model.*`` keys renamed to ``model.visual.*`` /
``model.language_model.*``, as the reference inferencer does) and the head, strictly. The prompt, the reward token
and the fixed 256 x 28 x 28 pixel budget are the reference's (read in Pref-GRPO's copy of HPSv3,
``fastvideo/models/hpsv3/`` @3e787f6: ``dataset/data_collator_qwen.py:11-46``, ``model/qwen2vl_trainer.py:116-124,
250-263``, ``inference.py:56-66, 115-140``). Images are resized by transformers' Qwen2-VL image processor, not
``qwen_vl_utils`` (same pixel budget; the resampling may differ slightly). Not compared with the released weights
here (no network): treat the first real run as a check.
"""

from __future__ import annotations

import torch
from PIL import Image
from torch import nn

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.lazy import LazyModelReward, download

HPSV3_REPO = "MizzenAI/HPSv3"
HPSV3_FILE = "HPSv3.safetensors"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28
"""The reference's min_pixels = max_pixels: every image is resized to about 448 x 448 pixels."""

# The reference's instruction (its text is the model's input, kept as written, trailing spaces included).
HPSV3_INSTRUCTION = (
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
RATING_PROMPT = f"\nPlease provide the overall ratings of this image: {REWARD_TOKEN}\n\nEND\n"


def rank_head(hidden_size: int, output_dim: int = 2) -> nn.Sequential:
    """HPSv3's ``ranknet`` head (float32): hidden state -> 1024 -> 16 -> (mu, sigma)."""
    return nn.Sequential(
        nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
        nn.Linear(16, output_dim),
    )  # fmt: skip


def transformers_key(key: str) -> str:
    """A key of the published checkpoint in transformers' Qwen2-VL layout."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key[len("model.") :]
    return key


class HPSv3Reward(LazyModelReward):
    """HPSv3's ``mu`` for each (prompt, image) pair; see :func:`hpsv3`."""

    def __init__(
        self,
        base_model: str = HPSV3_BASE,
        checkpoint: str | None = None,
        pixels: int = PIXELS,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 4,
    ) -> None:
        super().__init__("hpsv3", batch_size, device, dtype)
        self.base_model, self.checkpoint, self.pixels = base_model, checkpoint, pixels

    def hub_files(self) -> list[tuple[str, str]]:
        return [(self.base_model, "config.json")] + ([] if self.checkpoint else [(HPSV3_REPO, HPSV3_FILE)])

    def _load(self) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(self.base_model)
        self.processor.tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)
        self.reward_token_id = self.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        state = {
            transformers_key(k): v for k, v in load_file(self.checkpoint or download(HPSV3_REPO, HPSV3_FILE)).items()
        }
        head_state = {k[len("rm_head.") :]: state.pop(k) for k in [k for k in state if k.startswith("rm_head.")]}
        config = AutoConfig.from_pretrained(self.base_model)
        # The checkpoint's vocabulary holds the reward token: build the embeddings at its size.
        config.text_config.vocab_size = state["model.language_model.embed_tokens.weight"].shape[0]
        with torch.device(self.device):
            model = AutoModelForImageTextToText.from_config(config, dtype=self.dtype)
        model.load_state_dict(state, strict=True)
        self.model = model.eval()
        self.head = rank_head(config.text_config.hidden_size).to(self.device)
        self.head.load_state_dict(head_state, strict=True)
        self.head.eval()

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        messages = [
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": HPSV3_INSTRUCTION.format(
                text_prompt=prompt) + RATING_PROMPT}]}]
            for prompt in prompts
        ]  # fmt: skip
        texts = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        size = {"shortest_edge": self.pixels, "longest_edge": self.pixels}
        inputs = self.processor(text=texts, images=images, padding=True, images_kwargs={"size": size},
                                return_tensors="pt").to(self.device)  # fmt: skip
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        hidden = self.model.model(**inputs).last_hidden_state
        at_token = inputs["input_ids"] == self.reward_token_id
        if not (at_token.sum(dim=1) == 1).all():
            raise ValueError(f"Each HPSv3 prompt must hold {REWARD_TOKEN} once; a prompt may not contain it.")
        return self.head(hidden[at_token].float())[:, 0]


@register_reward("hpsv3")
def hpsv3(
    base_model: str = HPSV3_BASE,
    checkpoint: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    batch_size: int = 4,
) -> HPSv3Reward:
    """HPSv3 human-preference score (the head's ``mu``; higher is better).

    Args:
        base_model: Where the Qwen2-VL config and processor come from (the 7B Instruct model's Hub id or a local
            directory; its weights are not loaded: the checkpoint holds them all).
        checkpoint: A local ``HPSv3.safetensors``; default the Hub's ``MizzenAI/HPSv3``.
        device, dtype, batch_size: as for every model reward (bfloat16 recommended for the 7B backbone).
    """
    return HPSv3Reward(base_model, checkpoint, device=device, dtype=dtype, batch_size=batch_size)
