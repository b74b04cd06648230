"""Text-image similarity rewards on CLIP models: PickScore, CLIPScore (transformers) and HPSv2.1 (open_clip)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.lazy import CLIP_MEAN, CLIP_STD, LazyModelReward, download

PICKSCORE_MODEL_ID = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR_ID = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIPSCORE_MODEL_ID = "openai/clip-vit-large-patch14"
HPS_HUB_ID = "xswu/HPSv2"
HPS_V21_FILENAME = "HPS_v2.1_compressed.pt"
HPS_MODEL_NAME = "ViT-H-14"


def pooled_features(output: Any) -> torch.Tensor:
    """Projected features from ``get_image_features``/``get_text_features``: a tensor in transformers 4, an
    output object whose ``pooler_output`` holds them in transformers 5."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class ClipSimilarityReward(LazyModelReward):
    """Cosine similarity of a transformers ``CLIPModel``'s image and text embeddings, mapped to a score by
    :meth:`_from_cosine`. Subclasses define the mapping (PickScore: ``logit_scale * cos``)."""

    def __init__(
        self,
        name: str,
        model_id: str,
        processor_id: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 16,
    ) -> None:
        super().__init__(name, batch_size, device, dtype)
        self.model_id = model_id
        self.processor_id = processor_id or model_id

    def hub_files(self) -> list[tuple[str, str]]:
        return [(self.model_id, "config.json"), (self.processor_id, "config.json")]

    def _load(self) -> None:
        from transformers import AutoProcessor, CLIPModel

        self.processor = AutoProcessor.from_pretrained(self.processor_id)
        self.model = CLIPModel.from_pretrained(self.model_id, dtype=self.dtype).to(self.device).eval()

    def cosine(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        """Cosine similarity (float32) of each image with its own prompt."""
        inputs = self.processor(text=prompts, images=images, padding=True, truncation=True, return_tensors="pt")
        pixel_values = inputs["pixel_values"].to(self.device, self.dtype)
        image_embeds = pooled_features(self.model.get_image_features(pixel_values=pixel_values))
        text_embeds = pooled_features(
            self.model.get_text_features(
                input_ids=inputs["input_ids"].to(self.device), attention_mask=inputs["attention_mask"].to(self.device)
            )
        )
        return F.cosine_similarity(image_embeds.float(), text_embeds.float(), dim=-1)

    def _from_cosine(self, cosine: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        return self._from_cosine(self.cosine(prompts, images))


class PickScoreReward(ClipSimilarityReward):
    """PickScore: ``logit_scale.exp() * cos`` (about 18-24 for typical images; the scale is ~100)."""

    def _from_cosine(self, cosine: torch.Tensor) -> torch.Tensor:
        return self.model.logit_scale.exp().float() * cosine


class ClipScoreReward(ClipSimilarityReward):
    """CLIPScore as in torchmetrics: ``100 * max(cos, 0)``."""

    def _from_cosine(self, cosine: torch.Tensor) -> torch.Tensor:
        return 100.0 * cosine.clamp(min=0.0)


@register_reward("pickscore")
def pickscore(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    model_id: str = PICKSCORE_MODEL_ID,
    processor_id: str = PICKSCORE_PROCESSOR_ID,
    batch_size: int = 16,
) -> PickScoreReward:
    """PickScore (Kirstain et al., 2023): a CLIP ViT-H/14 fine-tuned on Pick-a-Pic human preferences.

    Score = ``logit_scale.exp() * cos(image, prompt)``, the logit of the original code (Flow-GRPO divides it
    by 26 for logging; the GRPO advantage is scale-free). ``model_id``/``processor_id`` may be local dirs.
    """
    return PickScoreReward("pickscore", model_id, processor_id, device=device, dtype=dtype, batch_size=batch_size)


@register_reward("clipscore")
def clip_score(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    model_id: str = CLIPSCORE_MODEL_ID,
    processor_id: str | None = None,
    batch_size: int = 16,
) -> ClipScoreReward:
    """CLIPScore: ``100 * max(cos(image, prompt), 0)`` with OpenAI CLIP ViT-L/14 (torchmetrics' definition)."""
    return ClipScoreReward("clipscore", model_id, processor_id, device=device, dtype=dtype, batch_size=batch_size)


class HPSv2Reward(LazyModelReward):
    """HPSv2.1: an open_clip ViT-H-14 fine-tuned on human preferences; the score is ``cos(image, prompt)``
    (no logit scale), as in the ``hpsv2`` package's ``score`` (about 0.2-0.35 for typical images)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        model_name: str = HPS_MODEL_NAME,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 16,
        hub_id: str = HPS_HUB_ID,
        filename: str = HPS_V21_FILENAME,
    ) -> None:
        super().__init__("hpsv2.1", batch_size, device, dtype)
        self.checkpoint = checkpoint
        self.model_name = model_name
        self.hub_id = hub_id
        self.filename = filename

    def hub_files(self) -> list[tuple[str, str]]:
        return [] if self.checkpoint else [(self.hub_id, self.filename)]

    def _load(self) -> None:
        import open_clip

        checkpoint = self.checkpoint or download(self.hub_id, self.filename)
        # Built without weights, then the HPS checkpoint is loaded strictly: its CLIP towers replace LAION's.
        model = open_clip.create_model(self.model_name, pretrained=None)
        open_clip.load_checkpoint(model, checkpoint, strict=True)
        self.model = model.to(self.device, self.dtype).eval()
        self.tokenizer = open_clip.get_tokenizer(self.model_name)
        # HPSv2's eval transform: resize the short side (bicubic), centre crop, CLIP normalisation.
        self.preprocess = open_clip.image_transform(
            self.model.visual.image_size, is_train=False, mean=CLIP_MEAN, std=CLIP_STD
        )

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device, self.dtype)
        tokens = self.tokenizer(prompts).to(self.device)
        image_features = self.model.encode_image(pixels, normalize=True)
        text_features = self.model.encode_text(tokens, normalize=True)
        return (image_features.float() * text_features.float()).sum(dim=-1)


@register_reward("hpsv2.1")
def hpsv2(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    checkpoint: str | None = None,
    model_name: str = HPS_MODEL_NAME,
    batch_size: int = 16,
) -> HPSv2Reward:
    """HPSv2.1 (Wu et al., 2023) through open_clip, without the ``hpsv2`` package (whose sdist does not build).

    Args:
        checkpoint: Local path of an open_clip-layout checkpoint (``{"state_dict": ...}`` or a bare state dict);
            default: ``HPS_v2.1_compressed.pt`` downloaded from ``xswu/HPSv2`` on first call.
        model_name: open_clip architecture: a built-in name (``"ViT-H-14"``) or ``"local-dir:/path"`` holding an
            ``open_clip_config.json``.
    """
    return HPSv2Reward(checkpoint, model_name, device=device, dtype=dtype, batch_size=batch_size)
