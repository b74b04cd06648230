"""The inputs of one backbone call at the run's sizes, as the family's adapter (:mod:`trl_jagg.models`) passes them.

Each builder returns keyword arguments for the transformer's ``forward`` on the device current when it is called
(``meta`` for a plan, the CPU for a check against a real run): ``rows`` samples of a ``height`` x ``width`` image
with ``text_tokens`` prompt tokens and, for an editing model, ``references`` source images of the same size whose
latent tokens follow the generated ones in the sequence (as ``FlowMatchingAdapter.with_reference_tokens`` appends
them). A video model's samples are ``num_frames`` pixel frames, ``(num_frames - 1) // 4 + 1`` latent frames as
``WanPipeline.prepare_latents`` sizes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

VAE_FACTOR = 8
"""Pixels per latent side of the families' VAEs (AutoencoderKL, AutoencoderKLQwenImage)."""
TEMPORAL_FACTOR = 4
"""Pixel frames per latent frame of Wan's causal video VAE (after the first frame)."""
CLIP_TOKENS = 77
"""SD3 concatenates the CLIP prompt embedding (77 tokens) before T5's ``max_sequence_length`` tokens."""


def packed_tokens(height: int, width: int) -> int:
    """Image tokens of the families that pack 2 x 2 latents into a token (Flux, Qwen-Image)."""
    return (height // (2 * VAE_FACTOR)) * (width // (2 * VAE_FACTOR))


def latent_frames(num_frames: int) -> int:
    """Latent frames of a ``num_frames``-frame video (``4 k + 1`` frames: ``k + 1``), as the Wan pipeline sizes
    them."""
    return (num_frames - 1) // TEMPORAL_FACTOR + 1


def flux_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, references: int = 0
) -> dict[str, Any]:
    """``FluxTransformer2DModel``: packed latent tokens, T5 embeddings, CLIP's pooled embedding, embedded guidance."""
    tokens = packed_tokens(height, width) * (1 + references)
    return {
        "hidden_states": torch.randn(rows, tokens, config["in_channels"]),
        "encoder_hidden_states": torch.randn(rows, text_tokens, config["joint_attention_dim"]),
        "pooled_projections": torch.randn(rows, config["pooled_projection_dim"]),
        "timestep": torch.full((rows,), 0.5),
        "guidance": torch.full((rows,), 3.5) if config.get("guidance_embeds") else None,
        "img_ids": torch.zeros(tokens, 3),
        "txt_ids": torch.zeros(text_tokens, 3),
    }


def sd3_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, references: int = 0
) -> dict[str, Any]:
    """``SD3Transformer2DModel``: latent images, CLIP + T5 embeddings, the pooled CLIP embeddings."""
    if references:
        raise ValueError("SD3 backbones take no reference images: references must be 0.")
    side_h, side_w = height // VAE_FACTOR, width // VAE_FACTOR
    return {
        "hidden_states": torch.randn(rows, config["in_channels"], side_h, side_w),
        "encoder_hidden_states": torch.randn(rows, CLIP_TOKENS + text_tokens, config["joint_attention_dim"]),
        "pooled_projections": torch.randn(rows, config["pooled_projection_dim"]),
        "timestep": torch.full((rows,), 500.0),
    }


def qwenimage_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, references: int = 0
) -> dict[str, Any]:
    """``QwenImageTransformer2DModel``: packed latent tokens, Qwen2.5-VL embeddings with their mask, one image grid
    per image of each row's sequence (Qwen-Image-Edit: the generated one, then the references)."""
    tokens = packed_tokens(height, width) * (1 + references)
    grid = (1, height // (2 * VAE_FACTOR), width // (2 * VAE_FACTOR))
    return {
        "hidden_states": torch.randn(rows, tokens, config["in_channels"]),
        "encoder_hidden_states": torch.randn(rows, text_tokens, config["joint_attention_dim"]),
        "encoder_hidden_states_mask": torch.ones(rows, text_tokens),
        "timestep": torch.full((rows,), 0.5),
        "img_shapes": [[grid] * (1 + references)] * rows,
    }


def flux2_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, references: int = 0
) -> dict[str, Any]:
    """``Flux2Transformer2DModel`` (FLUX.2 dev and klein): 2x2-patchified latent tokens, the text encoder's stacked
    hidden states, one position id per axis (time, row, column, layer), embedded guidance for dev only."""
    if references:
        raise ValueError("The planner sizes FLUX.2 text-to-image runs: references must be 0.")
    tokens = packed_tokens(height, width)
    axes = len(config["axes_dims_rope"])
    return {
        "hidden_states": torch.randn(rows, tokens, config["in_channels"]),
        "encoder_hidden_states": torch.randn(rows, text_tokens, config["joint_attention_dim"]),
        "timestep": torch.full((rows,), 0.5),
        "guidance": torch.full((rows,), 4.0) if config.get("guidance_embeds") else None,
        "img_ids": torch.zeros(tokens, axes),
        "txt_ids": torch.zeros(text_tokens, axes),
    }


def zimage_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, references: int = 0
) -> dict[str, Any]:
    """``ZImageTransformer2DModel``: one ``(channels, 1, h, w)`` latent and one ``(tokens, dim)`` prompt embedding per
    sample, as lists (every prompt ``text_tokens`` long: Z-Image keeps each prompt's own length, so this is the
    longest a run's prompts can be)."""
    if references:
        raise ValueError("Z-Image backbones take no reference images: references must be 0.")
    side_h, side_w = height // VAE_FACTOR, width // VAE_FACTOR
    return {
        "x": [torch.randn(config["in_channels"], 1, side_h, side_w) for _ in range(rows)],
        "t": torch.full((rows,), 0.5),
        "cap_feats": [torch.randn(text_tokens, config["cap_feat_dim"]) for _ in range(rows)],
    }


def wan_inputs(
    config: Mapping[str, Any], rows: int, height: int, width: int, text_tokens: int, num_frames: int
) -> dict[str, Any]:
    """``WanTransformer3DModel``: 5-D video latents ``(rows, channels, latent frames, h, w)`` and UMT5 embeddings."""
    return {
        "hidden_states": torch.randn(
            rows, config["in_channels"], latent_frames(num_frames), height // VAE_FACTOR, width // VAE_FACTOR
        ),
        "timestep": torch.full((rows,), 500.0),
        "encoder_hidden_states": torch.randn(rows, text_tokens, config["text_dim"]),
    }


BACKBONE_INPUTS: dict[str, Callable[..., dict[str, Any]]] = {
    "FluxTransformer2DModel": flux_inputs,
    "SD3Transformer2DModel": sd3_inputs,
    "QwenImageTransformer2DModel": qwenimage_inputs,
    "Flux2Transformer2DModel": flux2_inputs,
    "ZImageTransformer2DModel": zimage_inputs,
}
"""Image backbone class name -> its input builder."""

VIDEO_BACKBONE_INPUTS: dict[str, Callable[..., dict[str, Any]]] = {"WanTransformer3DModel": wan_inputs}
"""Video backbone class name -> its input builder (it takes ``num_frames``, not ``references``)."""


def backbone_inputs(
    class_name: str,
    config: Mapping[str, Any],
    *,
    rows: int,
    height: int,
    width: int,
    text_tokens: int,
    references: int = 0,
    num_frames: int | None = None,
) -> dict[str, Any]:
    """The keyword arguments of one call of the backbone ``class_name`` (see the module docstring); ``num_frames``
    is a video backbone's (``None`` for an image one).

    Raises:
        ValueError: for a backbone the planner cannot feed yet (the message lists those it can), frames for an
            image backbone, or a video backbone without them.
    """
    if class_name in VIDEO_BACKBONE_INPUTS:
        if num_frames is None or num_frames < 1 or references:
            raise ValueError(
                f"{class_name} makes videos: pass num_frames (1 or more, Wan: 4 k + 1) and no reference images."
            )
        return VIDEO_BACKBONE_INPUTS[class_name](config, rows, height, width, text_tokens, num_frames)
    if class_name not in BACKBONE_INPUTS:
        known = ", ".join([*BACKBONE_INPUTS, *VIDEO_BACKBONE_INPUTS])
        raise ValueError(f"The planner does not size {class_name} backbones yet (it sizes {known}).")
    if num_frames is not None:
        raise ValueError(f"{class_name} makes images: num_frames must be None, not {num_frames}.")
    return BACKBONE_INPUTS[class_name](config, rows, height, width, text_tokens, references)
