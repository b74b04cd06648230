"""LAION aesthetic predictor v2 ("improved aesthetic predictor"): an MLP on CLIP ViT-L/14 image embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.clip_based import pooled_features
from trl_jagg.rewards.heads import RewardMLP
from trl_jagg.rewards.lazy import LazyModelReward, download

AESTHETIC_CLIP_ID = "openai/clip-vit-large-patch14"
# The sac+logos+ava1-l14-linearMSE head, as mirrored on the Hub by TRL for its DDPO example.
AESTHETIC_HEAD_ID = "trl-lib/ddpo-aesthetic-predictor"
AESTHETIC_HEAD_FILENAME = "aesthetic-model.pth"


class AestheticReward(LazyModelReward):
    """Aesthetic score (roughly 1-10) of the image alone; the prompt is ignored.

    Score = ``MLP(e / |e|)`` where ``e`` is the CLIP image embedding (the head was trained on L2-normalised
    embeddings).
    """

    def __init__(
        self,
        clip_id: str = AESTHETIC_CLIP_ID,
        head_path: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 16,
        head_id: str = AESTHETIC_HEAD_ID,
        head_filename: str = AESTHETIC_HEAD_FILENAME,
    ) -> None:
        super().__init__("aesthetic", batch_size, device, dtype)
        self.clip_id = clip_id
        self.head_path = head_path
        self.head_id = head_id
        self.head_filename = head_filename

    def hub_files(self) -> list[tuple[str, str]]:
        return [(self.clip_id, "config.json")] + ([] if self.head_path else [(self.head_id, self.head_filename)])

    def _load(self) -> None:
        from transformers import CLIPImageProcessor, CLIPModel

        self.processor = CLIPImageProcessor.from_pretrained(self.clip_id)
        # The full CLIPModel, though only its vision tower is used: CLIPVisionModelWithProjection would need the
        # projection width copied into the vision config by hand, and warns about every text-tower weight.
        self.model = CLIPModel.from_pretrained(self.clip_id, dtype=self.dtype).to(self.device).eval()
        path = self.head_path or download(self.head_id, self.head_filename)
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        # The head is tiny: kept in float32 whatever the CLIP dtype, like the original.
        self.head = RewardMLP.from_state_dict(state_dict).to(self.device)

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor:
        pixel_values = self.processor(images=images, return_tensors="pt")["pixel_values"]
        embeds = pooled_features(self.model.get_image_features(pixel_values=pixel_values.to(self.device, self.dtype)))
        return self.head(F.normalize(embeds.float(), dim=-1))


@register_reward("aesthetic")
def aesthetic(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    clip_id: str = AESTHETIC_CLIP_ID,
    head_path: str | None = None,
    batch_size: int = 16,
) -> AestheticReward:
    """LAION aesthetic predictor v2 (as used by DDPO): CLIP ViT-L/14 image embedding + linear MLP head.

    Args:
        clip_id: Hub id or local dir of the CLIP model (vision tower and image processor).
        head_path: Local path of the MLP head's state dict; default: ``aesthetic-model.pth`` from
            ``trl-lib/ddpo-aesthetic-predictor``, downloaded on first call.
    """
    return AestheticReward(clip_id, head_path, device=device, dtype=dtype, batch_size=batch_size)
