"""A FLOP model of a FLUX.1-dev training step: the real modules, built on the meta device, counted by torch.

``torch.utils.flop_counter.FlopCounterMode`` counts the matrix products (linear layers, attention's batched products,
convolutions) of one call; on the ``meta`` device nothing is allocated or computed, so FLUX.1-dev's 12B transformer
is counted exactly, forward and backward, in seconds of Python. The configs below are FLUX.1-dev's published ones
(``black-forest-labs/FLUX.1-dev``: ``transformer/``, ``vae/``, ``text_encoder/`` (CLIP ViT-L/14's text tower),
``text_encoder_2/`` (T5 v1.1 XXL's encoder)), written here because the Hub is offline.

A step's cost is then the counted work times these unit costs (:func:`step_flops`): one backbone row forward (with
or without a graph: the same products) and backward, one VAE decode per image, one prompt encoding per distinct
prompt. The reward is left out: the benchmarks score with the weight-free ``prompt_color``.

Activation checkpointing is an explicit option of the pricing (``checkpointing``): with diffusers'
``enable_gradient_checkpointing()`` (what the trainer calls for ``activation_checkpointing``) every joint and single
transformer block runs under ``torch.utils.checkpoint`` and its backward first runs its forward again, so a backward
row costs :attr:`StepCosts.recompute_row` more: the forward less what runs outside the blocks (the latent, text,
timestep, guidance and pooled-text embedders, ``norm_out`` and ``proj_out``), counted by running the checkpointed
backward itself.

The backbone is priced for both ways the presets train it (:data:`TRAINING`): full fine-tuning (DanceGRPO's and
MixGRPO's presets), whose backward computes every weight's gradient besides the activations' (about twice the
forward), and LoRA (Flow-GRPO's, the README's), whose backward through the frozen base computes activation gradients
only, and none at all below the first adapter (the embedders, the modulations fed by the timestep embedding), plus
the adapters' own products: about one forward, so each backward JAGG saves is worth less.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch

from trl_jagg.recipes import get_recipe

FLUX_DEV_TRANSFORMER = {  # black-forest-labs/FLUX.1-dev, transformer/config.json
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_DEV_VAE = {  # vae/config.json
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "norm_num_groups": 32,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
FLUX_DEV_T5 = {  # text_encoder_2/config.json (google/t5-v1_1-xxl's encoder)
    "d_model": 4096,
    "d_ff": 10240,
    "d_kv": 64,
    "num_heads": 64,
    "num_layers": 24,
    "feed_forward_proj": "gated-gelu",
    "vocab_size": 32128,
}
FLUX_DEV_CLIP = {  # text_encoder/config.json (openai/clip-vit-large-patch14's text tower)
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "vocab_size": 49408,
    "projection_dim": 768,
}
VAE_FACTOR = 8  # pixels per latent side; the transformer packs 2 x 2 latents into a token
TRAINING = ("full", "lora")
"""The ways the backbone is trained that the FLOP model prices: every parameter, or a LoRA on the frozen base."""
LORA_PRESET = "flow-grpo-flux"
"""The preset whose LoRA the ``"lora"`` costs price: FLUX.1-dev's LoRA preset (r 64 on attention and feed-forward)."""


def flux_dev_lora() -> dict[str, Any]:
    """The keyword arguments of :data:`LORA_PRESET`'s ``peft.LoraConfig``, as JSON-friendly values."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in get_recipe(LORA_PRESET).lora.items()}


def checkpointed_fraction(num_blocks: int, every: int) -> float:
    """The fraction of ``num_blocks`` transformer blocks that checkpointing every ``every``-th one (blocks 0,
    ``every``, ``2 every``, ... in module order; ``activation_checkpointing_kwargs={"every_n_layers": every}``)
    recomputes in the backward."""
    return math.ceil(num_blocks / every) / num_blocks


def preset_checkpointed_fraction(preset: str) -> float:
    """The fraction of FLUX.1-dev's blocks that the preset named ``preset`` checkpoints: 0 without activation
    checkpointing (``activation_checkpointing`` or ``gradient_checkpointing``: the trainer treats them alike), 1 with
    it, :func:`checkpointed_fraction` with ``activation_checkpointing_kwargs={"every_n_layers": k}``."""
    config = get_recipe(preset).config
    if not (config.get("activation_checkpointing") or config.get("gradient_checkpointing")):
        return 0.0
    every = (config.get("activation_checkpointing_kwargs") or {}).get("every_n_layers", 1)
    return checkpointed_fraction(FLUX_DEV_TRANSFORMER["num_layers"] + FLUX_DEV_TRANSFORMER["num_single_layers"], every)


def counted_flops(fn: Callable[[], Any]) -> int:
    """The FLOPs ``FlopCounterMode`` counts while ``fn()`` runs."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def transformer_flops(
    config: Mapping[str, Any],
    *,
    image_tokens: int,
    text_tokens: int,
    rows: int = 1,
    lora: Mapping[str, Any] | None = None,
    checkpointing: bool = False,
) -> tuple[int, int]:
    """Forward and backward FLOPs of a ``FluxTransformer2DModel`` of ``config`` on ``rows`` samples of
    ``image_tokens`` + ``text_tokens`` tokens. Built and run on the meta device.

    ``lora=None`` trains every parameter (full fine-tuning: the backward computes the weights' and the activations'
    gradients); ``lora`` (``peft.LoraConfig`` keyword arguments) freezes the base and adds that adapter as the
    trainer does (``add_adapter``): the adapters' products join the forward, and the backward computes only what
    autograd needs for the adapters' gradients. ``checkpointing`` enables the model's gradient checkpointing as the
    trainer does (``enable_gradient_checkpointing()``): the backward then also runs each block's forward again."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
        if lora is not None:
            from peft import LoraConfig

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(**lora))
        if checkpointing:
            model.enable_gradient_checkpointing()
        inputs = {
            "hidden_states": torch.empty(rows, image_tokens, config["in_channels"]),
            "encoder_hidden_states": torch.empty(rows, text_tokens, config["joint_attention_dim"]),
            "pooled_projections": torch.empty(rows, config["pooled_projection_dim"]),
            "timestep": torch.ones(rows),
            "guidance": torch.ones(rows) if config.get("guidance_embeds") else None,
            "img_ids": torch.zeros(image_tokens, 3),
            "txt_ids": torch.zeros(text_tokens, 3),
        }
    outputs = []
    forward = counted_flops(lambda: outputs.append(model(**inputs, return_dict=False)[0]))
    backward = counted_flops(lambda: outputs[0].sum().backward())
    return forward, backward


def vae_decode_flops(config: Mapping[str, Any], resolution: int) -> int:
    """FLOPs of one ``AutoencoderKL.decode`` of a ``resolution`` x ``resolution`` image (meta device, no graph)."""
    from diffusers import AutoencoderKL

    side = resolution // VAE_FACTOR
    with torch.device("meta"):
        vae = AutoencoderKL(**config)
        latents = torch.empty(1, config["latent_channels"], side, side)
    with torch.no_grad():
        return counted_flops(lambda: vae.decode(latents))


def text_encoder_flops(t5_config: Mapping[str, Any], clip_config: Mapping[str, Any], text_tokens: int) -> int:
    """FLOPs of encoding one prompt: T5's encoder on ``text_tokens`` tokens and CLIP's text tower on its own
    context (the Flux pipeline pads CLIP prompts to ``max_position_embeddings``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        t5 = T5EncoderModel(T5Config(**t5_config))
        clip = CLIPTextModel(CLIPTextConfig(**clip_config))
        t5_ids = torch.zeros(1, text_tokens, dtype=torch.long)
        clip_ids = torch.zeros(1, clip_config["max_position_embeddings"], dtype=torch.long)
    with torch.no_grad():
        return counted_flops(lambda: t5(t5_ids)) + counted_flops(lambda: clip(clip_ids))


@dataclass(frozen=True)
class StepCosts:
    """FLOPs of each unit of a training step's work (see :func:`step_flops`)."""

    forward_row: float
    backward_row: float
    recompute_row: float
    """What a backward row adds when the backbone's blocks are checkpointed: their forward, run again."""
    vae_decode: float
    text_encode: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def backbone_costs(
    config: Mapping[str, Any], *, image_tokens: int, text_tokens: int, lora: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """The backbone's unit costs of :class:`StepCosts` (``forward_row``, ``backward_row``, ``recompute_row``) for
    :func:`transformer_flops`' arguments: the recomputation is the checkpointed backward's excess over the plain
    one, both counted."""
    shape = {"image_tokens": image_tokens, "text_tokens": text_tokens, "lora": lora}
    forward, backward = transformer_flops(config, **shape)
    _, checkpointed = transformer_flops(config, **shape, checkpointing=True)
    return {"forward_row": forward, "backward_row": backward, "recompute_row": checkpointed - backward}


@functools.cache
def flux_dev_costs(resolution: int = 1024, text_tokens: int = 512) -> Mapping[str, StepCosts]:
    """The unit costs of FLUX.1-dev at ``resolution`` pixels (``(resolution / 16)^2`` image tokens: 4096 at
    1024 px) and ``text_tokens`` T5 tokens (512 for dev), per way of training it (:data:`TRAINING`: ``"lora"`` is
    :func:`flux_dev_lora`). Counted once per process (a minute or two of Python)."""
    image_tokens = (resolution // (2 * VAE_FACTOR)) ** 2
    vae_decode = vae_decode_flops(FLUX_DEV_VAE, resolution)
    text_encode = text_encoder_flops(FLUX_DEV_T5, FLUX_DEV_CLIP, text_tokens)
    costs = {}
    for training in TRAINING:
        backbone = backbone_costs(
            FLUX_DEV_TRANSFORMER, image_tokens=image_tokens, text_tokens=text_tokens,
            lora=flux_dev_lora() if training == "lora" else None,
        )  # fmt: skip
        costs[training] = StepCosts(**backbone, vae_decode=vae_decode, text_encode=text_encode)
    return MappingProxyType(costs)  # read-only: the cache hands the same one to every caller


def step_flops(costs: StepCosts, counts: Mapping[str, int], *, checkpointing: float) -> float:
    """FLOPs of the work ``counts`` at ``costs``: backbone rows forward (``graph_rows`` + ``no_grad_rows``) and
    backward (``backward_rows``), ``decoded_images`` VAE decodes and ``encoded_prompts`` prompt encodings.

    ``checkpointing`` is the fraction of the backbone's blocks that are checkpointed (``True``: all, ``False``: none):
    each backward row also recomputes their forward, ``checkpointing x recompute_row`` (a row's backward then costs
    about 3 forwards instead of 2 with every block checkpointed). Pricing a fraction of the blocks as that fraction of
    ``recompute_row`` assumes blocks of equal cost: FLUX.1-dev's double- and single-stream blocks both run about
    ``12 d^2`` multiply-adds per token in their projections."""
    backward_row = costs.backward_row + float(checkpointing) * costs.recompute_row
    return (
        (counts["graph_rows"] + counts["no_grad_rows"]) * costs.forward_row
        + counts["backward_rows"] * backward_row
        + counts["decoded_images"] * costs.vae_decode
        + counts["encoded_prompts"] * costs.text_encode
    )
