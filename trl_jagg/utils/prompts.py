"""Prompt inputs, checked and reduced to the text the text encoders read.

A prompt is a non-empty string, or a conversation in TRL's format (``[{"role": "user", "content": ...}, ...]``),
whose last user turn is the prompt. Anything else (``None``, a number, an empty string) is an error naming the
row, never a ``str(...)`` of it.

Editing models also read a source image per row (column ``source_image``): a PIL image, a file path, encoded bytes,
or the ``{"bytes": ..., "path": ...}`` cell of a ``datasets.Image`` column, in RGB; models that edit several images
at once (Qwen-Image-Edit-Plus) read a list of them per row.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from PIL import Image

CONVERSATION_HINT = "a conversation [{'role': 'user', 'content': '...'}]"
SOURCE_IMAGE_COLUMN = "source_image"
"""The dataset column of the images that editing models edit, one per prompt."""


def prompt_text(value: Any, where: str) -> str:
    """The text of prompt ``value``; ``where`` names it in errors (e.g. ``"train_dataset row 3 'prompt'"``).

    Raises:
        ValueError: ``value`` is not a string nor a conversation with a user turn, or its text is empty.
    """
    if isinstance(value, str):
        text = value
    elif isinstance(value, Sequence) and value and all(isinstance(turn, Mapping) for turn in value):
        users = [turn for turn in value if turn.get("role") == "user"]
        if not users:
            roles = [turn.get("role") for turn in value]
            raise ValueError(f"{where} is a conversation without a user turn (roles: {roles}). Add the prompt as a "
                             "{'role': 'user', 'content': '...'} turn.")  # fmt: skip
        text = _content_text(users[-1].get("content"), where)
    else:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise ValueError(
            f"{where} is {type(value).__name__} {shown}, not a prompt. Use a non-empty string or {CONVERSATION_HINT}."
        )
    if not text.strip():
        raise ValueError(f"{where} is empty. Remove the row or give it a prompt.")
    return text


def _content_text(content: Any, where: str) -> str:
    """The text of a user turn: a string, or TRL's list of parts ``[{"type": "text", "text": ...}, ...]``."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(part, Mapping) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if texts and all(isinstance(text, str) for text in texts):
            return " ".join(texts)
    raise ValueError(
        f"{where}: the user turn's content is {type(content).__name__}, not a string or a list of "
        "{'type': 'text', 'text': '...'} parts."
    )


def source_image(value: Any, where: str) -> Image.Image:
    """The RGB image of source-image cell ``value``; ``where`` names it in errors.

    Raises:
        ValueError: the cell is empty, not an image, unreadable, or not in RGB mode.
    """
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):  # a datasets.Image cell
        value = value.get("bytes") or value.get("path")
    if value is None:
        raise ValueError(f"{where} is missing: an editing model needs a source image for every prompt.")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(value)
        else:
            raise ValueError(
                f"{where} is {type(value).__name__}, not an image. Use a PIL image, a file path or encoded bytes."
            )
        image.load()  # decode now: a truncated or corrupt file fails here, not in the middle of a rollout
    except (OSError, Image.DecompressionBombError) as error:
        raise ValueError(f"{where} cannot be read as an image ({error}).") from None
    if image.mode != "RGB":
        raise ValueError(
            f"{where} is a {image.mode} image; editing models read RGB. Convert it, e.g. "
            "`dataset.cast_column('source_image', datasets.Image(mode='RGB'))` or `image.convert('RGB')`."
        )
    return image


def source_images_of(value: Any, where: str, limit: int | None = 1) -> Image.Image | list[Image.Image]:
    """A row's source image(s): the image (:func:`source_image`) where the model edits one per prompt (``limit``
    1), else the list of them (a single image is a list of one; ``limit`` bounds it, ``None``: any number).

    Raises:
        ValueError: a list where the model edits one image, an empty or too long list, or a bad image (its index in
            the list is named).
    """
    if isinstance(value, (list, tuple)) and len(value) == 1 and limit == 1:
        value = value[0]  # a list of one image, where one is edited
    if not isinstance(value, (list, tuple)):
        image = source_image(value, where)
        return image if limit == 1 else [image]
    if limit == 1:
        raise ValueError(
            f"{where} holds {len(value)} images; this model edits one per prompt. Give one image per row, or train "
            "a model that edits several (QwenImageEditPlusPipeline)."
        )
    if not value or (limit is not None and len(value) > limit):
        raise ValueError(f"{where} holds {len(value)} images; give 1 to {limit or 'any number of'} source images.")
    return [source_image(item, f"{where}[{j}]") for j, item in enumerate(value)]


def check_prompts(prompts: Sequence[Any], where: str) -> list[str]:
    """Every prompt of ``prompts`` as text; errors name ``where`` and the index of the first bad one."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"{where} is {type(prompts).__name__} {prompts!r}, not a list of prompts. Give a list, e.g. "
            f'{where.rsplit(".", 1)[-1]}: ["a red circle", "a blue square"] in YAML.'
        )
    return [prompt_text(value, f"{where}[{i}]") for i, value in enumerate(prompts)]


def check_source_images(
    dataset: Any,
    name: str = "train_dataset",
    limit: int | None = 1,
    layout: Callable[[Any], Hashable] | None = None,
) -> list[Hashable] | None:
    """Every row of ``dataset`` has readable RGB source images (:func:`source_images_of` with ``limit``); errors
    name the row. Returns each row's ``layout``, computed from its images (e.g. the reference grids an editing model
    encodes them into, which the rows of one batch must share: the rollout batches rows of one layout), or ``None``
    without ``layout``.

    Raises:
        ValueError: no ``source_image`` column, or a bad row (``layout`` raising ``ValueError`` included).
    """
    if SOURCE_IMAGE_COLUMN not in dataset.column_names:
        raise ValueError(
            f"{name} has no '{SOURCE_IMAGE_COLUMN}' column (columns: {dataset.column_names}), which an editing "
            "model needs: the image each prompt edits (PIL images, paths or bytes). Rename the image column, e.g. "
            f"`dataset.rename_column('image', '{SOURCE_IMAGE_COLUMN}')`."
        )
    layouts = []
    for i, value in enumerate(dataset[SOURCE_IMAGE_COLUMN]):  # one row's images at a time: only layouts are kept
        where = f"{name} row {i} '{SOURCE_IMAGE_COLUMN}'"
        images = source_images_of(value, where, limit)
        if layout is not None:
            try:
                layouts.append(layout(images))
            except ValueError as error:  # an image the model cannot take (e.g. a side that resizes to 0)
                raise ValueError(f"{where}: {error}") from None
    return layouts if layout is not None else None


def prompt_dataset(dataset: Any, prompts_per_rollout: int, name: str = "train_dataset") -> Any:
    """``dataset`` as a :class:`datasets.Dataset` whose every ``prompt`` is usable, holding at least one rollout's
    ``prompts_per_rollout`` prompts. A Python list of prompts or of records is converted. ``name`` is the argument
    the errors name (``eval_dataset`` for the held-out prompts). An editing model's source images are checked by
    :func:`check_source_images`.

    Raises:
        TypeError: a streaming ``IterableDataset``, a ``DatasetDict`` or another type.
        ValueError: no ``prompt`` column, a column named like a reward keyword (``images``, ...), a bad row (its
            index is named) or too few prompts.
    """
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(dataset, list):
        if all(isinstance(row, Mapping) for row in dataset) and dataset:
            dataset = Dataset.from_list(list(dataset))
        else:
            dataset = Dataset.from_dict({"prompt": check_prompts(dataset, name)})
    elif isinstance(dataset, (IterableDataset, IterableDatasetDict)):
        raise TypeError(
            f"{name} is a streaming IterableDataset: GRPO draws each prompt num_generations times through a "
            "sampler that needs the dataset's length. Load it without streaming=True, or take a part of it: "
            "Dataset.from_list(list(dataset.take(n)))."
        )
    elif isinstance(dataset, DatasetDict):
        raise TypeError(f"{name} is a DatasetDict (splits {list(dataset)}): pass one split, e.g. dataset['train'].")
    elif not isinstance(dataset, Dataset):
        raise TypeError(
            f"{name} is a {type(dataset).__name__}: pass a datasets.Dataset with a 'prompt' column "
            "(Dataset.from_dict({'prompt': [...]})) or a list of prompts."
        )
    if "prompt" not in dataset.column_names:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {dataset.column_names}). "
            "Rename the text column, e.g. `dataset.rename_column('text', 'prompt')`."
        )
    from trl_jagg.rewards.base import REWARD_KEYWORDS

    # Columns reach every reward as keywords beside these: a clash would fail at the first reward call, after a
    # whole rollout.
    clashing = [column for column in dataset.column_names if column in REWARD_KEYWORDS]
    if clashing:
        raise ValueError(
            f"{name} has column(s) {clashing}, which clash with the keywords every reward is called with "
            f"{REWARD_KEYWORDS}. Rename them, e.g. `dataset.rename_column({clashing[0]!r}, "
            f"'dataset_{clashing[0]}')`."
        )
    for i, value in enumerate(dataset["prompt"]):
        prompt_text(value, f"{name} row {i} 'prompt'")
    if name != "train_dataset" and len(dataset) == 0:  # held-out prompts: a rollout's size does not apply
        raise ValueError(f"{name} holds no prompts: an evaluation would score nothing. Add prompts, or pass None.")
    if len(dataset) < prompts_per_rollout:
        raise ValueError(
            f"{name} has {len(dataset)} prompt{'s' if len(dataset) != 1 else ''}; one rollout needs "
            f"{prompts_per_rollout} (generation_batch_size / num_generations), so nothing would be trained. Add "
            "prompts, or lower per_device_train_batch_size or steps_per_generation."
        )
    return dataset


__all__ = [
    "SOURCE_IMAGE_COLUMN",
    "check_prompts",
    "check_source_images",
    "prompt_dataset",
    "prompt_text",
    "source_image",
    "source_images_of",
]
