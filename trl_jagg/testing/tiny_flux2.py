"""A tiny FLUX.2 pipeline built offline from configs (see :mod:`trl_jagg.testing.tiny_models`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import Qwen3ForCausalLM

from .components import (
    ConfigOverrides,
    _check_rope_axes,
    _finalize,
    _flow_match_scheduler,
    _merged,
    _qwen3_text_encoder,
    _seeded,
)
from .tokenizers import build_qwen3_tokenizer

FLUX2_SCHEDULER_CONFIG: dict[str, Any] = {  # black-forest-labs/FLUX.2-klein: mu from the pipeline's empirical fit
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def build_tiny_flux2_klein_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    is_distilled: bool = False,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> Flux2KleinPipeline:
    """A tiny FLUX.2-klein-like ``Flux2KleinPipeline`` (the base model with CFG; ``is_distilled=True``: the
    step-distilled one, which ignores guidance).

    Components: ``Flux2Transformer2DModel`` (1 double-stream + 1 single-stream block, 2 heads of 16, 4 RoPE axes), a
    tiny ``AutoencoderKLFlux2`` whose batch-norm statistics of the patchified latents are random (so decoding tests
    see them), a ``Qwen3ForCausalLM`` of 28 narrow layers (the pipeline stacks hidden states 9, 18 and 27), a
    tokenizer with Qwen3's chat template, and a ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens (with and without a leading space).
        is_distilled: the pipeline's ``is_distilled`` flag.
        transformer, vae, text_encoder, scheduler: config overrides. The transformer's ``joint_attention_dim``
            follows the three stacked text widths and its ``in_channels`` the patchified VAE channels.
    """
    tokenizer = build_qwen3_tokenizer(vocab_words)
    qwen = _qwen3_text_encoder(
        tokenizer, seed=seed, overrides=text_encoder, model_class=Qwen3ForCausalLM, num_layers=28
    )
    vae_config = _merged(
        {
            "block_out_channels": (8, 16, 16, 16),
            "layers_per_block": 1,
            "latent_channels": 8,
            "norm_num_groups": 4,
            "sample_size": 32,
        },
        vae,
    )
    with _seeded(seed, "vae"):
        autoencoder = AutoencoderKLFlux2(**vae_config)
        # Fresh batch norm has mean 0 / variance 1, under which a missing normalisation would go unnoticed.
        autoencoder.bn.running_mean.normal_(0.0, 0.5)
        autoencoder.bn.running_var.uniform_(0.5, 2.0)
    transformer_config = _merged(
        {
            "patch_size": 1,
            "in_channels": 4 * autoencoder.config.latent_channels,  # 2x2-patchified latents, one token each
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 3 * qwen.config.hidden_size,  # three hidden states stacked per token
            "timestep_guidance_channels": 32,
            "axes_dims_rope": (4, 4, 4, 4),  # (time, height, width, layer)
            "guidance_embeds": False,  # klein has no embedded guidance
        },
        transformer,
    )
    _check_rope_axes(transformer_config["axes_dims_rope"], transformer_config["attention_head_dim"])
    with _seeded(seed, "transformer"):
        flux2_transformer = Flux2Transformer2DModel(**transformer_config)

    pipe = Flux2KleinPipeline(
        scheduler=_flow_match_scheduler(FLUX2_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=flux2_transformer,
        is_distilled=is_distilled,
    )
    return _finalize(pipe)
