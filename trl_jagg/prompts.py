"""Prompt inputs, checked and reduced to the text the text encoders read.

A prompt is a non-empty string, or a conversation in TRL's format (``[{"role": "user", "content": ...}, ...]``),
whose last user turn is the prompt. Anything else (``None``, a number, an empty string) is an error naming the
row, never a ``str(...)`` of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CONVERSATION_HINT = "a conversation [{'role': 'user', 'content': '...'}]"


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


def check_prompts(prompts: Sequence[Any], where: str) -> list[str]:
    """Every prompt of ``prompts`` as text; errors name ``where`` and the index of the first bad one."""
    return [prompt_text(value, f"{where}[{i}]") for i, value in enumerate(prompts)]


def prompt_dataset(dataset: Any, prompts_per_rollout: int, name: str = "train_dataset") -> Any:
    """``dataset`` as a :class:`datasets.Dataset` whose every ``prompt`` is usable, holding at least one rollout's
    ``prompts_per_rollout`` prompts. A Python list of prompts or of records is converted. ``name`` is the argument
    the errors name (``eval_dataset`` for the held-out prompts).

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
    from .rewards.base import REWARD_KEYWORDS

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
    if len(dataset) < prompts_per_rollout:
        raise ValueError(
            f"{name} has {len(dataset)} prompt{'s' if len(dataset) != 1 else ''}; one rollout needs "
            f"{prompts_per_rollout} (generation_batch_size / num_generations), so nothing would be trained. Add "
            "prompts, or lower per_device_train_batch_size or steps_per_generation."
        )
    return dataset


__all__ = ["check_prompts", "prompt_dataset", "prompt_text"]
