"""Rewards of videos: a sample of a video model (Wan) is a list of PIL frames. A reward that declares
``func.takes_videos = True`` receives the whole clips; any other (every image reward) scores each frame and the
sample gets the mean over its frames, as Flow-GRPO scores Wan's videos with an image reward
(``flow_grpo/ocr.py:92-119`` at zhtmike/flow_grpo@9745241: one OCR score per frame, averaged)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def takes_videos(func: Any) -> bool:
    """Whether reward ``func`` declares (``func.takes_videos = True``) that it scores whole videos (lists of frames);
    the others score videos frame by frame (:func:`frame_kwargs`, :func:`video_means`)."""
    return getattr(func, "takes_videos", False) is True


def is_video_batch(images: Sequence[Any]) -> bool:
    """Whether the samples are videos (lists of frames) rather than images."""
    return len(images) > 0 and isinstance(images[0], (list, tuple))


def frame_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The keywords of a per-frame reward call for the videos in ``kwargs["images"]``, and each video's frame
    count: ``images`` / ``completions`` are the frames in order, and every per-sample list (``prompts``, the dataset
    columns) repeats its value once per frame of its video. ``log_extra`` keeps one value per video, its first
    frame's, so the completions table keeps one row per sample."""
    videos = kwargs["images"]
    counts = [len(video) for video in videos]

    def per_frame(values: Any) -> Any:
        if isinstance(values, (list, tuple)) and len(values) == len(videos):
            return [value for value, count in zip(values, counts) for _ in range(count)]
        return values

    starts = [sum(counts[:i]) for i in range(len(counts))]
    frames = [frame for video in videos for frame in video]
    expanded = {key: per_frame(value) for key, value in kwargs.items()}
    expanded |= {"images": frames, "completions": frames}
    if "log_extra" in kwargs:
        log_extra = kwargs["log_extra"]
        expanded["log_extra"] = lambda column, values: log_extra(column, [list(values)[i] for i in starts])
    return expanded, counts


def video_means(frame_scores: torch.Tensor, counts: Sequence[int]) -> list[float | None]:
    """Each video's mean over its frames' scores (checked, NaN where the reward returned ``None``): frames without a
    score are left out, and a video none of whose frames is scored is ``None`` (not applicable)."""
    means: list[float | None] = []
    for scores in frame_scores.split(list(counts)):
        scored = scores[~scores.isnan()]
        means.append(scored.mean().item() if scored.numel() else None)
    return means
