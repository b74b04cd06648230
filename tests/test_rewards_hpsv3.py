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
from trl_jagg.testing.tiny_rewards import TINY_HPSV3_PIXELS, save_tiny_hpsv3


@pytest.fixture(scope="module")
def tiny_hpsv3(tmp_path_factory):
    return save_tiny_hpsv3(tmp_path_factory.mktemp("hpsv3"), vocab_words=["red", "circle", "square"])


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
    base, checkpoint, model, head = tiny_hpsv3.base_model, tiny_hpsv3.checkpoint, tiny_hpsv3.model, tiny_hpsv3.head
    reward = rewards.load_reward_funcs(
        "hpsv3", base_model=base, checkpoint=checkpoint, device="cpu", batch_size=batch_size
    )[0]
    reward.pixels = TINY_HPSV3_PIXELS
    prompts = ["a red circle", "a square", "a red square"]
    images = [
        Image.new("RGB", (64, 48), (200, 20, 20)),
        Image.new("RGB", (40, 40), "blue"),
        Image.new("RGB", (48, 64)),
    ]
    scores = reward(prompts, images)
    assert scores == pytest.approx(expected_scores(model, head, base, prompts, images), abs=1e-4)
    assert len({round(s, 4) for s in scores}) == 3  # the images and prompts matter
