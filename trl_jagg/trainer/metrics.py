"""The metrics the stages collect between two logs: lists of values per name, averaged when the trainer logs."""

from __future__ import annotations

import math
from typing import Any


def logged_means(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Each metric's mean over its values since the last log. As TRL: NaN entries (a reward that returned None for
    every image of a rollout) are left out, and a metric with no value left is not logged (JSON loggers reject
    NaN)."""
    means = {}
    for key, values in metrics.items():
        valid = [value for value in values if not math.isnan(value)]
        if valid:
            means[key] = sum(valid) / len(valid)
    return means


def first_completions(
    completions: tuple[list[str], list[Any], dict[str, list[Any]]], count: int | None
) -> tuple[list[str], list[Any], dict[str, list[Any]]]:
    """The first ``count`` (``None``: all) of a rollout's (prompts, images, scores), TRL's
    ``num_completions_to_print``."""
    keep = slice(count)
    prompts, images, scores = completions
    return prompts[keep], images[keep], {name: values[keep] for name, values in scores.items()}
