"""HPSv3 on a tiny random Qwen2-VL built from config: a checkpoint written in the published layout (``visual.*``,
``model.*``, ``lm_head.*``, ``rm_head.*``) loads strictly, and the score equals the head's ``mu`` at the reward
token computed here with plain tensor operations, across batch sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import trl_jagg.rewards as rewards
from trl_jagg.rewards.hpsv3 import HPSV3_INSTRUCTION, RATING_PROMPT, REWARD_TOKEN
from trl_jagg.testing.components import mrope_section
from trl_jagg.testing.tokenizers import build_qwen2_tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PIXELS = 56 * 56


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory):
    from safetensors.torch import save_file
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )  # fmt: skip

    tokenizer = build_qwen2_tokenizer(["red", "circle", "square"])
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad")}
    text = dict(vocab_size=len(tokenizer) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": mrope_section(16)},
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2),
        image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config).eval()
    folder = tmp_path_factory.mktemp("hpsv3")
    config.save_pretrained(folder / "base")
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=PIXELS, max_pixels=PIXELS), tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(), chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    processor.save_pretrained(folder / "base")
    head = {"rm_head.0.weight": torch.randn(1024, 32) / 6, "rm_head.0.bias": torch.randn(1024) / 6,
            "rm_head.3.weight": torch.randn(16, 1024) / 32, "rm_head.3.bias": torch.randn(16) / 6,
            "rm_head.5.weight": torch.randn(2, 16) / 4, "rm_head.5.bias": torch.randn(2)}  # fmt: skip
    published = {}
    for key, value in model.state_dict().items():  # back to the hpsv3 package's (older transformers') key names
        key = key.replace("model.visual.", "visual.").replace("model.language_model.", "model.")
        published[key] = value.contiguous()
    save_file({**published, **head}, str(folder / "HPSv3.safetensors"))
    return str(folder / "base"), str(folder / "HPSv3.safetensors"), model, head


def expected_scores(model, head, base, prompts, images):
    """mu by hand: the backbone's hidden state at the reward token through Linear-ReLU-Linear-ReLU-Linear."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(base)
    processor.tokenizer.add_tokens([REWARD_TOKEN], special_tokens=True)
    scores = []
    for prompt, image in zip(prompts, images):
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": HPSV3_INSTRUCTION.format(
            text_prompt=prompt) + RATING_PROMPT}]}]  # fmt: skip
        text = processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[text], images=[image], return_tensors="pt")
        with torch.no_grad():
            hidden = model.model(**inputs).last_hidden_state[0]
        (position,) = (inputs["input_ids"][0] == processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)).nonzero()[0]
        x = F.relu(F.linear(hidden[position], head["rm_head.0.weight"], head["rm_head.0.bias"]))
        x = F.relu(F.linear(x, head["rm_head.3.weight"], head["rm_head.3.bias"]))
        scores.append(F.linear(x, head["rm_head.5.weight"], head["rm_head.5.bias"])[0].item())
    return scores


@pytest.mark.parametrize("batch_size", [1, 3])
def test_hpsv3_scores_mu_at_the_reward_token(tiny_hpsv3, batch_size):
    base, checkpoint, model, head = tiny_hpsv3
    reward = rewards.load_reward_funcs(
        "hpsv3", base_model=base, checkpoint=checkpoint, device="cpu", batch_size=batch_size
    )[0]
    reward.pixels = PIXELS
    prompts = ["a red circle", "a square", "a red square"]
    images = [
        Image.new("RGB", (64, 48), (200, 20, 20)),
        Image.new("RGB", (40, 40), "blue"),
        Image.new("RGB", (48, 64)),
    ]
    scores = reward(prompts, images)
    assert scores == pytest.approx(expected_scores(model, head, base, prompts, images), abs=1e-4)
    assert len({round(s, 4) for s in scores}) == 3  # the images and prompts matter
