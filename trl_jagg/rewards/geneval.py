"""A GenEval-style compositional reward without mmdet: GenEval's rules on OWLv2 detections, CLIP for colours.

GenEval (Ghosh et al. 2023) checks an image against its prompt's metadata (``tag``, ``include`` clauses of a class,
a count and optionally a colour or a position relative to an earlier clause, ``exclude`` clauses) using
Mask2Former detections (mmdet) and CLIP ViT-L/14 colour classification. mmdet needs Python <= 3.10 and torch <= 2.1,
so this reward runs the same rules on an open-vocabulary detector that transformers ships (OWLv2, queried with
``"a photo of a <class>"``) with greedy per-class non-maximum suppression, and classifies colours with a
transformers ``CLIPModel`` on the box crops. The dense score is Flow-GRPO's training reward (the reward-server's
``evaluate_reward``, ``reward_server/gen_eval.py:201-264`` @92ac29f): the mean over clauses of the count's
``1 - |count - found| / count``, the colour's ``1 - |count - of that colour| / count`` and 1 or 0 for the position.
Its scores differ from the original pipeline's (another detector, box crops instead of masks, thresholds tuned
for OWLv2); no comparison with the Mask2Former pipeline has been measured here (no GPU, no weights).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image

from trl_jagg.rewards.base import register_reward
from trl_jagg.rewards.clip_based import pooled_features
from trl_jagg.rewards.lazy import LazyModelReward, check_pairs, to_rgb

OWLV2_MODEL_ID = "google/owlv2-base-patch16-ensemble"
CLIP_MODEL_ID = "openai/clip-vit-large-patch14"  # GenEval's colour classifier: open_clip ViT-L-14, "openai" weights
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names."""
COLOR_TEMPLATES = ("a photo of a {color} {name}", "a photo of a {color}-colored {name}", "a photo of a {color} object")
"""GenEval's zero-shot colour prompts, averaged per colour."""

RELATIONS = ("left of", "right of", "above", "below")
"""GenEval's position relations."""
METADATA_COLUMNS = ("tag", "include")
"""The dataset columns the reward needs (``exclude`` is optional)."""

Box = Sequence[float]
"""``(x0, y0, x1, y1)`` in pixels."""


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_metadata(tag: Any, include: Any, exclude: Any, where: str) -> None:
    """Check one prompt's GenEval metadata, as :func:`geneval_score` reads it: ``tag`` a string, ``include`` a
    non-empty list of clauses ``{"class": str, "count": int >= 1, "color"?: one of COLORS, "position"?: [relation,
    index of an EARLIER clause]}``, ``exclude`` ``None`` or a list of ``{"class": str, "count": int >= 1}``. A key
    holding ``None`` counts as absent (a datasets column of clauses fills the keys a clause lacks with ``None``).

    Raises:
        ValueError: naming ``where`` (the row), the field and the clause; a bad clause would otherwise score 0 for
            every image (an unknown colour, a position naming a later clause, ``include=[]``) or fail with a bare
            ``TypeError`` at the first scoring.
    """

    def fail(field: str, problem: str) -> None:
        raise ValueError(f"{where} GenEval metadata '{field}' {problem}. See GenEval's evaluation_metadata.jsonl.")

    if not isinstance(tag, str):
        fail("tag", f"is {tag!r}, not a string (e.g. 'single_object', 'counting', 'colors', 'position')")
    if not isinstance(include, (list, tuple)) or not include:
        fail("include", f"is {include!r}: give a non-empty list of clauses (an empty one scores every image 0)")
    for field, clauses in (("include", include), ("exclude", exclude)):
        if clauses is None and field == "exclude":
            continue
        if not isinstance(clauses, (list, tuple)):
            fail(field, f"is {clauses!r}, not a list of clauses")
        for j, clause in enumerate(clauses):
            at = f"{field}[{j}]"
            if not isinstance(clause, Mapping):
                fail(at, f"is {clause!r}, not a mapping like {{'class': 'cat', 'count': 1}}")
            if not isinstance(clause.get("class"), str) or not clause["class"].strip():
                fail(f"{at}.class", f"is {clause.get('class')!r}: give the object's class name")
            if not _is_count(clause.get("count")):
                fail(f"{at}.count", f"is {clause.get('count')!r}: give a whole number >= 1")
            if field == "exclude":
                continue
            color = clause.get("color")
            if color is not None and color not in COLORS:
                fail(f"{at}.color", f"is {color!r}, not one of GenEval's colours {COLORS} (it would never match)")
            position = clause.get("position")
            if position is None:
                continue
            if not isinstance(position, (list, tuple)) or len(position) != 2 or position[0] not in RELATIONS:
                fail(f"{at}.position", f"is {position!r}: give [relation, clause index], relation one of {RELATIONS}")
            if not (isinstance(position[1], int) and not isinstance(position[1], bool) and 0 <= position[1] < j):
                fail(
                    f"{at}.position",
                    f"names clause {position[1]!r}, which is not an earlier include clause (0..{j - 1}): a position "
                    "is relative to a clause already matched",
                )


def check_dataset_metadata(dataset: Any, name: str) -> None:
    """Every row of ``dataset`` (a ``datasets.Dataset``) has GenEval metadata :func:`check_metadata` accepts.

    Raises:
        ValueError: a missing ``tag`` or ``include`` column, or the first bad row (named with its field).
    """
    missing = [column for column in METADATA_COLUMNS if column not in dataset.column_names]
    if missing:
        raise ValueError(
            f"{name} has no {' or '.join(repr(c) for c in missing)} column, which the GenEval reward scores against: "
            "give GenEval's metadata as dataset columns 'tag' and 'include' (and 'exclude'), e.g. "
            "load_dataset('json', data_files='evaluation_metadata.jsonl')."
        )
    excludes = dataset["exclude"] if "exclude" in dataset.column_names else [None] * len(dataset)
    for i, (tag, include, exclude) in enumerate(zip(dataset["tag"], dataset["include"], excludes)):
        check_metadata(tag, include, exclude, f"{name} row {i}:")


def relative_position(box_a: Box, box_b: Box, threshold: float = 0.1) -> set[str]:
    """Where box A lies relative to box B, as GenEval decides: the centre offset, shrunk on each axis by
    ``threshold`` times the two boxes' sizes, normalised by the offset's length; each axis whose normalised part
    exceeds 0.5 names a relation (``left of``, ``right of``, ``above``, ``below``; y grows downwards)."""
    offset, revised = [], []
    for axis in (0, 1):
        center_a = (box_a[axis] + box_a[axis + 2]) / 2
        center_b = (box_b[axis] + box_b[axis + 2]) / 2
        size = abs(box_a[axis + 2] - box_a[axis]) + abs(box_b[axis + 2] - box_b[axis])
        delta = center_a - center_b
        offset.append(delta)
        revised.append(max(abs(delta) - threshold * size, 0.0) * (1 if delta > 0 else -1 if delta < 0 else 0))
    if all(abs(value) < 1e-3 for value in revised):
        return set()
    norm = (offset[0] ** 2 + offset[1] ** 2) ** 0.5
    dx, dy = revised[0] / norm, revised[1] / norm
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def geneval_score(
    boxes: Mapping[str, Sequence[Box]],
    metadata: Mapping[str, Any],
    colors_of: Callable[[str, Sequence[Box]], Sequence[str]],
    position_threshold: float = 0.1,
) -> tuple[float, bool]:
    """GenEval's rules on one image's detections: ``(dense score, strictly correct)``.

    Args:
        boxes: class name -> its detected boxes, most confident first.
        metadata: GenEval's metadata: ``include`` (clauses ``{"class", "count", "color"?, "position"?: [relation,
            index of an earlier clause]}``) and optionally ``exclude`` (``{"class", "count"}``).
        colors_of: the colour (one of :data:`COLORS`) of each of a class's boxes.
        position_threshold: GenEval's 0.1 (see :func:`relative_position`).

    The score is the mean over the clauses' terms (see the module docstring); a count that is not exact also
    scores 0 for the clause's colour or position. Strictly correct means every count exact, every colour and
    position right and no ``exclude`` clause met (GenEval's strict check). Flow-GRPO's sidecar appends both 0 and
    1 for a failed position (gen_eval.py:243-255); here a failed position scores 0.
    """
    terms: list[float] = []
    correct = True
    matched: list[Sequence[Box] | None] = []
    for clause in metadata.get("include", []):
        name, count = clause["class"], int(clause["count"])
        found = list(boxes.get(name, []))
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            if clause.get("color") is not None or clause.get("position") is not None:
                terms.append(0.0)
        else:
            if clause.get("color") is not None:
                hits = list(colors_of(name, found)).count(clause["color"])
                terms.append(1 - abs(count - hits) / count)
                ok = hits == count
            if clause.get("position") is not None and ok:
                relation, target = clause["position"]
                targets = matched[target] if target < len(matched) else None
                ok = targets is not None and all(
                    relation in relative_position(box, other, position_threshold) for box in found for other in targets
                )
                terms.append(1.0 if ok else 0.0)
        correct = correct and ok
        matched.append(found if ok else None)
    for clause in metadata.get("exclude", []) or []:
        if len(boxes.get(clause["class"], [])) >= int(clause["count"]):
            correct = False
    return (sum(terms) / len(terms) if terms else 0.0), correct


def greedy_nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> list[int]:
    """Indices of the boxes kept by greedy non-maximum suppression, most confident first."""
    order = scores.argsort(descending=True).tolist()
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    kept: list[int] = []
    for index in order:
        if kept:
            other = boxes[kept]
            top_left = torch.maximum(other[:, :2], boxes[index, :2])
            bottom_right = torch.minimum(other[:, 2:], boxes[index, 2:])
            inter = (bottom_right - top_left).clamp(min=0).prod(dim=1)
            iou = inter / (area[kept] + area[index] - inter).clamp(min=1e-9)
            if (iou > iou_threshold).any():
                continue
        kept.append(index)
    return kept


class GenEvalReward(LazyModelReward):
    """GenEval's rules on OWLv2 detections and CLIP colours; see :func:`geneval`."""

    def __init__(
        self,
        detector_id: str = OWLV2_MODEL_ID,
        clip_id: str = CLIP_MODEL_ID,
        threshold: float = 0.2,
        counting_threshold: float = 0.3,
        nms_threshold: float = 0.5,
        max_objects: int = 16,
        position_threshold: float = 0.1,
        strict: bool = False,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__("geneval_strict" if strict else "geneval", 1, device, dtype)
        self.detector_id, self.clip_id = detector_id, clip_id
        self.threshold, self.counting_threshold, self.nms_threshold = threshold, counting_threshold, nms_threshold
        self.max_objects, self.position_threshold, self.strict = max_objects, position_threshold, strict

    def check_dataset(self, dataset: Any, *, name: str, edits_images: bool) -> None:
        """Before training: ``dataset`` has GenEval's metadata columns, valid in every row
        (:func:`check_dataset_metadata`), so that a bad row stops the run at init rather than after a rollout."""
        check_dataset_metadata(dataset, name)

    def _load(self) -> None:
        from transformers import AutoProcessor, CLIPModel, Owlv2ForObjectDetection

        self.detector_processor = AutoProcessor.from_pretrained(self.detector_id)
        self.detector = Owlv2ForObjectDetection.from_pretrained(self.detector_id, dtype=self.dtype)
        self.detector = self.detector.to(self.device).eval()
        self.clip_processor = AutoProcessor.from_pretrained(self.clip_id)
        self.clip = CLIPModel.from_pretrained(self.clip_id, dtype=self.dtype).to(self.device).eval()
        self._color_classifiers: dict[str, torch.Tensor] = {}

    def detect(self, image: Image.Image, names: Sequence[str], threshold: float) -> dict[str, list[list[float]]]:
        """Boxes of each class in ``names`` scoring above ``threshold`` after per-class NMS, most confident first."""
        queries = [[f"a photo of a {name}" for name in names]]
        inputs = self.detector_processor(text=queries, images=image, return_tensors="pt").to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        outputs = self.detector(**inputs)
        side = max(image.size)  # OWLv2 pads the image to a square at the bottom and right
        logits = outputs.logits[0].float()  # (boxes, queries)
        scores, labels = logits.sigmoid().max(dim=-1)
        # pred_boxes are (cx, cy, w, h) relative to the padded square.
        cx, cy, w, h = (outputs.pred_boxes[0].float() * side).unbind(-1)
        xyxy = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)
        xyxy = xyxy.clamp(min=0).minimum(torch.tensor([image.width, image.height] * 2, device=xyxy.device))
        detected: dict[str, list[list[float]]] = {}
        for label, name in enumerate(names):
            keep = ((labels == label) & (scores > threshold)).nonzero().flatten()
            if keep.numel():
                kept = greedy_nms(xyxy[keep], scores[keep], self.nms_threshold)[: self.max_objects]
                detected[name] = xyxy[keep[kept]].tolist()
        return detected

    def colors_of(self, image: Image.Image, name: str, boxes: Sequence[Box]) -> list[str]:
        """GenEval's zero-shot colour of each box crop: the colour whose mean prompt embedding is closest."""
        if name not in self._color_classifiers:
            prompts = [template.format(color=color, name=name) for color in COLORS for template in COLOR_TEMPLATES]
            text = self.clip_processor(text=prompts, padding=True, return_tensors="pt").to(self.device)
            embeds = F.normalize(pooled_features(self.clip.get_text_features(**text)).float(), dim=-1)
            self._color_classifiers[name] = F.normalize(embeds.view(len(COLORS), -1, embeds.shape[-1]).mean(1), dim=-1)
        crops = [image.crop(tuple(int(round(v)) for v in box)) for box in boxes]
        pixels = self.clip_processor(images=crops, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        image_embeds = F.normalize(pooled_features(self.clip.get_image_features(pixel_values=pixels)).float(), dim=-1)
        return [COLORS[i] for i in (image_embeds @ self._color_classifiers[name].T).argmax(dim=-1).tolist()]

    def __call__(
        self,
        prompts: Sequence[str],
        images: Sequence[Image.Image],
        tag: Sequence[str] | None = None,
        include: Sequence[list] | None = None,
        exclude: Sequence[list | None] | None = None,
        **kwargs: Any,
    ) -> list[float]:
        """Score each image against its prompt's GenEval metadata (dataset columns ``tag``, ``include`` and
        optionally ``exclude``): the dense score, or 1.0 / 0.0 with ``strict=True``."""
        check_pairs(prompts, images)
        if tag is None or include is None:
            raise ValueError(
                f"Reward {self.__name__!r} needs GenEval's metadata as dataset columns 'tag' and 'include' (and "
                "'exclude'), e.g. load_dataset('json', data_files='evaluation_metadata.jsonl')."
            )
        for i in range(len(images)):  # the trainer checked its datasets at init; a direct call is checked here
            check_metadata(tag[i], include[i], None if exclude is None else exclude[i], f"sample {i}:")
        self.load()
        scores = []
        with torch.inference_mode():
            for i, image in enumerate(images):
                image = to_rgb(image)
                metadata = {"include": include[i], "exclude": (exclude[i] if exclude is not None else None) or []}
                names = list(dict.fromkeys(c["class"] for c in [*metadata["include"], *metadata["exclude"]]))
                threshold = self.counting_threshold if tag[i] == "counting" else self.threshold
                boxes = self.detect(image, names, threshold) if names else {}
                colors_of = functools.partial(self.colors_of, image)
                score, correct = geneval_score(boxes, metadata, colors_of, self.position_threshold)
                scores.append(float(correct) if self.strict else score)
        return scores


@register_reward("geneval")
def geneval(
    detector_id: str = OWLV2_MODEL_ID,
    clip_id: str = CLIP_MODEL_ID,
    threshold: float = 0.2,
    counting_threshold: float = 0.3,
    nms_threshold: float = 0.5,
    strict: bool = False,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> GenEvalReward:
    """GenEval-style compositional reward (see the module docstring): OWLv2 detections, CLIP colours, GenEval's rules.

    Args:
        detector_id: an OWLv2 checkpoint (``Owlv2ForObjectDetection``) or local directory.
        clip_id: the CLIP model classifying colours.
        threshold: the detection score kept (GenEval's 0.3 is for Mask2Former; OWLv2's scores run lower).
        counting_threshold: the same for ``tag == "counting"`` prompts (GenEval: 0.9).
        nms_threshold: IoU above which a less confident box of the same class is dropped (OWLv2 returns one box
            per patch; Mask2Former needed none).
        strict: score 1.0 / 0.0 by GenEval's strict check instead of the dense score.
    """
    return GenEvalReward(
        detector_id, clip_id, threshold=threshold, counting_threshold=counting_threshold, nms_threshold=nms_threshold,
        strict=strict, device=device, dtype=dtype,
    )  # fmt: skip
