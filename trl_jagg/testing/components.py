"""Components of the tiny pipelines, shared by the family builders of :mod:`trl_jagg.testing.tiny_models`: seeded
construction, config overrides, and the small text encoders, VAEs and schedulers built from configs."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from diffusers import AutoencoderKL, AutoencoderKLQwenImage, DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

ConfigOverrides = Mapping[str, Any] | None


# --------------------------------------------------------------------------------------------------------------------
# Seeding and config overrides
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _seeded(seed: int, component: str) -> Iterator[None]:
    """Seed torch's CPU RNG from ``(seed, component)`` inside a forked RNG state.

    Each component gets its own stream, so its weights do not depend on the order in which components are built or
    on the configs of the others, and the caller's global RNG state is left untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(zlib.crc32(f"{seed}/{component}".encode()))
        yield


def _merged(defaults: Mapping[str, Any], overrides: ConfigOverrides) -> dict[str, Any]:
    """Return ``defaults`` updated with the caller's config ``overrides``."""
    config = dict(defaults)
    config.update(overrides or {})
    return config


def _checked(overrides: ConfigOverrides, config_class: type, component: str) -> ConfigOverrides:
    """Reject override keys that are not fields of a transformers config class.

    transformers configs store unknown keyword arguments as attributes without complaint, so a typo would silently
    leave the default in place (diffusers models and schedulers already raise ``TypeError`` for unknown keys).
    """
    unknown = set(overrides or {}) - set(config_class().to_dict())
    if unknown:
        raise TypeError(f"Unknown {config_class.__name__} fields in the `{component}` overrides: {sorted(unknown)}.")
    return overrides


# --------------------------------------------------------------------------------------------------------------------
# Text encoders, VAEs, schedulers
# --------------------------------------------------------------------------------------------------------------------


def _clip_text_encoder(
    tokenizer: CLIPTokenizer, *, seed: int, component: str, with_projection: bool, overrides: ConfigOverrides
) -> CLIPTextModel | CLIPTextModelWithProjection:
    """A 2-layer CLIP text model (``CLIPTextModelWithProjection`` for SD3, whose pooled output is projected).

    Two layers, because SD3 reads the penultimate hidden state (``hidden_states[-2]``): with one layer that would be
    the bare token embeddings. ``eos_token_id`` is the tokenizer's, so the pooled output is read at the first
    end-of-text token.
    """
    config = _merged(
        {
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": tokenizer.model_max_length,
            "projection_dim": 32,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        _checked(overrides, CLIPTextConfig, component),
    )
    if config["max_position_embeddings"] < tokenizer.model_max_length:
        raise ValueError(
            f"{component}: max_position_embeddings={config['max_position_embeddings']} is smaller than the CLIP "
            f"tokenizer's model_max_length={tokenizer.model_max_length}, which the pipeline pads every prompt to."
        )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with _seeded(seed, component):
        return model_class(CLIPTextConfig(**config))


def _t5_encoder(
    tokenizer: T5Tokenizer, *, seed: int, component: str, overrides: ConfigOverrides, umt5: bool = False
) -> T5EncoderModel | UMT5EncoderModel:
    """A 2-layer T5 v1.1-style encoder (gated GELU feed-forward, relative position buckets); ``umt5``: the UMT5
    variant (a relative position bias per layer) that Wan encodes prompts with."""
    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    config = _merged(
        {
            "vocab_size": len(tokenizer),
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_heads": 4,
            "feed_forward_proj": "gated-gelu",
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "decoder_start_token_id": tokenizer.pad_token_id,
        },
        _checked(overrides, config_class, component),
    )
    with _seeded(seed, component):
        return model_class(config_class(**config))


def mrope_section(head_dim: int) -> list[int]:
    """Split the rotary half-dimension into Qwen2.5-VL's (time, height, width) sections, in the real 2:3:3 ratio.

    Multimodal RoPE rotates ``head_dim // 2`` frequency pairs, taken in three sections from the temporal, height and
    width position ids; the sections must sum to ``head_dim // 2`` (the 7B model: 16 + 24 + 24 = 128 // 2).
    """
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def _qwen25vl_text_encoder(
    tokenizer: Qwen2Tokenizer, *, seed: int, overrides: ConfigOverrides
) -> Qwen2_5_VLForConditionalGeneration:
    """A tiny Qwen2.5-VL (2 text layers with grouped-query attention, a 1-block vision tower that text-only prompts
    never use). ``overrides`` apply to the text config; the vision tower follows the text width.
    """
    text_config = _merged(
        {
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "bos_token_id": tokenizer.pad_token_id,  # <|endoftext|>, as in Qwen2.5-VL
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        _checked(overrides, Qwen2_5_VLTextConfig, "text_encoder"),
    )
    if "rope_parameters" not in text_config:
        head_dim = text_config["hidden_size"] // text_config["num_attention_heads"]
        text_config["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": mrope_section(head_dim),
        }
    vision_config = {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": text_config["hidden_size"],  # the merger writes image features into the text stream
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    with _seeded(seed, "text_encoder"):
        return Qwen2_5_VLForConditionalGeneration(config)


def _qwen3_text_encoder(
    tokenizer: Qwen2Tokenizer,
    *,
    seed: int,
    overrides: ConfigOverrides,
    model_class: type[Qwen3Model] | type[Qwen3ForCausalLM] = Qwen3Model,
    num_layers: int = 2,
) -> Qwen3Model | Qwen3ForCausalLM:
    """A tiny Qwen3 (grouped-query attention, q/k RMS norm) whose hidden states are the prompt embedding."""
    config = _merged(
        {
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "bos_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        _checked(overrides, Qwen3Config, "text_encoder"),
    )
    with _seeded(seed, "text_encoder"):
        return model_class(Qwen3Config(**config))


def _autoencoder_kl(
    *, seed: int, scaling_factor: float, shift_factor: float, overrides: ConfigOverrides
) -> AutoencoderKL:
    """A 16-channel ``AutoencoderKL`` with 4 blocks, i.e. 8x spatial downsampling like the Flux/SD3 VAEs.

    The pipelines derive ``vae_scale_factor = 2 ** (len(block_out_channels) - 1)``; the block types follow the
    number of blocks. Like the real Flux/SD3 VAEs it has no quant convs and uses a scaling and a shift factor.
    """
    config = _merged(
        {
            "in_channels": 3,
            "out_channels": 3,
            "block_out_channels": (8, 16, 16, 16),
            "layers_per_block": 1,
            "latent_channels": 16,
            "norm_num_groups": 4,  # GroupNorm: must divide every entry of block_out_channels
            "sample_size": 32,
            "scaling_factor": scaling_factor,
            "shift_factor": shift_factor,
            "use_quant_conv": False,
            "use_post_quant_conv": False,
        },
        overrides,
    )
    num_blocks = len(config["block_out_channels"])
    config.setdefault("down_block_types", ("DownEncoderBlock2D",) * num_blocks)
    config.setdefault("up_block_types", ("UpDecoderBlock2D",) * num_blocks)
    with _seeded(seed, "vae"):
        return AutoencoderKL(**config)


def _autoencoder_qwenimage(*, seed: int, overrides: ConfigOverrides) -> AutoencoderKLQwenImage:
    """A tiny Qwen-Image (Wan-style causal 3D) VAE: 16 latent channels, 8x spatial downsampling.

    The pipeline derives ``vae_scale_factor = 2 ** len(temperal_downsample)``, so ``temperal_downsample`` has one
    entry per downsampling stage (``len(dim_mult) - 1``). The per-channel ``latents_mean``/``latents_std`` keep the
    released values when ``z_dim`` is 16 and become 0/1 otherwise.
    """
    config = _merged(
        {
            "base_dim": 8,
            "z_dim": 16,
            "dim_mult": [1, 2, 2, 2],
            "num_res_blocks": 1,
            "attn_scales": [],
            "temperal_downsample": [False, True, True],
        },
        overrides,
    )
    if config["z_dim"] != 16:
        config.setdefault("latents_mean", [0.0] * config["z_dim"])
        config.setdefault("latents_std", [1.0] * config["z_dim"])
    with _seeded(seed, "vae"):
        return AutoencoderKLQwenImage(**config)


def _flow_match_scheduler(defaults: Mapping[str, Any], overrides: ConfigOverrides) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(**_merged(defaults, overrides))


def _check_rope_axes(axes_dims_rope: Sequence[int], attention_head_dim: int) -> None:
    # RoPE rotates every channel pair of a query/key head; the rotary frequencies of the axes (text index / frame,
    # height, width) are concatenated, so together they must cover exactly one head, and each axis an even number.
    if sum(axes_dims_rope) != attention_head_dim or any(dim % 2 for dim in axes_dims_rope):
        raise ValueError(
            f"axes_dims_rope={tuple(axes_dims_rope)} must be even and sum to attention_head_dim={attention_head_dim}."
        )


def _finalize(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """Cast every model to float32 and put it in eval mode (models built from configs start in train mode, where
    T5's dropout would make the prompt embeddings random)."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            # Cast only when needed (a non-float32 default dtype): diffusers warns on every `.to(dtype)` call.
            if any(parameter.dtype != torch.float32 for parameter in component.parameters()):
                component.to(dtype=torch.float32)
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
