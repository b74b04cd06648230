"""An image-editing reward on a transformers CLIP model: does the edit move the image the way the instruction asks
(CLIP directional similarity), and does it keep the source (CLIP image similarity)?"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.clip_based import CLIPSCORE_MODEL_ID, ClipSimilarityReward, pooled_features
from trl_jagg.rewards.lazy import check_pairs, to_rgb

SOURCE_CAPTION_COLUMN = "source_caption"
TARGET_CAPTION_COLUMN = "target_caption"


class ClipEditReward(ClipSimilarityReward):
    """``direction_weight * cos(dI, dT) + preservation_weight * cos(I_source, I_output)`` on L2-normalised CLIP
    embeddings, with ``dI = I_output - I_source`` and ``dT = T_target - T_source`` (captions from the dataset) or
    ``dT = T_instruction`` (no captions). See :func:`clip_edit`."""

    def __init__(
        self,
        model_id: str,
        processor_id: str | None,
        direction_weight: float,
        preservation_weight: float,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        batch_size: int = 16,
        name: str = "clip-edit",
    ) -> None:
        for field, value in (("direction_weight", direction_weight), ("preservation_weight", preservation_weight)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"clip_edit's {field} is {value!r}: give a finite number.")
        if direction_weight == preservation_weight == 0:
            raise ValueError("clip_edit's direction_weight and preservation_weight are both 0: the reward would be 0.")
        super().__init__(name, model_id, processor_id, device=device, dtype=dtype, batch_size=batch_size)
        self.direction_weight = float(direction_weight)
        self.preservation_weight = float(preservation_weight)

    def _images(self, images: list[Image.Image]) -> torch.Tensor:
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        return F.normalize(pooled_features(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1)

    def _texts(self, texts: list[str]) -> torch.Tensor:
        tokens = self.processor(text=texts, padding=True, truncation=True, return_tensors="pt")
        features = self.model.get_text_features(
            input_ids=tokens["input_ids"].to(self.device), attention_mask=tokens["attention_mask"].to(self.device)
        )
        return F.normalize(pooled_features(features).float(), dim=-1)

    def terms(
        self,
        prompts: list[str],
        images: list[Image.Image],
        sources: list[Image.Image],
        captions: tuple[list[str], list[str]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The directional and the preservation cosine of one batch (float32)."""
        output, source = self._images(images), self._images(sources)
        text_direction = (
            self._texts(prompts) if captions is None else self._texts(captions[1]) - self._texts(captions[0])
        )
        # An unchanged image has dI = 0: cosine_similarity's eps makes its direction term 0, not NaN.
        direction = F.cosine_similarity(output - source, text_direction, dim=-1)
        return direction, (output * source).sum(dim=-1)

    def check_dataset(self, dataset: Any, *, name: str, edits_images: bool) -> None:
        """Before training: the model edits images (a text-to-image model has no source to compare with) and
        ``dataset`` has both caption columns or neither."""
        if not edits_images:
            raise ValueError(
                f"Reward {self.__name__!r} scores edits against their source images, but the model generates from text "
                "only: there is no source image to compare with. Train an editing model (FluxKontextPipeline, "
                "QwenImageEditPipeline) on a dataset with a 'source_image' column, or use a text-to-image reward."
            )
        captions = [column in dataset.column_names for column in (SOURCE_CAPTION_COLUMN, TARGET_CAPTION_COLUMN)]
        if captions[0] != captions[1]:
            raise ValueError(
                f"{name} has only one of the '{SOURCE_CAPTION_COLUMN}' and '{TARGET_CAPTION_COLUMN}' columns, which "
                f"reward {self.__name__!r} reads together: give both (the text direction is target - source) or "
                "neither (the direction is the instruction's)."
            )

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        """Score each edit; needs ``source_images`` (the trainer passes them for editing models) and reads the
        ``source_caption`` / ``target_caption`` columns when the dataset has them."""
        check_pairs(prompts, images)
        sources = kwargs.get("source_images")
        if sources is None or len(sources) != len(images):
            given = "none" if sources is None else len(sources)
            raise ValueError(
                f"{self.__name__} scores edits: it needs `source_images`, one per image (got {given} for {len(images)} "
                "images). Train an editing model (FluxKontextPipeline) on a dataset with a `source_image` column."
            )
        columns = [kwargs.get(SOURCE_CAPTION_COLUMN), kwargs.get(TARGET_CAPTION_COLUMN)]
        if (columns[0] is None) != (columns[1] is None):
            raise ValueError(
                f"{self.__name__} got only one of the `{SOURCE_CAPTION_COLUMN}` and `{TARGET_CAPTION_COLUMN}` columns: give "
                "both (the text direction is target - source) or neither (the direction is the instruction's)."
            )
        self.load()
        directions, preservations = [], []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                batch = slice(start, start + self.batch_size)
                captions = None if columns[0] is None else (list(columns[0][batch]), list(columns[1][batch]))
                direction, preservation = self.terms(
                    list(prompts[batch]), [to_rgb(im) for im in images[batch]],
                    [to_rgb(im) for im in sources[batch]], captions,
                )  # fmt: skip
                directions.extend(direction.cpu().tolist())
                preservations.extend(preservation.cpu().tolist())
        log_metric = kwargs.get("log_metric")
        if log_metric is not None:  # each term's mean, so a run shows which one moves
            log_metric(f"{self.__name__}/direction", sum(directions) / len(directions))
            log_metric(f"{self.__name__}/preservation", sum(preservations) / len(preservations))
        return [self.direction_weight * d + self.preservation_weight * p for d, p in zip(directions, preservations)]


@register_reward("clip-edit")
def clip_edit(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    model_id: str = CLIPSCORE_MODEL_ID,
    processor_id: str | None = None,
    direction_weight: float = 1.0,
    preservation_weight: float = 1.0,
    batch_size: int = 16,
) -> ClipEditReward:
    """CLIP directional similarity plus a preservation term, for image editing (needs ``source_images``).

    The direction term is InstructPix2Pix's (Brooks et al. 2023, ``metrics/clip_similarity.py``; StyleGAN-NADA's
    directional loss): ``cos(I_out - I_src, T_tgt - T_src)`` on L2-normalised CLIP embeddings, with the captions of
    the source and the wanted result from the dataset's ``source_caption`` / ``target_caption`` columns. Without
    them the text direction is the instruction's own embedding, ``cos(I_out - I_src, T_instruction)``. The
    preservation term is the CLIP image similarity ``cos(I_src, I_out)`` (InstructPix2Pix's ``sim_image``,
    Flow-GRPO's ``image_similarity`` reward). Score: ``direction_weight * direction + preservation_weight *
    preservation``, in [-(|a| + |b|), |a| + |b|]; the mean of each term is logged as ``clip-edit/direction`` and
    ``clip-edit/preservation``.
    """
    return ClipEditReward(
        model_id,
        processor_id,
        direction_weight,
        preservation_weight,
        device=device,
        dtype=dtype,
        batch_size=batch_size,
    )


@register_reward("clip-image-similarity")
def clip_image_similarity(
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    model_id: str = CLIPSCORE_MODEL_ID,
    processor_id: str | None = None,
    batch_size: int = 16,
) -> ClipEditReward:
    """``cos(I_src, I_out)`` alone: :func:`clip_edit`'s preservation term, Flow-GRPO's ``image_similarity`` reward
    (``flow_grpo/rewards.py:61-78`` and ``clip_scorer.py:56-68`` at zhtmike/flow_grpo@9745241, the same CLIP
    ViT-L/14), which its FLUX.1 Kontext config trains with (``flow-grpo-kontext``). Needs ``source_images``."""
    return ClipEditReward(
        model_id, processor_id, 0.0, 1.0, device=device, dtype=dtype, batch_size=batch_size,
        name="clip-image-similarity",
    )  # fmt: skip
