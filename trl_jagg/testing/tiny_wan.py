"""A tiny Wan text-to-video pipeline built offline from configs (see :mod:`trl_jagg.testing.tiny_models`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

from trl_jagg.testing.components import (
    ConfigOverrides,
    _finalize,
    _flow_match_scheduler,
    _merged,
    _seeded,
    _t5_encoder,
)
from trl_jagg.testing.tokenizers import build_t5_tokenizer

# Wan2.1-T2V ships UniPC with flow_shift 3; the Euler one with shift 3 makes the pipeline's loop the rollout's ODE.
WAN_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}


def build_tiny_wan_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
    boundary_ratio: float | None = None,
    ti2v: bool = False,
) -> WanPipeline:
    """A tiny Wan2.1-like ``WanPipeline`` (text-to-video: 5-D latents ``(batch, 16, frames, h, w)``); with
    ``boundary_ratio``, Wan2.2 A14B-like: a second expert ``transformer_2`` (same config, its own random weights)
    denoises the timesteps below ``boundary_ratio * 1000``.

    Components: ``WanTransformer3DModel`` (2 layers, 2 heads of 12, 1x2x2 patches), a tiny ``AutoencoderKLWan``
    (4x temporal, 8x spatial; random ``latents_mean`` / ``latents_std``, so that decoding tests see them), a 2-layer
    ``UMT5EncoderModel``, a T5 tokenizer and an Euler scheduler with Wan's shift 3. ``num_frames = 4 k + 1`` pixel
    frames give ``k + 1`` latent frames. Overrides as the other builders (``text_dim`` follows the text width).

    With ``ti2v``, Wan2.2 TI2V-5B-like: ``expand_timesteps=True`` (one timestep per patch token) and a Wan2.2-style
    VAE with the 5B's structural options (``z_dim`` 48, residual blocks, ``patch_size`` 2 on 12 channels, 16x
    spatial compression), so that 32 x 32 px videos have 2 x 2 latents, one 1x2x2 token per latent frame.
    """
    tokenizer = build_t5_tokenizer(vocab_words)
    umt5 = _t5_encoder(tokenizer, seed=seed, component="text_encoder", overrides=text_encoder, umt5=True)
    vae_defaults: dict[str, Any] = {
        "base_dim": 4, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],  # lists: the VAE concatenates them
    }  # fmt: skip
    if ti2v:  # Wan2.2-TI2V-5B's vae/config.json, at tiny widths
        vae_defaults |= {"z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
                         "scale_factor_spatial": 16, "decoder_base_dim": 8}  # fmt: skip
    vae_config = _merged(vae_defaults, vae)
    generator = torch.Generator().manual_seed(seed)
    vae_config.setdefault("latents_mean", (torch.randn(vae_config["z_dim"], generator=generator) * 0.5).tolist())
    vae_config.setdefault("latents_std", (torch.rand(vae_config["z_dim"], generator=generator) + 0.5).tolist())
    with _seeded(seed, "vae"):
        autoencoder = AutoencoderKLWan(**vae_config)
    transformer_config = _merged(
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 12,  # Wan's RoPE splits a head into (frame, height, width) parts
            "in_channels": autoencoder.config.z_dim,
            "out_channels": autoencoder.config.z_dim,
            "text_dim": umt5.config.d_model,
            "freq_dim": 32,
            "ffn_dim": 32,
            "num_layers": 2,
            "rope_max_seq_len": 32,
        },
        transformer,
    )
    with _seeded(seed, "transformer"):
        wan_transformer = WanTransformer3DModel(**transformer_config)
    low_noise = None
    if boundary_ratio is not None:
        with _seeded(seed, "transformer_2"):
            low_noise = WanTransformer3DModel(**transformer_config)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=umt5,
        vae=autoencoder,
        scheduler=_flow_match_scheduler(WAN_SCHEDULER_CONFIG, scheduler),
        transformer=wan_transformer,
        transformer_2=low_noise,
        boundary_ratio=boundary_ratio,
        expand_timesteps=ti2v,
    )
    return _finalize(pipe)
