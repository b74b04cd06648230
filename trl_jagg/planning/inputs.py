"""The inputs of one backbone call at the run's sizes, as the family's adapter (:mod:`trl_jagg.models`) passes them.

Each builder returns keyword arguments for the transformer's ``forward`` on the device current when it is called
(``meta`` for a plan, the CPU for a check against a real run): ``rows`` samples of a ``height`` x ``width`` image
with ``text_tokens`` prompt tokens and, for an editing model, ``references`` source images of the same size whose
latent tokens follow the generated ones in the sequence (as ``FlowMatchingAdapter.with_reference_tokens`` appends
them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

VAE_FACTOR = 8
"""Pixels per latent side of the families' VAEs (AutoencoderKL, AutoencoderKLQwenImage)."""
CLIP_TOKENS = 77
"""SD3 concatenates the CLIP prompt embedding (77 tokens) before T5's ``max_sequence_length`` tokens."""


def packed_tokens(height: int, width: int) -> int:
    """Image tokens of the families that pack 2 x 2 latents into a token (Flux, Qwen-Image)."""
    return (height // (2 * VAE_FACTOR)) * (width // (2 * VAE_FACTOR))


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


BACKBONE_INPUTS: dict[str, Callable[..., dict[str, Any]]] = {
    "FluxTransformer2DModel": flux_inputs,
    "SD3Transformer2DModel": sd3_inputs,
    "QwenImageTransformer2DModel": qwenimage_inputs,
}
"""Backbone class name -> its input builder."""

BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")
"""The attributes holding a backbone's transformer blocks (what activation checkpointing wraps)."""


def backbone_inputs(
    class_name: str,
    config: Mapping[str, Any],
    *,
    rows: int,
    height: int,
    width: int,
    text_tokens: int,
    references: int = 0,
) -> dict[str, Any]:
    """The keyword arguments of one call of the backbone ``class_name`` (see the module docstring).

    Raises:
        ValueError: for a backbone the planner cannot feed yet (the message lists those it can).
    """
    if class_name not in BACKBONE_INPUTS:
        raise ValueError(
            f"The planner does not size {class_name} backbones yet (it sizes {', '.join(BACKBONE_INPUTS)})."
        )
    return BACKBONE_INPUTS[class_name](config, rows, height, width, text_tokens, references)
