"""ImageReward (Xu et al., 2023) reimplemented on transformers' BLIP modules.

ImageReward is BLIP (ViT-L/16 image encoder + BERT-base text encoder with cross-attention to the image) followed
by the improved-aesthetic-predictor MLP on the text encoder's [CLS] output, then standardised with fixed
constants. The ``image-reward`` package does not build here, but its architecture is exactly transformers'
``BlipVisionModel`` + ``BlipTextModel`` (which were ported from BLIP's ``vit.py``/``med.py``), so the official
``ImageReward.pt`` state dict is renamed into them and loaded strictly.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.heads import RewardMLP
from trl_jagg.rewards.lazy import CLIP_MEAN, CLIP_STD, LazyModelReward, download

IMAGE_REWARD_HUB_ID = "THUDM/ImageReward"
IMAGE_REWARD_FILENAME = "ImageReward.pt"
IMAGE_REWARD_MED_CONFIG = "med_config.json"
IMAGE_REWARD_TOKENIZER_ID = "bert-base-uncased"
# Standardisation constants of ImageReward v1.0 (the raw head output's mean and std on its training data).
IMAGE_REWARD_MEAN = 0.16717362830052426
IMAGE_REWARD_STD = 1.0333394966054072
_PROMPT_MAX_LENGTH = 35  # ImageReward tokenises prompts to exactly 35 tokens (padding="max_length").
_VIT_LARGE_HEADS = 16  # BLIP's ViT-L: 1024 wide, 16 heads (head count cannot be read off the weights).

# BLIP ViT (timm layout) -> transformers BlipVisionModel, per-block part of the key.
_VIT_BLOCK_RENAMES = {
    "norm1": "layer_norm1",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VIT_TOP_RENAMES = {
    "cls_token": "embeddings.class_embedding",
    "pos_embed": "embeddings.position_embedding",
    "patch_embed.proj.weight": "embeddings.patch_embedding.weight",
    "patch_embed.proj.bias": "embeddings.patch_embedding.bias",
    "norm.weight": "post_layernorm.weight",
    "norm.bias": "post_layernorm.bias",
}


def _rename_vit_key(key: str) -> str:
    if key in _VIT_TOP_RENAMES:
        return _VIT_TOP_RENAMES[key]
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        for old, new in _VIT_BLOCK_RENAMES.items():
            if rest.startswith(old + "."):
                return f"encoder.layers.{index}.{new}{rest[len(old) :]}"
    raise KeyError(f"Unexpected BLIP vision-encoder key: {key!r}")


def split_image_reward_state_dict(
    state_dict: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Split an ``ImageReward.pt`` state dict into (vision, text, head) state dicts in transformers naming.

    The text encoder's names are already those of ``BlipTextModel`` (both come from BLIP's ``med.py``); its
    ``position_ids`` buffer is dropped (not persistent in transformers). BLIP's contrastive projections
    (``vision_proj``, ``text_proj``) are unused by ImageReward and ignored.
    """
    vision, text, head = {}, {}, {}
    for key, value in state_dict.items():
        if key.startswith("blip.visual_encoder."):
            vision[_rename_vit_key(key.removeprefix("blip.visual_encoder."))] = value
        elif key.startswith("blip.text_encoder."):
            name = key.removeprefix("blip.text_encoder.")
            if name != "embeddings.position_ids":
                text[name] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    if not (vision and text and head):
        raise KeyError(
            "Not an ImageReward checkpoint: expected 'blip.visual_encoder.*', 'blip.text_encoder.*', 'mlp.*'."
        )
    return vision, text, head


def _vision_config_from_weights(vision: dict[str, torch.Tensor], num_heads: int) -> dict[str, Any]:
    """BlipVisionConfig fields read off the ViT weights (width, depth, patch and image size)."""
    width = vision["embeddings.class_embedding"].shape[-1]
    patch = vision["embeddings.patch_embedding.weight"].shape[-1]
    grid = round((vision["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    depth = 1 + max(int(key.split(".")[2]) for key in vision if key.startswith("encoder.layers."))
    return {
        "hidden_size": width,
        "intermediate_size": vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
        "num_hidden_layers": depth,
        "num_attention_heads": num_heads,
        "patch_size": patch,
        "image_size": grid * patch,
        "layer_norm_eps": 1e-6,  # BLIP's ViT uses eps=1e-6, transformers' default is 1e-5
        "hidden_act": "gelu",
    }


def _text_config_from_med(med: dict[str, Any], encoder_width: int) -> dict[str, Any]:
    """BlipTextConfig fields from BLIP's ``med_config.json`` (a BertConfig with ``encoder_width``)."""
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "max_position_embeddings",
        "layer_norm_eps",
        "hidden_act",
        "pad_token_id",
    )
    config = {key: med[key] for key in keys if key in med}
    # is_decoder=True only makes BlipTextLayer build its cross-attention; forward runs bidirectionally.
    config.update(encoder_hidden_size=encoder_width, is_decoder=True, hidden_dropout_prob=0.0)
    config["attention_probs_dropout_prob"] = 0.0
    return config


class ImageRewardReward(LazyModelReward):
    """ImageReward score: standardised head output, about N(0, 1) over generated images; higher is better."""

    def __init__(
        self,
        checkpoint: str | None = None,
        med_config: str | dict[str, Any] | None = None,
        tokenizer_id: str = IMAGE_REWARD_TOKENIZER_ID,
        vision_num_heads: int = _VIT_LARGE_HEADS,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 16,
        hub_id: str = IMAGE_REWARD_HUB_ID,
    ) -> None:
        super().__init__("imagereward", batch_size, device, dtype)
        self.checkpoint = checkpoint
        self.med_config = med_config
        self.tokenizer_id = tokenizer_id
        self.vision_num_heads = vision_num_heads
        self.hub_id = hub_id

    def hub_files(self) -> list[tuple[str, str]]:
        files = [(self.tokenizer_id, "config.json")]
        files += [] if self.med_config is not None else [(self.hub_id, IMAGE_REWARD_MED_CONFIG)]
        return files + ([] if self.checkpoint else [(self.hub_id, IMAGE_REWARD_FILENAME)])

    def _load(self) -> None:
        from torchvision import transforms
        from transformers import AutoTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        med = self.med_config if self.med_config is not None else download(self.hub_id, IMAGE_REWARD_MED_CONFIG)
        if not isinstance(med, dict):
            with open(med, encoding="utf-8") as file:
                med = json.load(file)
        path = self.checkpoint or download(self.hub_id, IMAGE_REWARD_FILENAME)
        vision_sd, text_sd, head_sd = split_image_reward_state_dict(
            torch.load(path, map_location="cpu", weights_only=True)
        )
        vision_config = BlipVisionConfig(**_vision_config_from_weights(vision_sd, self.vision_num_heads))
        self.vision = BlipVisionModel(vision_config)
        self.vision.load_state_dict(vision_sd, strict=True)
        text_config = BlipTextConfig(**_text_config_from_med(med, vision_config.hidden_size))
        self.text = BlipTextModel(text_config, add_pooling_layer=False)
        self.text.load_state_dict(text_sd, strict=True)
        self.vision = self.vision.to(self.device, self.dtype).eval()
        self.text = self.text.to(self.device, self.dtype).eval()
        self.head = RewardMLP.from_state_dict(head_sd).to(self.device)  # float32, as the original
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_id)
        size = vision_config.image_size
        # ImageReward's own transform (CLIP-style): short side to `size` (bicubic), centre crop, CLIP stats.
        self.preprocess = transforms.Compose(
            [
                transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.CenterCrop(size),
                transforms.ToTensor(),
                transforms.Normalize(CLIP_MEAN, CLIP_STD),
            ]
        )

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device, self.dtype)
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        tokens = self.tokenizer(
            prompts, padding="max_length", truncation=True, max_length=_PROMPT_MAX_LENGTH, return_tensors="pt"
        ).to(self.device)
        # All image tokens are attended to, so no encoder attention mask is needed.
        text_output = self.text(
            input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], encoder_hidden_states=image_embeds
        )
        cls_features = text_output.last_hidden_state[:, 0, :].float()
        return (self.head(cls_features) - IMAGE_REWARD_MEAN) / IMAGE_REWARD_STD


@register_reward("imagereward")
def image_reward(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    checkpoint: str | None = None,
    med_config: str | dict[str, Any] | None = None,
    tokenizer_id: str = IMAGE_REWARD_TOKENIZER_ID,
    vision_num_heads: int = _VIT_LARGE_HEADS,
    batch_size: int = 16,
) -> ImageRewardReward:
    """ImageReward v1.0 on transformers' BLIP modules, without the ``image-reward`` package.

    Args:
        checkpoint: Local path of ``ImageReward.pt``; default: downloaded from ``THUDM/ImageReward``.
        med_config: BLIP text-encoder config (path or dict); default: ``med_config.json`` from the same repo.
        tokenizer_id: BERT tokenizer (Hub id or local dir) used by BLIP.
        vision_num_heads: Attention heads of the ViT (16 for the released ViT-L; only tests change it).
    """
    return ImageRewardReward(
        checkpoint, med_config, tokenizer_id, vision_num_heads, device=device, dtype=dtype, batch_size=batch_size
    )
