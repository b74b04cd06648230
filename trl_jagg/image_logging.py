"""Sample-image grids: saved as PNG and sent to the trackers enabled in ``report_to``."""

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


def log_image_grid(trainer: Any, images: list[Image.Image], prompts: list[str], step: int) -> str:
    """Save ``samples/step-N.png`` under the output dir and log it to TensorBoard, W&B and trackio if enabled."""
    grid = image_grid(images, prompts)
    folder = os.path.join(trainer.args.output_dir, "samples")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step-{step:06d}.png")
    grid.save(path)
    for callback in trainer.callback_handler.callbacks:
        name = type(callback).__name__
        if name == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
            import numpy as np

            callback.tb_writer.add_image("samples", np.asarray(grid), step, dataformats="HWC")
        elif name == "WandbCallback" and getattr(callback, "_wandb", None) is not None and callback._initialized:
            wandb = callback._wandb
            wandb.log({"samples": [wandb.Image(im, caption=p) for im, p in zip(images, prompts)]}, step=step)
        elif name == "TrackioCallback":
            import trackio

            trackio.log({"samples": [trackio.Image(im, caption=p) for im, p in zip(images, prompts)]}, step=step)
    return path
