"""Pretrain the tiny Flux-architecture pipeline that the CPU demo fine-tunes (``trl_jagg/demo/assets/demo_flux``).

A randomly initialised tiny pipeline is a poor starting point for GRPO: its VAE hardly turns latents into colour, so a
colour reward barely moves, and full fine-tuning games it by blowing up the latents. This script gives the demo a
base model that draws something, procedurally and in a few minutes of one CPU core:

1. Data: 32x32 images of one shape (circle, square or triangle) in one colour of a fixed palette (red, green, blue)
   on a dark grey background, with random size and position (:func:`generate_shapes`).
2. VAE: the pipeline's 16-channel, 8x-downsampling ``AutoencoderKL`` trained on them (reconstruction + a small KL
   term); its ``shift_factor`` / ``scaling_factor`` are then set from the latent statistics, as for the real VAE.
3. Transformer: the tiny ``FluxTransformer2DModel`` trained with the rectified-flow objective
   (``x_sigma = (1 - sigma) x0 + sigma noise``, target ``noise - x0``) on captions that name the shape and never the
   colour (:func:`make_caption`). The base model therefore draws the right shape in a random colour and ignores
   colour words, and GRPO has something to learn: the prompt-colour reward starts negative (about -0.09; two times
   in three the shape has another colour, which scores minus the margin).
4. The pipeline is saved with ``save_pretrained``; the text encoders stay random (frozen), with every demo word a
   single token, so "red", "green" and "blue" get distinct embeddings that fine-tuning can learn to read.

Everything is seeded: the same arguments give the same weights (on the same torch build). Run it from the repository
root (it prints a short evaluation of the saved pipeline and writes a preview grid):

    HF_HUB_OFFLINE=1 .venv/bin/python -m trl_jagg.demo.pretrain

Measured on one shared CPU core: VAE ~1 min, transformer ~1.7 min (2,500 steps), 1.3 MB on disk; the evaluation
(``pretrain_info.json``): shape of the nearest training image matches the prompt for 97% of samples, colour matches
the prompt's colour word for 28% (chance 33%). Rerunning with the defaults reproduces the shipped weights bit for bit
on the same torch build.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from trl_jagg.demo.run import (
    DEMO_ASSET_DIR,
    DEMO_COLORS,
    DEMO_GUIDANCE_SCALE,
    DEMO_IMAGE_SIZE,
    DEMO_MAX_SEQUENCE_LENGTH,
    DEMO_NUM_INFERENCE_STEPS,
    DEMO_SHAPES,
)

# ---------------------------------------------------------------------------------------------------------- data
PALETTE: dict[str, tuple[int, int, int]] = {"red": (225, 45, 45), "green": (45, 225, 45), "blue": (45, 45, 225)}
"""The fixed colours of the shapes (RGB, 0-255): each scores the same prompt-colour margin, 180/255."""
BACKGROUND: tuple[int, int, int] = (24, 24, 24)
"""Dark neutral grey: it scores 0 for every colour under the prompt-colour reward."""
HALF_SIZE_RANGE = (9.0, 13.0)
"""Half the shape's extent in pixels (at 32x32): circles of radius 9-13, squares of side 16-23, ..."""
CENTER_JITTER = 3.0
"""The shape's centre is drawn uniformly within this many pixels of the image centre, on each axis."""
_SUPERSAMPLE = 4

# Caption pieces: every word is in the tiny tokenizers' vocabulary, and none is a colour word.
_CAPTION_PREFIXES = ("a", "a picture of a", "an image of a", "a drawing of a", "one")
_CAPTION_ADJECTIVES = ("", "small", "large", "big", "plain", "centered", "tiny", "bright")
_CAPTION_SUFFIXES = ("", "on a dark background", "in the middle")


def draw_shape(
    shape: str,
    color: str,
    center: tuple[float, float] = (16.0, 16.0),
    half_size: float = 11.0,
    image_size: int = DEMO_IMAGE_SIZE,
) -> np.ndarray:
    """Draw one ``shape`` ("circle", "square", "triangle") of a palette ``color`` on the dark background.

    The shape is drawn at 4x resolution and box-downsampled, so its edges are anti-aliased.

    Returns:
        ``(image_size, image_size, 3)`` uint8 array.
    """
    if shape not in DEMO_SHAPES:
        raise ValueError(f"Unknown shape {shape!r}; expected one of {DEMO_SHAPES}.")
    if color not in PALETTE:
        raise ValueError(f"Unknown colour {color!r}; expected one of {tuple(PALETTE)}.")
    scale = _SUPERSAMPLE
    big = Image.new("RGB", (image_size * scale, image_size * scale), BACKGROUND)
    draw = ImageDraw.Draw(big)
    cx, cy, s = center[0] * scale, center[1] * scale, half_size * scale
    fill = PALETTE[color]
    if shape == "circle":
        draw.ellipse((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "square":
        side = 0.85 * s  # about the area of the circle of the same half size
        draw.rectangle((cx - side, cy - side, cx + side, cy + side), fill=fill)
    else:  # an upward triangle whose bounding box is centred on (cx, cy)
        draw.polygon(((cx, cy - s), (cx + 1.1 * s, cy + 0.9 * s), (cx - 1.1 * s, cy + 0.9 * s)), fill=fill)
    return np.asarray(big.resize((image_size, image_size), Image.Resampling.BOX), dtype=np.uint8)


def generate_shapes(
    num_images: int, seed: int = 0, image_size: int = DEMO_IMAGE_SIZE
) -> tuple[np.ndarray, list[str], list[str]]:
    """A balanced, shuffled set of random one-shape images.

    Every (shape, colour) pair appears ``num_images / 9`` times (up to rounding); size and position are random.

    Returns:
        ``(images, shapes, colors)``: a ``(num_images, image_size, image_size, 3)`` uint8 array and the shape and
        colour name of each image.
    """
    rng = np.random.default_rng(seed)
    pairs = [(shape, color) for shape in DEMO_SHAPES for color in DEMO_COLORS]
    labels = [pairs[i % len(pairs)] for i in range(num_images)]
    order = rng.permutation(num_images)
    labels = [labels[i] for i in order]
    images = np.empty((num_images, image_size, image_size, 3), dtype=np.uint8)
    middle = image_size / 2
    for i, (shape, color) in enumerate(labels):
        center = tuple(middle + rng.uniform(-CENTER_JITTER, CENTER_JITTER, size=2))
        images[i] = draw_shape(shape, color, center, rng.uniform(*HALF_SIZE_RANGE), image_size)
    return images, [s for s, _ in labels], [c for _, c in labels]


def make_caption(shape: str, rng: random.Random) -> str:
    """A caption that names ``shape`` and never a colour, e.g. "a picture of a large circle"."""
    words = [rng.choice(_CAPTION_PREFIXES), rng.choice(_CAPTION_ADJECTIVES), shape, rng.choice(_CAPTION_SUFFIXES)]
    caption = " ".join(w for w in words if w)
    if any(color in caption.split() for color in PALETTE):
        raise AssertionError(f"caption {caption!r} names a colour")
    return caption


def to_model_range(images: np.ndarray) -> torch.Tensor:
    """uint8 ``(N, H, W, 3)`` to float32 ``(N, 3, H, W)`` in [-1, 1], the VAE's input range."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


# ---------------------------------------------------------------------------------------------------------- model
def demo_vocabulary() -> list[str]:
    """Words that must be single tokens: the demo's colours and shapes and every caption word."""
    words = [*DEMO_COLORS, *DEMO_SHAPES]
    for piece in (*_CAPTION_PREFIXES, *_CAPTION_ADJECTIVES, *_CAPTION_SUFFIXES):
        words.extend(piece.split())
    return list(dict.fromkeys(words))


def build_demo_pipeline(seed: int) -> Any:
    """The untrained pipeline: a tiny ``FluxPipeline`` sized for 32x32 images (4 image tokens of 64 features)."""
    from trl_jagg.testing.tiny_models import build_tiny_pipeline

    return build_tiny_pipeline(
        "flux",
        seed=seed,
        vocab_words=demo_vocabulary(),
        clip_max_length=DEMO_MAX_SEQUENCE_LENGTH,
        # 16 latent channels and 8x downsampling, as FLUX.1's VAE; a few channels wide.
        vae={"block_out_channels": (8, 16, 16, 16), "norm_num_groups": 4, "sample_size": DEMO_IMAGE_SIZE},
        transformer={"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2},
    )


def _cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))


def train_vae(
    vae: torch.nn.Module, images: torch.Tensor, *, steps: int, batch_size: int, lr: float, kl_weight: float, seed: int
) -> list[float]:
    """Train the autoencoder: per-pixel MSE + ``kl_weight`` x the per-latent-dimension KL to N(0, 1).

    Returns the reconstruction loss every 50 steps.
    """
    generator = torch.Generator().manual_seed(seed)
    vae.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _cosine_lr(s, steps, warmup=20))
    history = []
    start = time.perf_counter()
    for step in range(steps):
        batch = images[torch.randint(len(images), (batch_size,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        reconstruction = vae.decode(latents).sample
        mse = (reconstruction - batch).pow(2).mean()
        kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
        loss = mse + kl_weight * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 50 == 0 or step == steps - 1:
            history.append(mse.item())
            print(
                f"  vae step {step:4d}  mse {mse.item():.4f}  kl {kl.item():.3f}  {time.perf_counter() - start:5.1f}s"
            )
    vae.eval().requires_grad_(False)
    return history


@torch.no_grad()
def set_latent_normalisation(vae: torch.nn.Module, images: torch.Tensor) -> tuple[float, float]:
    """Set ``shift_factor`` and ``scaling_factor`` so the flow model sees latents of mean 0 and std 1 (as the real
    Flux VAE's factors do for its training data)."""
    means = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    shift, std = means.mean().item(), means.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
    return shift, 1.0 / std


@torch.no_grad()
def encode_for_transformer(pipe: Any, images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Images to the transformer's packed latents: sampled from the posterior, shifted, scaled, packed 2x2."""
    vae = pipe.vae
    chunks = []
    for chunk in images.split(256):
        posterior = vae.encode(chunk).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        b, c, h, w = latents.shape
        chunks.append(pipe._pack_latents(latents, b, c, h, w))
    return torch.cat(chunks)


def train_transformer(
    pipe: Any,
    latents: torch.Tensor,
    captions: Sequence[str],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """Rectified-flow training of the transformer on (packed latent, caption) pairs; the rest stays frozen.

    Uses the trainer's own Flux adapter for the conditioning and the backbone call, so the model is trained exactly
    the way GRPO will call it (embedded guidance :data:`DEMO_GUIDANCE_SCALE`, max sequence length
    :data:`DEMO_MAX_SEQUENCE_LENGTH`). Flow times are drawn uniformly in (0, 1).

    Returns the loss averaged over every 50 steps.
    """
    from trl_jagg.models import load_adapter

    adapter = load_adapter(pipe)
    unique = sorted(set(captions))
    cond_all = adapter.condition(
        unique, height=DEMO_IMAGE_SIZE, width=DEMO_IMAGE_SIZE, max_sequence_length=DEMO_MAX_SEQUENCE_LENGTH
    )
    caption_index = torch.tensor([unique.index(c) for c in captions])
    transformer = pipe.transformer
    transformer.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _cosine_lr(s, steps, warmup=50))
    generator = torch.Generator().manual_seed(seed)
    history, window = [], []
    start = time.perf_counter()
    for step in range(steps):
        index = torch.randint(len(latents), (batch_size,), generator=generator)
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.rand(batch_size, generator=generator)
        x_sigma = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * noise
        velocity = adapter.predict_velocity(
            transformer,
            x_sigma,
            sigma * 1000,  # scheduler timesteps; the adapter divides by 1000 as the pipeline does
            cond_all.select(caption_index[index]),
            guidance_scale=DEMO_GUIDANCE_SCALE,
            true_cfg_scale=1.0,
        )
        loss = (velocity - (noise - x0)).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())
        if (step + 1) % 50 == 0 or step == steps - 1:
            history.append(sum(window) / len(window))
            window = []
            print(f"  flow step {step + 1:4d}  loss {history[-1]:.4f}  {time.perf_counter() - start:5.1f}s")
    transformer.eval().requires_grad_(False)
    return history


# ---------------------------------------------------------------------------------------------------------- checks
def dominant_colors(images: Sequence[Image.Image]) -> list[str]:
    """The palette colour whose channel leads over the most pixels of each image's shape ("none" if no shape)."""
    names = []
    for image in images:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
        foreground = pixels.max(axis=-1) > 0.35
        if foreground.sum() < 8:
            names.append("none")
            continue
        counts = np.bincount(pixels[foreground].argmax(axis=-1), minlength=3)
        names.append(DEMO_COLORS[int(counts.argmax())])
    return names


def nearest_shapes(
    images: Sequence[Image.Image], references: np.ndarray, reference_shapes: Sequence[str]
) -> list[str]:
    """The shape of the nearest reference image by the shape's silhouette (colour-blind): a cheap shape classifier."""

    def silhouettes(array: np.ndarray) -> np.ndarray:
        return (array.astype(np.float32).max(axis=-1) / 255.0).reshape(len(array), -1)

    queries = silhouettes(np.stack([np.asarray(image.convert("RGB")) for image in images]))
    refs = silhouettes(references)
    distances = (queries**2).sum(1)[:, None] - 2 * queries @ refs.T + (refs**2).sum(1)[None, :]
    return [reference_shapes[i] for i in distances.argmin(axis=1)]


def evaluate(pipe: Any, references: np.ndarray, reference_shapes: Sequence[str], seeds: int = 8) -> dict[str, Any]:
    """Sample every colour x shape prompt with ``seeds`` seeds (deterministic ODE, the demo's settings) and measure
    what the demo relies on: the shape follows the prompt, the colour does not (so GRPO has something to learn)."""
    from trl_jagg.models import load_adapter
    from trl_jagg.models.rollout import generate_images
    from trl_jagg.rewards.programmatic import color_margin

    adapter = load_adapter(pipe)
    prompts = [f"a {color} {shape}" for color in DEMO_COLORS for shape in DEMO_SHAPES]
    images, asked = [], []
    for seed in range(seeds):
        images += generate_images(
            adapter, prompts, num_steps=DEMO_NUM_INFERENCE_STEPS, height=DEMO_IMAGE_SIZE, width=DEMO_IMAGE_SIZE,
            guidance_scale=DEMO_GUIDANCE_SCALE, max_sequence_length=DEMO_MAX_SEQUENCE_LENGTH, seed=seed,
        )  # fmt: skip
        asked += prompts
    colors = dominant_colors(images)
    shapes = nearest_shapes(images, references, reference_shapes)
    asked_colors = [p.split()[1] for p in asked]
    asked_shapes = [p.split()[2] for p in asked]
    margins = [color_margin(image, color) for image, color in zip(images, asked_colors)]
    return {
        "images": images,
        "num_images": len(images),
        "shape_accuracy": float(np.mean([a == b for a, b in zip(shapes, asked_shapes)])),
        "color_match_rate": float(np.mean([a == b for a, b in zip(colors, asked_colors)])),
        "color_distribution": {c: colors.count(c) / len(colors) for c in (*DEMO_COLORS, "none")},
        "prompt_color_reward_mean": float(np.mean(margins)),
        "best_color_margin_mean": float(
            np.mean([max(color_margin(image, c) for c in DEMO_COLORS) for image in images])
        ),
    }


# ---------------------------------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Pretrain and save the demo pipeline; returns the evaluation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=DEMO_ASSET_DIR, help="Where to save_pretrained the pipeline.")
    parser.add_argument("--preview", default="runs/pretrain_demo/samples.png", help="Preview grid of samples.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights, the data and the training.")
    parser.add_argument("--num_images", type=int, default=4608, help="Size of the generated training set.")
    parser.add_argument("--vae_steps", type=int, default=600)
    parser.add_argument("--vae_batch_size", type=int, default=32)
    parser.add_argument("--vae_lr", type=float, default=2e-3)
    parser.add_argument("--kl_weight", type=float, default=1e-3, help="Weight of the per-dimension KL term.")
    parser.add_argument("--flow_steps", type=int, default=2500)
    parser.add_argument("--flow_batch_size", type=int, default=64)
    parser.add_argument("--flow_lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these tiny kernels).")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    images_u8, shapes, colors = generate_shapes(args.num_images, seed=args.seed)
    images = to_model_range(images_u8)
    rng = random.Random(args.seed)
    captions = [make_caption(shape, rng) for shape in shapes]
    print(f"data: {len(images)} images, {len(set(captions))} distinct captions, e.g. {captions[:3]}")

    pipe = build_demo_pipeline(args.seed)
    print("training the VAE ...")
    vae_history = train_vae(
        pipe.vae, images, steps=args.vae_steps, batch_size=args.vae_batch_size, lr=args.vae_lr,
        kl_weight=args.kl_weight, seed=args.seed,
    )  # fmt: skip
    shift, scale = set_latent_normalisation(pipe.vae, images)
    print(f"  latent shift_factor {shift:.4f}, scaling_factor {scale:.4f}")
    vae_seconds = time.perf_counter() - start

    print("training the transformer (rectified flow, colour-free captions) ...")
    latents = encode_for_transformer(pipe, images, torch.Generator().manual_seed(args.seed + 1))
    flow_history = train_transformer(
        pipe, latents, captions, steps=args.flow_steps, batch_size=args.flow_batch_size, lr=args.flow_lr,
        seed=args.seed + 2,
    )  # fmt: skip
    train_seconds = time.perf_counter() - start

    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    os.makedirs(args.output_dir, exist_ok=True)
    pipe.save_pretrained(args.output_dir)

    report = evaluate(pipe, images_u8[:1536], shapes[:1536])
    samples = report.pop("images")
    info = {
        "script": "python -m trl_jagg.demo.pretrain",
        "arguments": vars(args) | {"output_dir": os.path.relpath(args.output_dir)},
        "palette": PALETTE,
        "background": BACKGROUND,
        "image_size": DEMO_IMAGE_SIZE,
        "max_sequence_length": DEMO_MAX_SEQUENCE_LENGTH,
        "guidance_scale": DEMO_GUIDANCE_SCALE,
        "num_inference_steps": DEMO_NUM_INFERENCE_STEPS,
        "vae_mse": [round(v, 5) for v in vae_history],
        "flow_loss": [round(v, 5) for v in flow_history],
        "seconds": {"vae": round(vae_seconds, 1), "total": round(train_seconds, 1)},
        "evaluation": report,
        "torch": torch.__version__,
    }
    with open(os.path.join(args.output_dir, "pretrain_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    if args.preview:
        from trl_jagg.trainer.image_logging import image_grid

        os.makedirs(os.path.dirname(args.preview) or ".", exist_ok=True)
        reconstruction = pipe.vae.decode(pipe.vae.encode(images[:9]).latent_dist.mean).sample
        originals = [Image.fromarray(a) for a in images_u8[:9]]
        recons = pipe.image_processor.postprocess(reconstruction, output_type="pil")
        grid = image_grid(originals + recons + samples[:36], columns=9)
        grid.resize((grid.width * 3, grid.height * 3), Image.Resampling.NEAREST).save(args.preview)
        print(f"preview (9 data, 9 reconstructions, 4 rows of samples for 'a <colour> <shape>'): {args.preview}")
    print(json.dumps(report, indent=2))
    print(f"saved to {args.output_dir} in {train_seconds:.0f} s of training")
    return report


if __name__ == "__main__":
    main()
