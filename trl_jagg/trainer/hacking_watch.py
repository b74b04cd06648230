"""Reward hacking, watched: cheap statistics of every rollout's decoded images and rewards, logged through
``report_to``, and a warning, once per cause, when one moves past its threshold relative to the run's start.

A policy that games its reward shows it in the images before anyone looks at them: the images of one prompt's
group grow alike (diversity collapses), they saturate towards black or white, their colours narrow, and the reward
on the training prompts pulls away from the reward on held-out ones. UniRL measured it without a KL anchor: the
dark-pixel fraction rose from 0.45 to 0.93 in 100 rollouts and colour entropy fell by 54 %.

Logged per rollout (``hacking/...``):

- ``diversity``: mean pairwise RMS distance between the 16 x 16 downsampled images of one prompt's group, averaged
  over the groups (0: identical images);
- ``dark_fraction`` and ``bright_fraction``: the share of pixels with luminance below 0.1 or above 0.9;
- ``colour_entropy``: entropy (bits) of the rollout's colours quantised to 8 levels per channel (at most 9 bits);
- ``reward_spread``: the mean, over groups, of the rewards' standard deviation within a group;
- ``train_eval_gap``: after each evaluation, the latest training reward less the evaluation reward.

The warnings (:class:`RewardHackingWarning`) compare with the first rollout (the first evaluation for the gap):
:data:`THRESHOLDS` documents each. They name the statistic, its values, the step, and what to try.

Under several processes (DDP, FSDP, DeepSpeed) each holds only its shard of the rollout, and a prompt's group may be
split between processes: the statistics are computed over the whole gathered rollout (:func:`gathered_parts`:
the downsampled images, the rewards and the group keys gathered, the pixel and colour counts summed), so every
process logs the same values and warns, or not, at the same step.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

PREFIX = "hacking/"
DOWNSAMPLED = 16
DARK, BRIGHT = 0.1, 0.9
COLOUR_LEVELS = 8
REMEDIES = (
    "a KL anchor (beta > 0), GRPO-Guard (the flow-grpo-guard-* presets), a lower learning_rate, or a second reward "
    "that the first cannot game (reward_funcs with reward_weights)"
)


class RewardHackingWarning(UserWarning):
    """A rollout statistic crossed its threshold: the policy may be gaming its reward."""


def as_pixels(images: Sequence[Any] | torch.Tensor) -> torch.Tensor:
    """Images (PIL images, ``(C, H, W)`` tensors in [0, 1], or one ``(N, C, H, W)`` tensor) as an ``(N, 3, H, W)``
    float tensor in [0, 1]; video samples (lists of frames) count their first frame."""
    if isinstance(images, torch.Tensor):
        pixels = images.float()
    else:
        import numpy as np

        frames = []
        for image in images:
            if isinstance(image, (list, tuple)):
                image = image[0]
            if isinstance(image, torch.Tensor):
                frames.append(image.float().cpu())
            else:
                array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
                frames.append(torch.from_numpy(array).permute(2, 0, 1))
        pixels = torch.stack(frames)
    if pixels.shape[1] == 1:
        pixels = pixels.expand(-1, 3, -1, -1)
    return pixels.clamp(0, 1)


def _groups(keys: Sequence[Any]) -> list[list[int]]:
    grouped: dict[Any, list[int]] = defaultdict(list)
    for index, key in enumerate(keys):
        grouped[key].append(index)
    return list(grouped.values())


def downsampled(pixels: torch.Tensor) -> torch.Tensor:
    """Each image as its :data:`DOWNSAMPLED` x :data:`DOWNSAMPLED` average-pooled pixels, flattened: ``(N, 3 x 16 x
    16)``, what :func:`group_diversity` compares."""
    return F.adaptive_avg_pool2d(pixels, DOWNSAMPLED).flatten(1)


def _diversity(small: torch.Tensor, keys: Sequence[Any]) -> float:
    distances = []
    for group in _groups(keys):
        if len(group) < 2:
            continue
        members = small[group]
        pairwise = torch.cdist(members, members) / math.sqrt(members.shape[1])
        count = len(group)
        distances.append(pairwise.sum().item() / (count * (count - 1)))
    return sum(distances) / len(distances) if distances else math.nan


def group_diversity(pixels: torch.Tensor, keys: Sequence[Any]) -> float:
    """Mean pairwise RMS distance of the downsampled images within each group of equal ``keys`` (NaN without a
    group of two)."""
    return _diversity(downsampled(pixels), keys)


def colour_counts(pixels: torch.Tensor) -> torch.Tensor:
    """How many pixels have each colour, each channel quantised to :data:`COLOUR_LEVELS` levels (``COLOUR_LEVELS **
    3`` counts, int64)."""
    levels = (pixels * COLOUR_LEVELS).long().clamp(max=COLOUR_LEVELS - 1)
    codes = (levels[:, 0] * COLOUR_LEVELS + levels[:, 1]) * COLOUR_LEVELS + levels[:, 2]
    return torch.bincount(codes.flatten(), minlength=COLOUR_LEVELS**3)


def _entropy(counts: torch.Tensor) -> float:
    counts = counts.double()
    shares = counts[counts > 0] / counts.sum()
    return float(-(shares * shares.log2()).sum())


def colour_entropy(pixels: torch.Tensor) -> float:
    """Entropy in bits of the pixels' colours, each channel quantised to :data:`COLOUR_LEVELS` levels."""
    return _entropy(colour_counts(pixels))


def reward_spread(rewards: torch.Tensor, keys: Sequence[Any]) -> float:
    """Mean over groups of the rewards' standard deviation within the group (NaN without a group of two)."""
    spreads = [rewards[group].std().item() for group in _groups(keys) if len(group) > 1]
    return sum(spreads) / len(spreads) if spreads else math.nan


@dataclass(frozen=True)
class RolloutParts:
    """What the statistics of a rollout are computed from, in a form that joins over processes: rows to gather
    (``small``, ``rewards``, ``keys``) and counts to sum (``pixel_counts``, ``colours``)."""

    small: torch.Tensor
    """:func:`downsampled` images, ``(N, 768)``."""
    rewards: torch.Tensor
    """``(N,)`` float32."""
    keys: list[Any]
    """Each image's group (its prompt)."""
    pixel_counts: torch.Tensor
    """int64 ``[dark pixels, bright pixels, all pixels]``."""
    colours: torch.Tensor
    """:func:`colour_counts`."""


def rollout_parts(
    images: Sequence[Any] | torch.Tensor, rewards: Sequence[float] | torch.Tensor, keys: Sequence[Any]
) -> RolloutParts:
    """The :class:`RolloutParts` of one process's rollout; ``keys`` name each image's group (its prompt)."""
    pixels = as_pixels(images)
    if len(keys) != pixels.shape[0]:
        raise ValueError(f"{len(keys)} group keys for {pixels.shape[0]} images: give one key (prompt) per image.")
    luminance = 0.299 * pixels[:, 0] + 0.587 * pixels[:, 1] + 0.114 * pixels[:, 2]
    counts = [(luminance < DARK).sum(), (luminance > BRIGHT).sum(), torch.tensor(luminance.numel())]
    return RolloutParts(
        small=downsampled(pixels),
        rewards=torch.as_tensor(rewards, dtype=torch.float32).flatten(),
        keys=list(keys),
        pixel_counts=torch.stack(counts).long(),
        colours=colour_counts(pixels),
    )


def gathered_parts(parts: RolloutParts, accelerator: Any | None) -> RolloutParts:
    """Every process's :class:`RolloutParts` joined, in process order (``accelerator``'s ``gather`` and ``reduce``,
    as the trainer gathers rewards; ``gather_object`` for the keys); ``parts`` itself on one process. Every process
    must call it at the same point with rollouts of the same size (the trainer's are)."""
    if accelerator is None or accelerator.num_processes == 1:
        return parts
    from accelerate.utils import gather_object

    device = accelerator.device
    return RolloutParts(
        small=accelerator.gather(parts.small.to(device)).cpu(),
        rewards=accelerator.gather(parts.rewards.to(device)).cpu(),
        keys=gather_object(parts.keys),
        pixel_counts=accelerator.reduce(parts.pixel_counts.to(device), reduction="sum").cpu(),
        colours=accelerator.reduce(parts.colours.to(device), reduction="sum").cpu(),
    )


def parts_statistics(parts: RolloutParts) -> dict[str, float]:
    """The statistics (see the module docstring) of a rollout's (gathered) :class:`RolloutParts`."""
    dark, bright, total = parts.pixel_counts.tolist()
    return {
        "diversity": _diversity(parts.small, parts.keys),
        "dark_fraction": dark / total,
        "bright_fraction": bright / total,
        "colour_entropy": _entropy(parts.colours),
        "reward_spread": reward_spread(parts.rewards, parts.keys),
    }


def rollout_statistics(
    images: Sequence[Any] | torch.Tensor,
    rewards: Sequence[float] | torch.Tensor,
    keys: Sequence[Any],
    accelerator: Any | None = None,
) -> dict[str, float]:
    """The statistics of one rollout (see the module docstring); ``keys`` name each image's group (its prompt).
    With an ``accelerator`` of several processes, each passes its shard and all get the whole rollout's values."""
    return parts_statistics(gathered_parts(rollout_parts(images, rewards, keys), accelerator))


@dataclass(frozen=True)
class Threshold:
    """When a statistic warns: ``test(value, start)``, ``start`` holding every statistic's value at the start of
    the run (``eval_reward`` too, once an evaluation ran)."""

    statistic: str
    meaning: str
    test: Callable[[float, Mapping[str, float]], bool]


THRESHOLDS = (
    Threshold(
        "diversity",
        "diversity collapsed (below half its start)",
        lambda value, start: value < 0.5 * start["diversity"],
    ),
    Threshold(
        "saturation",
        "saturation doubled (dark + bright pixels, and above 5 % of all pixels)",
        lambda value, start: value > 2 * start["saturation"] and value > 0.05,
    ),
    Threshold(
        "colour_entropy",
        "colour entropy fell by more than 40 %",
        lambda value, start: value < 0.6 * start["colour_entropy"],
    ),
    Threshold(
        "train_eval_gap",
        "the train-eval reward gap grew (by more than 0.05 and a quarter of the first |eval reward|)",
        lambda value, start: value - start["train_eval_gap"] > max(0.05, 0.25 * abs(start["eval_reward"])),
    ),
)
"""Each warning's statistic and rule, against the first rollout (the first evaluation for the gap)."""


class RewardHackingWatch(TrainerCallback):
    """Computes :func:`rollout_statistics` of each rollout it is shown, puts them into ``metrics`` (the trainer's
    per-log lists, so ``Trainer.log`` sends them to every ``report_to`` tracker), and warns once per cause.

    Args:
        metrics: the trainer's ``metric name -> values since the last log`` (``DDPOJaggTrainer._metrics``).
        rollouts: returns the latest rollout as ``(prompts, images, scores)`` with ``scores["reward"]``, or
            ``None`` (the trainer's ``generation.completions``); read at each step's end, each rollout once.
        accelerator: the trainer's accelerator: with several processes, each rollout's statistics (and the train
            reward of the train-eval gap) are those of every process's shard together (:func:`gathered_parts`), so
            every process logs and warns alike. ``None``: this process's rollout alone.
    """

    def __init__(
        self,
        metrics: dict[str, list[float]],
        rollouts: Callable[[], tuple[list[str], list, Mapping[str, list[Any]]] | None] = lambda: None,
        accelerator: Any | None = None,
    ):
        self.metrics = metrics
        self.rollouts = rollouts
        self.accelerator = accelerator
        self.start: dict[str, float] = {}
        self.warned: set[str] = set()
        self.last_train_reward: float | None = None
        self._last_seen: Any = None  # the rollout itself: an id could be reused once the trainer drops it

    def observe(self, prompts: Sequence[str], images: Sequence[Any], rewards: Sequence[float], step: int) -> dict:
        """Record and check one rollout's statistics (over every process's shard); returns them."""
        parts = gathered_parts(rollout_parts(images, rewards, list(prompts)), self.accelerator)
        statistics = parts_statistics(parts)
        statistics["saturation"] = statistics["dark_fraction"] + statistics["bright_fraction"]
        for name, value in statistics.items():
            if name != "saturation":
                self.metrics.setdefault(PREFIX + name, []).append(value)
        finite = {name: value for name, value in statistics.items() if not math.isnan(value)}
        self.last_train_reward = float(parts.rewards.mean())
        for name, value in finite.items():
            self.start.setdefault(name, value)
        self._check(finite, step)
        return statistics

    def observe_evaluation(self, eval_reward: float, step: int) -> float | None:
        """Record the train-eval gap after an evaluation (``None`` before any training rollout)."""
        if self.last_train_reward is None:
            return None
        gap = self.last_train_reward - eval_reward
        self.metrics.setdefault(PREFIX + "train_eval_gap", []).append(gap)
        self.start.setdefault("train_eval_gap", gap)
        self.start.setdefault("eval_reward", eval_reward)
        self._check({"train_eval_gap": gap}, step)
        return gap

    def _check(self, values: Mapping[str, float], step: int) -> None:
        for threshold in THRESHOLDS:
            name = threshold.statistic
            if name in self.warned or name not in values or name not in self.start:
                continue
            if threshold.test(values[name], self.start):
                self.warned.add(name)
                warnings.warn(
                    f"Possible reward hacking at step {step}: {threshold.meaning}: {name} is {values[name]:.3g}, "
                    f"{self.start[name]:.3g} at the start. Look at the latest images; to counter it try {REMEDIES}.",
                    RewardHackingWarning,
                    stacklevel=2,
                )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rollout = self.rollouts()
        if rollout is None or rollout is self._last_seen:
            return
        self._last_seen = rollout
        prompts, images, scores = rollout
        self.observe(prompts, images, scores["reward"], state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Mapping[str, float] | None = None, **kwargs):
        reward = (metrics or {}).get("eval_reward")
        if reward is not None:
            self.observe_evaluation(float(reward), state.global_step)
