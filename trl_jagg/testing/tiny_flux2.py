"""Tiny FLUX.2 pipelines (klein and dev) built offline from configs (see :mod:`trl_jagg.testing.tiny_models`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, Qwen3ForCausalLM

from trl_jagg.testing.components import (
    ConfigOverrides,
    _check_rope_axes,
    _checked,
    _finalize,
    _flow_match_scheduler,
    _merged,
    _qwen3_text_encoder,
    _seeded,
)
from trl_jagg.testing.tokenizers import build_mistral3_processor, build_qwen3_tokenizer

FLUX2_SCHEDULER_CONFIG: dict[str, Any] = {  # black-forest-labs/FLUX.2-klein: mu from the pipeline's empirical fit
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
}


def _flux2_vae(seed: int, overrides: ConfigOverrides) -> AutoencoderKLFlux2:
    """A tiny ``AutoencoderKLFlux2`` (8 latent channels, 8x downsampling) with random batch-norm statistics of the
    patchified latents: under a fresh batch norm's mean 0 / variance 1 a missing normalisation would go unnoticed."""
    config = _merged(
        {
            "block_out_channels": (8, 16, 16, 16),
            "layers_per_block": 1,
            "latent_channels": 8,
            "norm_num_groups": 4,
            "sample_size": 32,
        },
        overrides,
    )
    with _seeded(seed, "vae"):
        autoencoder = AutoencoderKLFlux2(**config)
        autoencoder.bn.running_mean.normal_(0.0, 0.5)
        autoencoder.bn.running_var.uniform_(0.5, 2.0)
    return autoencoder


def _flux2_transformer(
    seed: int, vae: AutoencoderKLFlux2, text_width: int, *, guidance_embeds: bool, overrides: ConfigOverrides
) -> Flux2Transformer2DModel:
    """A ``Flux2Transformer2DModel`` of 1 double-stream + 1 single-stream block (2 heads of 16, 4 RoPE axes) whose
    ``in_channels`` follow the patchified VAE channels and ``joint_attention_dim`` the three stacked text widths."""
    config = _merged(
        {
            "patch_size": 1,
            "in_channels": 4 * vae.config.latent_channels,  # 2x2-patchified latents, one token each
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 3 * text_width,  # three hidden states stacked per token
            "timestep_guidance_channels": 32,
            "axes_dims_rope": (4, 4, 4, 4),  # (time, height, width, layer)
            "guidance_embeds": guidance_embeds,
        },
        overrides,
    )
    _check_rope_axes(config["axes_dims_rope"], config["attention_head_dim"])
    with _seeded(seed, "transformer"):
        return Flux2Transformer2DModel(**config)


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

    Components: the tiny FLUX.2 transformer without embedded guidance and VAE (:func:`_flux2_transformer`,
    :func:`_flux2_vae`), a ``Qwen3ForCausalLM`` of 28 narrow layers (the pipeline stacks hidden states 9, 18 and
    27), a tokenizer with Qwen3's chat template, and a ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting.

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
    autoencoder = _flux2_vae(seed, vae)
    pipe = Flux2KleinPipeline(
        scheduler=_flow_match_scheduler(FLUX2_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=_flux2_transformer(
            seed, autoencoder, qwen.config.hidden_size, guidance_embeds=False, overrides=transformer
        ),  # klein has no embedded guidance
        is_distilled=is_distilled,
    )
    return _finalize(pipe)


def build_tiny_flux2_dev_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> Flux2Pipeline:
    """A tiny FLUX.2-dev-like ``Flux2Pipeline`` (guidance-distilled: ``guidance_scale`` is embedded guidance).

    Components: the tiny FLUX.2 transformer with a guidance embedding and VAE (:func:`_flux2_transformer`,
    :func:`_flux2_vae`), a ``Mistral3ForConditionalGeneration`` whose text model has 31 narrow layers (the pipeline
    stacks hidden states 10, 20 and 30 of Mistral-Small-3's 40; the 1-layer vision tower is never used by text
    prompts), a ``PixtralProcessor`` with Mistral's chat template in which the pipeline's system message is about as
    long as with the real tokenizer (31 tokens before the prompt), and the FLUX.2 scheduler.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens (with and without a leading space).
        transformer, vae, scheduler: config overrides, as for :func:`build_tiny_flux2_klein_pipeline`.
        text_encoder: overrides of the text model's ``MistralConfig``.
    """
    processor = build_mistral3_processor(vocab_words, template_words=re.findall(r"[A-Za-z]+", SYSTEM_MESSAGE))
    tokenizer = processor.tokenizer
    text_config = _merged(
        {
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 31,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        _checked(text_encoder, MistralConfig, "text_encoder"),
    )
    vision_config = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 8,
        "image_size": 64,
        "patch_size": 16,
    }
    config = Mistral3Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    with _seeded(seed, "text_encoder"):
        mistral = Mistral3ForConditionalGeneration(config)
    autoencoder = _flux2_vae(seed, vae)
    pipe = Flux2Pipeline(
        scheduler=_flow_match_scheduler(FLUX2_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=mistral,
        tokenizer=processor,
        transformer=_flux2_transformer(
            seed, autoencoder, text_config["hidden_size"], guidance_embeds=True, overrides=transformer
        ),
    )
    return _finalize(pipe)
