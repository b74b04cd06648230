"""Sample-image and rollout grids: saved as PNG and sent to the trackers enabled in ``report_to``.

Images go through each tracker's public API, the way transformers' callbacks and TRL log: TensorBoard through
``TensorBoardCallback.tb_writer``, W&B through ``wandb.run`` and trackio through ``trackio.log``, both without
``step=`` and with ``train/global_step`` in the record (the step metric ``WandbCallback`` defines): W&B drops a
record whose explicit step is behind its history as "partial history", and trackio counts its own steps.

Image keys never equal a scalar key after transformers' ``rewrite_logs`` (``eval_samples`` is the number of
evaluated prompts, ``eval/samples`` on the trackers): images are ``<section>/sample_images`` and
``train/completion_images``, so the eval grid sits in TensorBoard's ``eval`` section.

A video (a list of frames, from a video model) is logged as its frame strip: the frames side by side, left to right
(:func:`frame_strip`), so grids, PNGs and tables show every frame without a video encoder.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from diffusers.utils import make_image_grid
from PIL import Image, ImageDraw
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, TrackioCallback, WandbCallback

SAMPLES_KEY = "train/sample_images"
COMPLETIONS_KEY = "train/completion_images"
COMPLETIONS_TABLE_KEY = "train/completions"
STEP_METRIC = "train/global_step"  # WandbCallback's step metric; trackio's callback logs it too


def eval_images_key(metric_key_prefix: str = "eval") -> str:
    """The key of ``evaluate()``'s grid: in the section of its metrics (``eval_reward`` shows as ``eval/reward``)."""
    return f"{metric_key_prefix}/sample_images"


def frame_strip(sample: Image.Image | Sequence[Image.Image]) -> Image.Image:
    """An image as is; a video (a list of frames) as its frames side by side, first frame on the left."""
    if isinstance(sample, Image.Image):
        return sample
    width, height = sample[0].size
    strip = Image.new("RGB", (len(sample) * width, height))
    for i, frame in enumerate(sample):
        strip.paste(frame.convert("RGB"), (i * width, 0))
    return strip


CAPTION_LINE_HEIGHT = 11
"""Pixels per caption line (PIL's default bitmap font is 10-11 px tall)."""


def wrap_caption(text: str, width: int, draw: ImageDraw.ImageDraw) -> list[str]:
    """``text`` in lines that each fit ``width`` pixels in ``draw``'s font: broken at spaces, and inside a word too
    long for one line; no character is dropped."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if draw.textlength(candidate) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        line = ""
        for char in word:  # a word wider than the tile: as many characters per line as fit
            if line and draw.textlength(line + char) > width:
                lines.append(line)
                line = ""
            line += char
    return lines + [line] if line else lines


def image_grid(
    images: list[Image.Image], captions: list[str] | None = None, columns: int | None = None
) -> Image.Image:
    """Tile images in a grid (diffusers' ``make_image_grid``), each with an optional caption under it, wrapped to
    the tile's width (every tile as tall as the longest caption needs); a last row left short is filled with
    white."""
    columns = columns or min(len(images), 8)
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines = [wrap_caption(caption, width - 2, measure) for caption in captions] if captions else []
    # At least one line when captioned: a grid's tiles keep one height whatever their captions say.
    caption_h = max(1, *(len(caption) for caption in lines)) * CAPTION_LINE_HEIGHT + 1 if lines else 0
    tiles = []
    for i, image in enumerate(images):
        tile = Image.new("RGB", (width, height + caption_h), "white")
        tile.paste(image.convert("RGB"), (0, 0))
        if lines:
            ImageDraw.Draw(tile).multiline_text(
                (1, height), "\n".join(lines[i]), fill="black", spacing=CAPTION_LINE_HEIGHT - 10
            )
        tiles.append(tile)
    tiles += [Image.new("RGB", (width, height + caption_h), "white")] * (rows * columns - len(tiles))
    return make_image_grid(tiles, rows, columns)


def log_image_grid(
    callbacks: Sequence[TrainerCallback],
    output_dir: str,
    images: list[Image.Image],
    prompts: list[str],
    step: int,
    folder: str = "samples",
    key: str = SAMPLES_KEY,
) -> str:
    """Save ``output_dir/<folder>/step-N.png`` and log the captioned images as ``key`` to the trackers of
    ``callbacks`` (the trainer's ``callback_handler.callbacks``); returns the PNG's path."""
    images = [frame_strip(image) for image in images]
    grid = image_grid(images, prompts)
    path = _save(grid, output_dir, folder, step)
    send_images(callbacks, key, grid, images, prompts, step)
    return path


def log_completions(
    callbacks: Sequence[TrainerCallback],
    output_dir: str,
    prompts: list[str],
    images: list[Image.Image],
    rewards: dict[str, list[float]],
    step: int,
    columns: int,
) -> str:
    """TRL's ``log_completions`` for images: the rollout as a grid captioned with each image's total reward, one
    row per prompt group (``columns`` = ``num_generations``), saved as ``completions/step-N.png`` and sent to the
    trackers; W&B and trackio also get a table (step, prompt, image, total and per-reward scores)."""
    total = rewards["reward"]
    images = [frame_strip(image) for image in images]
    grid = image_grid(images, [f"{r:+.3f}" for r in total], columns=columns)
    path = _save(grid, output_dir, "completions", step)
    captions = [f"{p} | reward {r:+.4g}" for p, r in zip(prompts, total)]
    table = {"step": [step] * len(images), "prompt": prompts, **rewards}
    send_images(callbacks, COMPLETIONS_KEY, grid, images, captions, step, table=table)
    return path


def save_images(images: list[Image.Image], output_dir: str, folder: str) -> list[str]:
    """Save ``images`` as ``output_dir/folder/<i>.png`` (replacing the previous ones); returns the paths relative
    to ``output_dir``, with ``/`` (they are also paths in the Hub repository)."""
    os.makedirs(os.path.join(output_dir, folder), exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = f"{folder.replace(os.sep, '/')}/{i}.png"
        frame_strip(image).save(os.path.join(output_dir, path))
        paths.append(path)
    return paths


def _save(grid: Image.Image, output_dir: str, folder: str, step: int) -> str:
    folder = os.path.join(output_dir, folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step-{step:06d}.png")
    grid.save(path)
    return path


def send_images(
    callbacks: Sequence[TrainerCallback],
    key: str,
    grid: Image.Image,
    images: list[Image.Image],
    captions: list[str],
    step: int,
    table: dict[str, list[Any]] | None = None,
) -> None:
    """Log one image stream under ``key`` to each tracker of ``callbacks``: the ``grid`` to TensorBoard and trackio
    (trackio keeps one image per key; it drops a list), the captioned ``images`` to W&B; ``table`` (columns of equal
    length, one row per image) becomes a W&B / trackio table ``train/completions`` with an image column.

    Call it after the step's scalars were logged (``Trainer.log``): the tracker callbacks set themselves up there
    when they were not yet (an ``evaluate()`` before ``train()``)."""
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
            import numpy as np

            callback.tb_writer.add_image(key, np.asarray(grid), step, dataformats="HWC")
            callback.tb_writer.flush()
        elif isinstance(callback, WandbCallback):
            import wandb

            if wandb.run is None:  # the callback was not set up (report_to lists wandb, no run started yet)
                continue
            record: dict[str, Any] = {key: [wandb.Image(im, caption=c) for im, c in zip(images, captions)]}
            if table is not None:
                record[COMPLETIONS_TABLE_KEY] = _table(wandb, images, table)
            wandb.run.log({**record, STEP_METRIC: step})
        elif isinstance(callback, TrackioCallback):
            import trackio

            record = {key: trackio.Image(grid, caption=" | ".join(captions))}
            if table is not None:
                record[COMPLETIONS_TABLE_KEY] = _table(trackio, images, table)
            trackio.log({**record, STEP_METRIC: step})


def _table(tracker: Any, images: list[Image.Image], columns: dict[str, list[Any]]) -> Any:
    """A ``wandb.Table`` / ``trackio.Table`` (same constructor) with an image column first."""
    rows = {"image": [tracker.Image(im) for im in images], **columns}
    return tracker.Table(columns=list(rows), data=[list(row) for row in zip(*rows.values())])
