"""Tiny, randomly initialised but fully functional diffusers pipelines, built offline from configs.

The pipelines are real diffusers pipelines (``FluxPipeline``, ``StableDiffusion3Pipeline``, ``QwenImagePipeline``
and the newer families; the FLUX.2 and Wan builders live in :mod:`.tiny_flux2` and :mod:`.tiny_wan`) whose components
have the same classes and wiring as the released checkpoints, only with widths of a few dozen channels. They serve the test suite, the examples' ``--tiny`` flag and the
demo:

    >>> pipe = build_tiny_pipeline("flux", seed=0)
    >>> image = pipe("a red circle", height=32, width=32, num_inference_steps=2).images[0]
    >>> path = save_tiny_pipeline("sd3", "/tmp/tiny-sd3")  # reloads with DiffusionPipeline.from_pretrained(path)

Nothing is downloaded: the tokenizers are built in code from a small vocabulary (:data:`DEFAULT_VOCAB_WORDS` plus
the caller's ``vocab_words``), every one of whose words is a single token with its own embedding in every tokenizer
of the pipeline. Words outside the vocabulary still encode (byte-level BPE for CLIP and Qwen, single characters for
T5), only into several tokens.

All components are float32 and in eval mode, and their weights depend only on ``seed``, the component's name and its
config, so the same call always returns the same pipeline. Height and width must be multiples of 16 (8x VAE
downsampling, then 2x2 patches); 32 and 64 are the sizes used by tests and the demo.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from diffusers import (
    DiffusionPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from trl_jagg.models.families import FAMILIES as MODEL_FAMILY_RECORDS
from trl_jagg.models.families import family as model_family
from trl_jagg.testing.components import (
    ConfigOverrides,
    _autoencoder_kl,
    _autoencoder_qwenimage,
    _check_rope_axes,
    _clip_text_encoder,
    _finalize,
    _flow_match_scheduler,
    _merged,
    _qwen3_text_encoder,
    _qwen25vl_text_encoder,
    _seeded,
    _t5_encoder,
)
from trl_jagg.testing.tiny_flux2 import (
    FLUX2_SCHEDULER_CONFIG,
    build_tiny_flux2_dev_pipeline,
    build_tiny_flux2_klein_pipeline,
)
from trl_jagg.testing.tiny_wan import WAN_SCHEDULER_CONFIG, build_tiny_wan_pipeline
from trl_jagg.testing.tokenizers import (
    DEFAULT_VOCAB_WORDS,
    QWEN_EDIT_TEMPLATE_TEXTS,
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_qwen3_tokenizer,
    build_t5_tokenizer,
)
from trl_jagg.utils.quiet import quiet_deepspeed_cpu_notice

__all__ = [
    "TINY_PROMPTS",
    "TinyRun",
    "temporary_folder",
    "tiny_run",
    "DEFAULT_VOCAB_WORDS",
    "FAMILIES",
    "FLUX2_SCHEDULER_CONFIG",
    "FLUX_SCHEDULER_CONFIG",
    "QWENIMAGE_SCHEDULER_CONFIG",
    "SD3_SCHEDULER_CONFIG",
    "WAN_SCHEDULER_CONFIG",
    "ZIMAGE_SCHEDULER_CONFIG",
    "build_clip_tokenizer",
    "build_qwen2_tokenizer",
    "build_qwen3_tokenizer",
    "build_t5_tokenizer",
    "build_tiny_flux2_dev_pipeline",
    "build_tiny_flux2_klein_pipeline",
    "build_tiny_flux_kontext_pipeline",
    "build_tiny_flux_pipeline",
    "build_tiny_pipeline",
    "build_tiny_qwenimage_edit_pipeline",
    "build_tiny_qwenimage_pipeline",
    "build_tiny_sd3_pipeline",
    "build_tiny_wan_pipeline",
    "build_tiny_zimage_pipeline",
    "save_tiny_pipeline",
]

FAMILIES: tuple[str, ...] = tuple(record.name for record in MODEL_FAMILY_RECORDS)
"""The families with a tiny pipeline: every family record's name (:mod:`trl_jagg.models.families`)."""

# Scheduler configs of the released checkpoints. The pipelines read `use_dynamic_shifting` and the
# `base/max_shift`, `base/max_image_seq_len` entries to compute the resolution-dependent shift `mu`.
FLUX_SCHEDULER_CONFIG: dict[str, Any] = {  # black-forest-labs/FLUX.1-dev
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SD3_SCHEDULER_CONFIG: dict[str, Any] = {  # stabilityai/stable-diffusion-3.5-large: a static shift of 3
    "num_train_timesteps": 1000,
    "shift": 3.0,
}
QWENIMAGE_SCHEDULER_CONFIG: dict[str, Any] = {  # Qwen/Qwen-Image: dynamic shift, sigmas stretched to end at 0.02
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
ZIMAGE_SCHEDULER_CONFIG: dict[str, Any] = {  # Tongyi-MAI/Z-Image-Turbo: a static shift of 3
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": False,
}


# --------------------------------------------------------------------------------------------------------------------
# One builder per family
# --------------------------------------------------------------------------------------------------------------------


def build_tiny_flux_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    clip_max_length: int = 77,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    text_encoder_2: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> FluxPipeline:
    """A tiny FLUX.1-dev-like ``FluxPipeline`` (guidance-distilled: ``guidance_embeds=True``).

    Components: ``FluxTransformer2DModel`` (1 double-stream + 1 single-stream block, 2 heads of 16), a 16-channel
    8x ``AutoencoderKL``, a CLIP text model (pooled prompt embedding) and a T5 encoder (token embeddings), and a
    ``FlowMatchEulerDiscreteScheduler`` with Flux's resolution-dependent shift.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens in both tokenizers.
        clip_max_length: the CLIP tokenizer's ``model_max_length`` (and the CLIP position table's size).
        transformer, vae, text_encoder, text_encoder_2, scheduler: config overrides for that component. The
            transformer's ``joint_attention_dim`` and ``pooled_projection_dim`` follow the T5 and CLIP widths and
            its ``in_channels`` the VAE's latent channels unless overridden.
    """
    tokenizer = build_clip_tokenizer(vocab_words, model_max_length=clip_max_length)
    tokenizer_2 = build_t5_tokenizer(vocab_words)
    clip = _clip_text_encoder(
        tokenizer, seed=seed, component="text_encoder", with_projection=False, overrides=text_encoder
    )
    t5 = _t5_encoder(tokenizer_2, seed=seed, component="text_encoder_2", overrides=text_encoder_2)
    autoencoder = _autoencoder_kl(seed=seed, scaling_factor=0.3611, shift_factor=0.1159, overrides=vae)

    transformer_config = _merged(
        {
            "patch_size": 1,
            # Latents are packed 2x2 before the transformer: 16 VAE channels become 64 features per token.
            "in_channels": 4 * autoencoder.config.latent_channels,
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": t5.config.d_model,  # T5 token embeddings are the text stream
            "pooled_projection_dim": clip.config.hidden_size,  # CLIP's pooled output (no projection) conditions
            "guidance_embeds": True,  # like FLUX.1-dev; FLUX.1-schnell has none
            "axes_dims_rope": (4, 6, 6),  # (text/position index, height, width)
        },
        transformer,
    )
    _check_rope_axes(transformer_config["axes_dims_rope"], transformer_config["attention_head_dim"])
    if transformer_config["in_channels"] != 4 * autoencoder.config.latent_channels:
        raise ValueError("Flux's transformer in_channels must be 4x the VAE latent channels (2x2 packing).")
    with _seeded(seed, "transformer"):
        flux_transformer = FluxTransformer2DModel(**transformer_config)

    pipe = FluxPipeline(
        scheduler=_flow_match_scheduler(FLUX_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=flux_transformer,
    )
    return _finalize(pipe)


def build_tiny_flux_kontext_pipeline(**kwargs: Any) -> FluxKontextPipeline:
    """A tiny FLUX.1-Kontext-like ``FluxKontextPipeline`` (image editing): the components of
    :func:`build_tiny_flux_pipeline` (same keyword arguments), whose transformer reads the source image's latents as
    extra tokens."""
    return _finalize(FluxKontextPipeline(**build_tiny_flux_pipeline(**kwargs).components))


def build_tiny_sd3_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    clip_max_length: int = 77,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    text_encoder_2: ConfigOverrides = None,
    text_encoder_3: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> StableDiffusion3Pipeline:
    """A tiny SD3.5-like ``StableDiffusion3Pipeline`` (true classifier-free guidance, static shift 3).

    Components: ``SD3Transformer2DModel`` (2 joint blocks, 2 heads of 16, RMS q/k norm as in SD3.5), a 16-channel
    8x ``AutoencoderKL``, two ``CLIPTextModelWithProjection`` (CLIP-L and CLIP-G roles) and a T5 encoder, and a
    ``FlowMatchEulerDiscreteScheduler`` with ``shift=3.0`` and no dynamic shifting.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens in all three tokenizers.
        clip_max_length: ``model_max_length`` of both CLIP tokenizers (the pipeline uses the first one's for both).
        transformer, vae, text_encoder, text_encoder_2, text_encoder_3, scheduler: config overrides for that
            component. The transformer's ``joint_attention_dim`` follows T5's ``d_model`` and its
            ``pooled_projection_dim`` the two CLIP projection dims unless overridden.
    """
    tokenizer = build_clip_tokenizer(vocab_words, model_max_length=clip_max_length)
    tokenizer_2 = build_clip_tokenizer(vocab_words, model_max_length=clip_max_length)
    tokenizer_3 = build_t5_tokenizer(vocab_words)
    clip_l = _clip_text_encoder(
        tokenizer, seed=seed, component="text_encoder", with_projection=True, overrides=text_encoder
    )
    clip_g = _clip_text_encoder(
        tokenizer_2, seed=seed, component="text_encoder_2", with_projection=True, overrides=text_encoder_2
    )
    # SD3 concatenates the two CLIP token embeddings along the feature axis (penultimate hidden states, so the
    # CLIP *hidden* sizes) and zero-pads them to T5's width before stacking them with the T5 tokens. T5 must be at
    # least as wide (4096 >= 768 + 1280 in SD3): `F.pad` with a negative amount would silently crop instead.
    t5 = _t5_encoder(
        tokenizer_3, seed=seed, component="text_encoder_3", overrides=_merged({"d_model": 96}, text_encoder_3)
    )
    clip_width = clip_l.config.hidden_size + clip_g.config.hidden_size
    if t5.config.d_model < clip_width:
        raise ValueError(
            f"SD3 needs T5 d_model >= the CLIP hidden sizes together ({clip_width}), got {t5.config.d_model}."
        )
    autoencoder = _autoencoder_kl(seed=seed, scaling_factor=1.5305, shift_factor=0.0609, overrides=vae)

    transformer_config = _merged(
        {
            # Only sets the pipeline's default size (sample_size * 8 = 32 px); any multiple of 16 works.
            "sample_size": 4,
            "patch_size": 2,
            "in_channels": autoencoder.config.latent_channels,
            "out_channels": autoencoder.config.latent_channels,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": t5.config.d_model,
            # The pooled conditioning is the two CLIP *projected* embeddings concatenated.
            "pooled_projection_dim": clip_l.config.projection_dim + clip_g.config.projection_dim,
            "pos_embed_max_size": 32,  # 2D sin-cos table cropped to the image: up to 32 patches a side (512 px)
            "qk_norm": "rms_norm",
            "dual_attention_layers": (),
        },
        transformer,
    )
    # The text stream's width inside the joint blocks must equal the image stream's (heads * head dim).
    transformer_config.setdefault(
        "caption_projection_dim", transformer_config["num_attention_heads"] * transformer_config["attention_head_dim"]
    )
    with _seeded(seed, "transformer"):
        sd3_transformer = SD3Transformer2DModel(**transformer_config)

    pipe = StableDiffusion3Pipeline(
        scheduler=_flow_match_scheduler(SD3_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=clip_l,
        tokenizer=tokenizer,
        text_encoder_2=clip_g,
        tokenizer_2=tokenizer_2,
        text_encoder_3=t5,
        tokenizer_3=tokenizer_3,
        transformer=sd3_transformer,
    )
    return _finalize(pipe)


def build_tiny_qwenimage_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> QwenImagePipeline:
    """A tiny Qwen-Image-like ``QwenImagePipeline`` (true CFG with norm rescaling, dynamic shift).

    Components: ``QwenImageTransformer2DModel`` (2 blocks, 2 heads of 16), a tiny ``AutoencoderKLQwenImage``
    (16 latent channels, 8x), a tiny ``Qwen2_5_VLForConditionalGeneration`` whose last hidden state is the prompt
    embedding, a byte-level ``Qwen2Tokenizer`` and the real Qwen-Image scheduler config.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens (with and without a leading space).
        transformer, vae, text_encoder, scheduler: config overrides (``text_encoder`` overrides the Qwen2.5-VL
            *text* config). The transformer's ``joint_attention_dim`` follows the text width unless overridden.

    Note: with the real scheduler config, ``num_inference_steps=1`` gives NaN sigmas (``shift_terminal``'s stretch
    divides 0 by 0 for a single sigma of 1), as with the released model: sample with at least 2 steps.

    Raises:
        RuntimeError: if the tokenizer does not encode the pipeline's prompt-template prefix to exactly
            ``prompt_template_encode_start_idx`` tokens (the pipeline would then cut into the prompt).
    """
    tokenizer = build_qwen2_tokenizer(vocab_words)
    components = _qwenimage_components(tokenizer, seed, transformer, vae, text_encoder, scheduler)
    return _checked_template(QwenImagePipeline(**components))


def build_tiny_qwenimage_edit_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    plus: bool = False,
    vision_pixels: int = 56 * 56,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> QwenImageEditPipeline | QwenImageEditPlusPipeline:
    """A tiny Qwen-Image-Edit-like ``QwenImageEditPipeline`` (``plus=True``: ``QwenImageEditPlusPipeline``, several
    source images): the components of :func:`build_tiny_qwenimage_pipeline` (same keyword arguments) and a
    ``Qwen2VLProcessor`` whose image processor resizes every image to ``vision_pixels`` pixels (the real one keeps up
    to 12.8 M), so each source image is 4 vision tokens of the tiny Qwen2.5-VL's one-block vision tower.
    """
    tokenizer = build_qwen2_tokenizer(vocab_words, template_texts=QWEN_EDIT_TEMPLATE_TEXTS)
    components = _qwenimage_components(tokenizer, seed, transformer, vae, text_encoder, scheduler)
    size = {"shortest_edge": vision_pixels, "longest_edge": vision_pixels}
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(size=size),
    )
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return _checked_template(pipeline_class(processor=processor, **components))


def _qwenimage_components(
    tokenizer: Any,
    seed: int,
    transformer: ConfigOverrides,
    vae: ConfigOverrides,
    text_encoder: ConfigOverrides,
    scheduler: ConfigOverrides,
) -> dict[str, Any]:
    """The components the Qwen-Image pipelines share (see :func:`build_tiny_qwenimage_pipeline`)."""
    qwen = _qwen25vl_text_encoder(tokenizer, seed=seed, overrides=text_encoder)
    autoencoder = _autoencoder_qwenimage(seed=seed, overrides=vae)
    transformer_config = _merged(
        {
            "patch_size": 2,
            "in_channels": 4 * autoencoder.config.z_dim,  # 2x2-packed latents, as in Flux
            "out_channels": autoencoder.config.z_dim,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": qwen.config.text_config.hidden_size,
            "guidance_embeds": False,
            "axes_dims_rope": (4, 6, 6),  # (frame, height, width)
        },
        transformer,
    )
    _check_rope_axes(transformer_config["axes_dims_rope"], transformer_config["attention_head_dim"])
    with _seeded(seed, "transformer"):
        qwen_transformer = QwenImageTransformer2DModel(**transformer_config)
    return {
        "scheduler": _flow_match_scheduler(QWENIMAGE_SCHEDULER_CONFIG, scheduler),
        "vae": autoencoder,
        "text_encoder": qwen,
        "tokenizer": tokenizer,
        "transformer": qwen_transformer,
    }


def _checked_template(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """``pipe``, finalized, once its tokenizer is known to encode the prompt template's prefix to the
    ``prompt_template_encode_start_idx`` tokens the pipeline drops (else it would cut into the prompt)."""
    prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
    prefix_length = len(pipe.tokenizer(prefix).input_ids)
    if prefix_length != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"The tiny Qwen2 tokenizer encodes the prompt-template prefix to {prefix_length} tokens, but "
            f"{type(pipe).__name__} drops the first {pipe.prompt_template_encode_start_idx}; update the template "
            "words in trl_jagg/testing/tokenizers.py."
        )
    return _finalize(pipe)


def build_tiny_zimage_pipeline(
    *,
    seed: int = 0,
    vocab_words: Sequence[str] | None = None,
    transformer: ConfigOverrides = None,
    vae: ConfigOverrides = None,
    text_encoder: ConfigOverrides = None,
    scheduler: ConfigOverrides = None,
) -> ZImagePipeline:
    """A tiny Z-Image-like ``ZImagePipeline`` (single-stream DiT, CFG ``v_c + g (v_c - v_u)``, static shift 3).

    Components: ``ZImageTransformer2DModel`` (2 main + 1 noise and 1 context refiner layers, 2 heads of 16), the
    16-channel 8x ``AutoencoderKL`` of the Flux family (Z-Image uses FLUX.1's VAE), a tiny ``Qwen3Model`` whose
    penultimate hidden state is the prompt embedding, a byte-level tokenizer with Qwen3's chat template, and
    Z-Image-Turbo's scheduler config.

    Args:
        seed: seed of the random weights.
        vocab_words: extra words that must be single tokens (with and without a leading space).
        transformer, vae, text_encoder, scheduler: config overrides. The transformer's ``cap_feat_dim`` follows
            the text width and its ``in_channels`` the VAE's latent channels unless overridden.
    """
    tokenizer = build_qwen3_tokenizer(vocab_words)
    qwen = _qwen3_text_encoder(tokenizer, seed=seed, overrides=text_encoder)
    autoencoder = _autoencoder_kl(seed=seed, scaling_factor=0.3611, shift_factor=0.1159, overrides=vae)
    transformer_config = _merged(
        {
            "all_patch_size": (2,),
            "all_f_patch_size": (1,),
            "in_channels": autoencoder.config.latent_channels,  # latent images, patchified inside the model
            "dim": 32,
            "n_layers": 2,
            "n_refiner_layers": 1,
            "n_heads": 2,
            "n_kv_heads": 2,
            "cap_feat_dim": qwen.config.hidden_size,
            "axes_dims": (4, 6, 6),  # (text position / frame, height, width)
            "axes_lens": (512, 64, 64),
        },
        transformer,
    )
    head_dim = transformer_config["dim"] // transformer_config["n_heads"]
    _check_rope_axes(transformer_config["axes_dims"], head_dim)
    with _seeded(seed, "transformer"):
        zimage_transformer = ZImageTransformer2DModel(**transformer_config)

    pipe = ZImagePipeline(
        scheduler=_flow_match_scheduler(ZIMAGE_SCHEDULER_CONFIG, scheduler),
        vae=autoencoder,
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=zimage_transformer,
    )
    return _finalize(pipe)


def build_tiny_pipeline(
    family: str, *, seed: int = 0, vocab_words: Sequence[str] | None = None, **overrides: Any
) -> DiffusionPipeline:
    """Build a tiny, randomly initialised pipeline of ``family`` (``"flux"``, ``"sd3"``, ... : :data:`FAMILIES`).

    Args:
        family: which pipeline: the family record's tiny builder, with its options (Wan2.2's ``boundary_ratio``).
        seed: seed of the random weights; the same arguments always give the same weights.
        vocab_words: words (letters only) that must be single tokens with their own embeddings in every tokenizer
            of the pipeline, in addition to :data:`DEFAULT_VOCAB_WORDS`.
        **overrides: keyword arguments of the family's builder (``build_tiny_<family>_pipeline``): per-component
            config overrides such as ``transformer={"num_layers": 2}``, and ``clip_max_length`` for Flux/SD3.

    Returns:
        The pipeline, float32, eval mode, on CPU, with the progress bar disabled.
    """
    record = model_family(family)
    return record.tiny_pipeline_builder()(seed=seed, vocab_words=vocab_words, **record.tiny_options, **overrides)


def save_tiny_pipeline(family: str, path: str | os.PathLike[str], **kwargs: Any) -> str:
    """Build a tiny pipeline with :func:`build_tiny_pipeline` and ``save_pretrained`` it to ``path``.

    The directory has the layout of a Hub repository (``model_index.json`` and one folder per component), so it
    loads with ``DiffusionPipeline.from_pretrained(path)`` or the family's pipeline class, exactly like a Hub id.

    Returns:
        ``path`` as a string.
    """
    pipe = build_tiny_pipeline(family, **kwargs)
    quiet_deepspeed_cpu_notice()  # transformers' save_pretrained imports DeepSpeed (when installed) through accelerate
    pipe.save_pretrained(os.fspath(path))
    return os.fspath(path)


TINY_PROMPTS: tuple[str, ...] = ("a red circle", "a green square", "a blue circle", "a red square")
"""Colour-naming prompts for the weight-free ``prompt_color`` reward."""


def temporary_folder(prefix: str) -> str:
    """A new temporary folder, removed when the Python process exits: a ``--tiny`` run leaves nothing in ``/tmp``."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@dataclass
class TinyRun:
    """What an example's ``--tiny`` flag swaps in: a tiny pipeline saved to a temporary directory (loaded through
    ``from_pretrained`` like a Hub id), the weight-free ``prompt_color`` reward, a prompt dataset, and config values
    that train two optimizer steps on 32x32 images (Wan: 5-frame videos) in seconds on a CPU."""

    model: str
    reward: str
    dataset: Any
    config: dict[str, Any]


EDIT_FAMILIES: tuple[str, ...] = tuple(r.name for r in MODEL_FAMILY_RECORDS if r.task == "image editing")
"""The editing families: their prompts come with a ``source_image`` to edit."""


def tiny_config(family: str, *, num_inference_steps: int = 5) -> dict[str, Any]:
    """The config values of a ``--tiny`` run of ``family`` (two optimizer steps on 32x32 images, Wan: 5-frame videos,
    in seconds on a CPU), without building anything; ``num_inference_steps`` sets how many steps are trained (5 gives
    4 trained steps: one full JAGG group of W = 4)."""
    config = dict(
        height=32, width=32, num_inference_steps=num_inference_steps, num_generations=2,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, steps_per_generation=None, max_steps=2,
        max_sequence_length=16, dtype="float32", bf16=False, fp16=False, offload_frozen_modules=False,
        report_to="none", save_strategy="no", reward_weights=None,  # one reward, whatever the preset's weights
        ema_update_interval=1,  # a preset's EMA (every 8 steps) would never update in 2 steps
    )  # fmt: skip
    return config | dict(model_family(family).tiny_config)  # the family's own: a video's frames, longer prompts


def tiny_run(family: str, *, num_inference_steps: int = 5) -> TinyRun:
    """The ``--tiny`` setup of the examples for ``family``: the tiny pipeline saved to a temporary folder (removed at
    exit) and :func:`tiny_config`'s values. An editing family's dataset also has a ``source_image`` column (grey
    images of different shades: the image each instruction edits)."""
    from datasets import Dataset

    columns: dict[str, list[Any]] = {"prompt": list(TINY_PROMPTS)}
    if family in EDIT_FAMILIES:  # editing: a grey image to edit
        columns["source_image"] = [Image.new("RGB", (32, 32), (64 * i,) * 3) for i in range(len(TINY_PROMPTS))]
    model = save_tiny_pipeline(family, temporary_folder(f"tiny-{family}-"))
    config = tiny_config(family, num_inference_steps=num_inference_steps)
    return TinyRun(model, "prompt_color", Dataset.from_dict(columns), config)
