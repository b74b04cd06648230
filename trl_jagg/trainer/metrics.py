"""The metrics the stages collect between two logs: lists of values per name, averaged when the trainer logs, the
engine's internals logged under one section (:data:`ENGINE_SECTION`)."""

from __future__ import annotations

import math
from typing import Any

ENGINE_SECTION = "engine/"
"""Where the logs put the engine's internals: ``jagg/backward_calls`` is logged as ``engine/jagg/backward_calls``."""

ENGINE_METRICS: tuple[str, ...] = ("jagg/", "latents/", "advantages/", "zero_advantage/")
"""The name prefixes of the metrics that are engine internals rather than scalars a user acts on: the JAGG engine's
routing, probe and velocity-cache counters (``jagg/``), the rollout's latent spread (``latents/``) and the advantages'
internals (``advantages/``, ``zero_advantage/``). The stages collect them under these names; :func:`logged_means`
moves them under :data:`ENGINE_SECTION`. Every other metric (the rewards, the loss terms, ``time/``, ``hacking/``)
is logged under its own name, TRL's where TRL has one (docs/quickstart.md, "What the logs show")."""


def logged_name(name: str) -> str:
    """The name a collected metric is logged under: :data:`ENGINE_SECTION` prefixed to the engine internals
    (:data:`ENGINE_METRICS`), the name itself otherwise."""
    return ENGINE_SECTION + name if name.startswith(ENGINE_METRICS) else name


def logged_means(metrics: dict[str, list[float]]) -> dict[str, float]:
    """Each metric's mean over its values since the last log, under its :func:`logged_name`. As TRL: NaN entries (a
    reward that returned None for every image of a rollout) are left out, and a metric with no value left is not
    logged (JSON loggers reject NaN)."""
    means = {}
    for key, values in metrics.items():
        valid = [value for value in values if not math.isnan(value)]
        if valid:
            means[logged_name(key)] = sum(valid) / len(valid)
    return means


def first_completions(
    completions: tuple[list[str], list[Any], dict[str, list[Any]]], count: int | None
) -> tuple[list[str], list[Any], dict[str, list[Any]]]:
    """The first ``count`` (``None``: all) of a rollout's (prompts, images, scores), TRL's
    ``num_completions_to_print``."""
    keep = slice(count)
    prompts, images, scores = completions
    return prompts[keep], images[keep], {name: values[keep] for name, values in scores.items()}
