"""Sample-image and rollout grids: saved as PNG and sent to the trackers enabled in ``report_to``."""

from __future__ import annotations

import math
import os
from typing import Any

from PIL import Image, ImageDraw


def image_grid(
    images: list[Image.Image], captions: list[str] | None = None, columns: int | None = None
) -> Image.Image:
    """Tile images in a grid, each with an optional caption strip under it."""
    columns = columns or min(len(images), 8)
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    caption_h = 12 if captions else 0
    grid = Image.new("RGB", (columns * width, rows * (height + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, image in enumerate(images):
        x, y = (i % columns) * width, (i // columns) * (height + caption_h)
        grid.paste(image.convert("RGB"), (x, y))
        if captions:
            draw.text((x + 1, y + height), captions[i][: max(1, width // 6)], fill="black")
    return grid


def log_image_grid(
    trainer: Any, images: list[Image.Image], prompts: list[str], step: int, name: str = "samples"
) -> str:
    """Save ``<name>/step-N.png`` under the output dir and log it as ``name`` to TensorBoard, W&B and trackio if
    enabled."""
    grid = image_grid(images, prompts)
    path = _save(grid, trainer.args.output_dir, name, step)
    _send(trainer, name, grid, images, prompts, step)
    return path


def log_completions(
    trainer: Any,
    prompts: list[str],
    images: list[Image.Image],
    rewards: dict[str, list[float]],
    step: int,
    columns: int,
) -> str:
    """TRL's ``log_completions`` for images: the rollout as a grid captioned with each image's total reward, one
    row per prompt group (``columns`` = ``num_generations``), saved as ``completions/step-N.png`` and sent to the
    trackers; W&B also gets a table (prompt, image, total and per-reward scores)."""
    total = rewards["reward"]
    grid = image_grid(images, [f"{r:+.3f}" for r in total], columns=columns)
    path = _save(grid, trainer.args.output_dir, "completions", step)
    captions = [f"{p} | reward {r:+.4g}" for p, r in zip(prompts, total)]
    table = {"step": [step] * len(images), "prompt": prompts, **rewards}
    _send(trainer, "completions", grid, images, captions, step, table=table)
    return path


def save_images(images: list[Image.Image], output_dir: str, folder: str) -> list[str]:
    """Save ``images`` as ``output_dir/folder/<i>.png`` (replacing the previous ones); returns the paths relative
    to ``output_dir``, with ``/`` (they are also paths in the Hub repository)."""
    os.makedirs(os.path.join(output_dir, folder), exist_ok=True)
    paths = []
    for i, image in enumerate(images):
        path = f"{folder.replace(os.sep, '/')}/{i}.png"
        image.save(os.path.join(output_dir, path))
        paths.append(path)
    return paths


def _save(grid: Image.Image, output_dir: str, folder: str, step: int) -> str:
    folder = os.path.join(output_dir, folder)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step-{step:06d}.png")
    grid.save(path)
    return path


def _send(
    trainer: Any,
    key: str,
    grid: Image.Image,
    images: list[Image.Image],
    captions: list[str],
    step: int,
    table: dict[str, list[Any]] | None = None,
) -> None:
    """Log ``grid`` (TensorBoard) or the captioned ``images`` (W&B, trackio) under ``key`` to the enabled trackers;
    W&B gets ``table`` as a ``wandb.Table`` with the images, when given."""
    for callback in trainer.callback_handler.callbacks:
        name = type(callback).__name__
        if name == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            import numpy as np

            callback.tb_writer.add_image(key, np.asarray(grid), step, dataformats="HWC")
        elif name == "WandbCallback" and getattr(callback, "_wandb", None) is not None and callback._initialized:
            wandb = callback._wandb
            logged: dict[str, Any] = {key: [wandb.Image(im, caption=c) for im, c in zip(images, captions)]}
            if table is not None:
                rows = {"image": [wandb.Image(im) for im in images], **table}
                logged[f"{key}_table"] = wandb.Table(columns=list(rows), data=[list(r) for r in zip(*rows.values())])
            wandb.log(logged, step=step)
        elif name == "TrackioCallback":
            import trackio

            trackio.log({key: [trackio.Image(im, caption=c) for im, c in zip(images, captions)]}, step=step)
