"""The model adapter interface: what differs between flow-matching pipeline families, and nothing about GRPO.

An adapter wraps a diffusers pipeline and answers four questions for the shared sampler and trainer:
how to turn prompts into backbone conditioning, how to draw initial latents, what the noise schedule is, and how
one backbone call (with guidance) maps latents to a velocity. Decoding latents to images is the fifth.

A family implements ``encode_prompts`` and ``predict_velocity`` (plus ``shared_inputs`` for position ids or image
shapes) and sets the class flags below; it overrides ``decode_latents`` only when its VAE is not an
``AutoencoderKL`` with a scaling and a shift factor. Everything else is here, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import DiffusionPipeline
from PIL import Image


@dataclass
class Conditioning:
    """Everything the backbone needs besides latents and timestep.

    Attributes:
        per_sample: tensors with the batch dimension first (prompt embeddings, masks, negative embeddings).
        shared: inputs common to the batch (e.g. Flux's ``txt_ids``/``img_ids``, Qwen-Image's ``img_shapes``).
    """

    per_sample: dict[str, torch.Tensor]
    shared: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.per_sample[key] if key in self.per_sample else self.shared[key]

    def __contains__(self, key: str) -> bool:
        return key in self.per_sample or key in self.shared

    def get(self, key: str, default: Any = None) -> Any:
        """The input ``key``, or ``default`` when absent (an optional input such as Qwen-Image's text mask)."""
        return self[key] if key in self else default

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> Conditioning:
        """The conditioning of a subset of the batch."""
        return Conditioning({k: v[index] for k, v in self.per_sample.items()}, self.shared)


def padded_prompt_batch(rows: Sequence[torch.Tensor], mask_dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    """Prompt embeddings of different lengths ``(tokens_i, dim)`` as one batch, right-padded with zeros, as the
    Qwen-Image pipeline batches them: ``prompt_embeds`` ``(batch, max tokens, dim)`` and ``prompt_embeds_mask``
    ``(batch, max tokens)`` (``None`` when no row is padded, meaning attend to every token)."""
    length = max(row.shape[0] for row in rows)
    embeds = torch.stack([torch.nn.functional.pad(row, (0, 0, 0, length - row.shape[0])) for row in rows])
    if all(row.shape[0] == length for row in rows):
        return {"prompt_embeds": embeds, "prompt_embeds_mask": None}
    mask = torch.stack([torch.arange(length, device=embeds.device) < row.shape[0] for row in rows]).to(mask_dtype)
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


def unpadded_prompt_rows(embeds: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The rows of a :func:`padded_prompt_batch` without their padding (each prompt's own tokens)."""
    if mask is None:
        return list(embeds.unbind(0))
    return [row[keep.bool()] for row, keep in zip(embeds, mask)]


def _joined(first: torch.Tensor | list | None, second: torch.Tensor | list | None) -> torch.Tensor | list | None:
    """Two branches' values of one backbone input as one batch (see :meth:`FlowMatchingAdapter.batch_branches`)."""
    if first is None:
        return None
    return first + second if isinstance(first, list) else torch.cat([first, second])


def classifier_free_guidance(
    cond: torch.Tensor, uncond: torch.Tensor, scale: float, *, rescale_to_cond_norm: bool = False
) -> torch.Tensor:
    """``v = v_u + w (v_c - v_u)``; optionally rescaled per token to the conditional prediction's norm
    (Qwen-Image's true CFG), which keeps large scales from blowing up the latent scale."""
    guided = uncond + scale * (cond - uncond)
    if rescale_to_cond_norm:
        guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
    return guided


class FlowMatchingAdapter:
    """Base class of model adapters; subclasses implement the per-family pieces.

    Latents handed between sampler steps are float32 (log-probabilities are exact there); the adapter casts them
    to the backbone's dtype for each call.

    What every family shares lives here: prompt conditioning around the family's ``encode_prompts`` (the negative
    prompt encoded once per setting and cached, expanded to the batch), initial noise through the pipeline's own
    ``prepare_latents``, the schedule, the guidance bookkeeping (:meth:`cfg_scale`, :meth:`embedded_guidance`), and
    the ``AutoencoderKL`` decode (``latents / scaling_factor + shift_factor``) after the optional 2x2 unpacking.

    Class attributes:
        pipeline_class: the diffusers pipeline class this adapter serves (the registry key).
        linspace_sigmas: whether the pipeline passes ``sigmas = linspace(1, 1/N, N)`` to the scheduler (Flux,
            Qwen-Image) rather than letting it build its own (SD3).
        guidance_is_cfg: whether ``guidance_scale`` is a classifier-free guidance scale (SD3) rather than an
            embedded guidance value (Flux); ``true_cfg_scale`` is true CFG for the others.
        packed_latents: whether the backbone takes 2x2-packed latent tokens ``(batch, tokens, 4 * channels)``
            (Flux, Qwen-Image) rather than latent images ``(batch, channels, h, w)`` (SD3).
        edits_images: whether the family conditions on source images (image editing: FLUX.1 Kontext), which
            :meth:`condition` then requires (``source_images``) and :meth:`encode_source_images` encodes.
        max_source_images: how many source images one sample may edit (Qwen-Image-Edit-Plus: several, ``None``);
            with more than one, each sample's source is a list of images.
        prompts_see_images: whether the prompt encoding reads the source images (Qwen-Image-Edit's
            vision-language encoder): prompts and the negative prompt are then encoded per sample with its images by
            :meth:`encode_prompts_with_images`, never cached nor precomputed.
        prompt_mask_dtype: set where prompts encode to different lengths (Qwen-Image, Z-Image): the batch is
            right-padded with a ``prompt_embeds_mask`` of this dtype (:func:`padded_prompt_batch`); ``None``: fixed
            lengths, batches concatenate.
        makes_videos: whether samples are videos (Wan): 5-D latents ``(batch, channels, frames, h, w)`` for the
            instance's ``num_frames`` pixel frames, and :meth:`to_images` gives one list of frames per sample.
        lora_target_modules: sensible default LoRA targets (the attention projections).
    """

    pipeline_class: ClassVar[type[DiffusionPipeline]]
    linspace_sigmas: ClassVar[bool] = True
    guidance_is_cfg: ClassVar[bool] = False
    packed_latents: ClassVar[bool] = True
    prompt_mask_dtype: ClassVar[torch.dtype | None] = None
    edits_images: ClassVar[bool] = False
    max_source_images: ClassVar[int | None] = 1
    prompts_see_images: ClassVar[bool] = False
    makes_videos: ClassVar[bool] = False
    lora_target_modules: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: DiffusionPipeline):
        if not isinstance(pipeline, self.pipeline_class):
            raise TypeError(
                f"{type(self).__name__} serves {self.pipeline_class.__name__}, got {type(pipeline).__name__}."
            )
        self.pipeline = pipeline
        self._negative_cache: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}
        self._placement: tuple[torch.device, torch.dtype] | None = None

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @property
    def trained_experts(self) -> tuple[str, ...]:
        """The experts (:meth:`expert_of` values) the training updates: the one transformer, except where a
        two-expert pipeline trains one of them (Wan2.2 A14B's ``train_experts``)."""
        return ("transformer",)

    def expert_of(self, timestep: float | torch.Tensor) -> str:
        """The pipeline component that denoises scheduler timestep ``timestep``: ``"transformer"``, except in
        two-expert pipelines (Wan2.2 A14B switches to ``"transformer_2"`` below its boundary)."""
        return "transformer"

    # What the trainer's backbone, checkpoint and Hub code ask of the trained backbone. One network by default; a
    # family whose backbone holds several pipeline components (Wan2.2 A14B's experts) overrides them.
    def trained_parts(self, backbone: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The pipeline components ``backbone`` (:attr:`transformer`, or a copy of it) trains, by component name:
        what gets LoRA or trainable weights and is saved. ``{"transformer": backbone}`` by default."""
        return {"transformer": backbone}

    def config_module(self, backbone: torch.nn.Module) -> torch.nn.Module:
        """The module whose diffusers config describes ``backbone`` (the one the trainer tracks): ``backbone``."""
        return backbone

    def saved_parts(self, backbone: torch.nn.Module, folder: str) -> list[tuple[str, torch.nn.Module, str]]:
        """``(name, module, folder)`` of each trained part a save of ``backbone`` into ``folder`` writes, and where:
        the backbone in ``folder`` by default."""
        return [(name, part, folder) for name, part in self.trained_parts(backbone).items()]

    def part_state(self, backbone: torch.nn.Module, name: str, state_dict: dict | None) -> dict | None:
        """Part ``name``'s entries of a gathered state dict of the whole ``backbone``: all of it by default."""
        return state_dict

    def check_saved_parts(self, path: str, backbone: torch.nn.Module, args: Any) -> None:
        """Refuse checkpoint ``path`` when its parts are not those ``backbone`` trains under config ``args`` (a run
        resumed with other trained parts would miss weights or leave some out): nothing to check by default."""

    def card_parts(self, backbone: torch.nn.Module) -> list[str]:
        """The component folders the model card's loading snippet names, one per saved part: none (the weights sit
        in the output folder itself) by default."""
        return []

    @property
    def device(self) -> torch.device:
        """The backbone's device, read once (see :meth:`refresh_placement`)."""
        return self._read_placement()[0]

    @property
    def dtype(self) -> torch.dtype:
        """The backbone's dtype, read once (see :meth:`refresh_placement`)."""
        return self._read_placement()[1]

    def refresh_placement(self) -> None:
        """Forget the backbone's device and dtype, to be read again at the next use. Call it after moving or
        casting the transformer: diffusers' ``ModelMixin.device`` / ``.dtype`` walk every submodule (about 10 ms
        on FLUX.1-dev's module tree, 42 ms with LoRA), so backbone calls must not read them each time."""
        self._placement = None

    def _read_placement(self) -> tuple[torch.device, torch.dtype]:
        if self._placement is None:
            self._placement = (self.transformer.device, self.transformer.dtype)
        return self._placement

    # ---- per family ----
    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        """The pipeline's ``encode_prompt`` for ``prompts``: text inputs of the backbone, batch first, keyed by
        their name in :class:`Conditioning` (``prompt_embeds``, ...). A ``None`` value (Qwen-Image's mask when no
        prompt is padded) is left out of the conditioning, and reads back as ``None`` through ``cond.get``.

        ``max_sequence_length=None`` means the pipeline's own default. Runs under ``no_grad``.
        """
        raise NotImplementedError

    def predict_velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cond: Conditioning,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        uncond_grad: bool = True,
    ) -> torch.Tensor:
        """One guided backbone evaluation: the velocity at ``latents`` and scheduler ``timestep`` (``(batch,)``).

        ``transformer`` is passed explicitly because the trainer calls the DDP/FSDP-wrapped module. Differentiable
        through every branch by default; ``uncond_grad=False`` runs the unconditional branch of classifier-free
        guidance without a graph (see :meth:`guided_velocity`), so the gradient flows through the conditional
        prediction only and a backward covers ``batch`` samples, not ``2 * batch``.
        """
        raise NotImplementedError

    def shared_inputs(self, per_sample: dict[str, torch.Tensor], height: int, width: int) -> dict[str, Any]:
        """Backbone inputs common to the whole batch at this resolution (position ids, image shapes)."""
        return {}

    def encode_source_images(self, images: Sequence[Any], height: int, width: int) -> Conditioning:
        """Conditioning of editing families from their source images (one per sample, or a list per sample where
        ``max_source_images`` allows several): per sample, e.g. the reference latents ``reference_latents`` (see
        :meth:`with_reference_tokens`); shared, e.g. their grid. Text-to-image families take none."""
        raise ValueError(
            f"{type(self).__name__} generates from text only: it takes no source images (got {len(images)}). Use an "
            "editing model (FluxKontextPipeline, QwenImageEditPipeline) or drop the dataset's source image column."
        )

    def source_call_kwargs(self, height: int, width: int) -> dict[str, Any]:
        """The pipeline-call arguments under which the pipeline conditions on a source image as this adapter does
        at ``height`` x ``width`` (the model card's snippet passes them); none where its defaults already do."""
        return {}

    def reference_sizes(self, sample: Any) -> Any:
        """What a sample's source images give that one batch must share (Qwen-Image-Edit: each image's resized
        ``(width, height)``); ``None`` where any images batch together (FLUX.1 Kontext resizes them to the output)."""
        return None

    def encode_prompts_with_images(
        self, prompts: list[str], images: Sequence[Any], negative_prompt: str | None
    ) -> dict[str, torch.Tensor]:
        """The text inputs of families whose prompt encoding reads the source images (``prompts_see_images``):
        ``prompts`` and, when given, ``negative_prompt`` (keys prefixed ``negative_``), each encoded with the
        sample's ``images``."""
        raise NotImplementedError

    @staticmethod
    def with_reference_tokens(hidden: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The backbone's token sequence: the generated tokens, then the reference image's (``reference_latents``)
        when the conditioning has them. Only the first ``hidden.shape[1]`` output tokens are denoised."""
        reference = cond.get("reference_latents")
        return hidden if reference is None else torch.cat([hidden, reference.to(hidden.dtype)], dim=1)

    # ---- shared ----
    def collate(self, encoded: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch from prompts encoded one at a time (each :meth:`encode_prompts` output, ``None`` entries
        left out): what encoding them together gives. Fixed-length encodings concatenate; variable-length ones
        (``prompt_mask_dtype``) are padded to the longest, as the pipelines batch them."""
        if self.prompt_mask_dtype is not None:
            rows = [
                row for e in encoded for row in unpadded_prompt_rows(e["prompt_embeds"], e.get("prompt_embeds_mask"))
            ]
            return _present(padded_prompt_batch(rows, self.prompt_mask_dtype))
        keys = encoded[0].keys()
        for key in keys:
            if any(e.keys() != keys or e[key].shape[1:] != encoded[0][key].shape[1:] for e in encoded):
                raise ValueError(
                    f"{type(self).__name__} cannot batch prompts encoded separately: their `{key}` shapes differ."
                )
        return {key: torch.cat([e[key] for e in encoded]) for key in keys}

    def condition(
        self,
        prompts: Sequence[str],
        *,
        height: int,
        width: int,
        negative_prompt: str | None = None,
        max_sequence_length: int | None = None,
        encoded: dict[str, torch.Tensor] | None = None,
        source_images: Sequence[Image.Image] | None = None,
    ) -> Conditioning:
        """Encode ``prompts`` (and the negative prompt when given) and add the resolution's spatial inputs.

        The negative prompt is the same for every sample: it is encoded once per (prompt, length, device) and
        cached (the text encoders are frozen), then expanded to the batch, so every entry of ``per_sample`` has
        the batch first and :meth:`Conditioning.select` can index it. ``encoded``: the prompts' encodings when
        already computed (e.g. :meth:`collate` of precomputed ones); the prompts are then not encoded again.
        ``source_images``: one RGB image per prompt (a list of them where ``max_source_images`` allows several),
        required by editing families (``edits_images``) and refused by the others.
        """
        if source_images is None and self.edits_images:
            raise ValueError(
                f"{type(self).__name__} edits images: pass `source_images` (one RGB image per prompt; in training, a "
                "source image column beside the prompts)."
            )
        if source_images is not None and len(source_images) != len(prompts):
            raise ValueError(
                f"Got {len(source_images)} source images for {len(prompts)} prompts: give one per prompt."
            )
        if encoded is not None and self.prompts_see_images:
            raise ValueError(
                f"{type(self).__name__} encodes each prompt with its source images: it takes no precomputed "
                "encodings (set precompute_prompt_embeds=False)."
            )
        with torch.no_grad():
            if self.prompts_see_images:
                per_sample = self.encode_prompts_with_images(list(prompts), source_images, negative_prompt)
            else:
                if encoded is None:
                    encoded = _present(self.encode_prompts(list(prompts), max_sequence_length))
                per_sample = dict(encoded)
                if negative_prompt is not None:
                    negative = self._encoded_negative(negative_prompt, max_sequence_length)
                    per_sample |= {
                        f"negative_{key}": value.expand(len(prompts), *value.shape[1:])
                        for key, value in negative.items()
                    }
            shared = {}
            if source_images is not None:
                reference = self.encode_source_images(source_images, height, width)
                per_sample |= reference.per_sample
                shared = reference.shared
        return Conditioning(per_sample, self.shared_inputs(per_sample, height, width) | shared)

    def _encoded_negative(self, negative_prompt: str, max_sequence_length: int | None) -> dict[str, torch.Tensor]:
        key = (negative_prompt, max_sequence_length, str(self.device))
        if key not in self._negative_cache:
            self._negative_cache[key] = _present(self.encode_prompts([negative_prompt], max_sequence_length))
        return self._negative_cache[key]

    def prepare_latents(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """Initial noise in the backbone's latent layout, drawn as the pipeline draws it, in float32."""
        channels = self.transformer.config.in_channels // (4 if self.packed_latents else 1)
        # Editing pipelines take the source image first; without one they draw the noise alone.
        leading = (None,) if self.edits_images else ()
        latents = self.pipeline.prepare_latents(
            *leading, batch_size, channels, height, width, torch.float32, self.device, generator
        )
        # Flux's returns (latents, image ids), the editing pipelines' (latents, source latents); others the latents.
        return latents[0] if isinstance(latents, tuple) else latents

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float) -> float:
        """The classifier-free guidance scale these settings mean for this family (``<= 1``: no unconditional
        branch): ``guidance_scale`` where it is CFG (SD3), ``true_cfg_scale`` otherwise."""
        if not self.guidance_is_cfg:
            return true_cfg_scale
        if true_cfg_scale > 1:
            raise ValueError(
                f"true_cfg_scale={true_cfg_scale} has no meaning for {self.pipeline_class.__name__}: its "
                "classifier-free guidance scale is guidance_scale. Set true_cfg_scale=1 and guidance_scale instead."
            )
        return guidance_scale

    def needs_negative_prompt(self, guidance_scale: float, true_cfg_scale: float) -> bool:
        """Whether these guidance settings run an unconditional branch, so ``condition`` must encode the negative
        prompt."""
        return self.cfg_scale(guidance_scale, true_cfg_scale) > 1

    def guidance_branches(self, cond: Conditioning, guidance_scale: float, true_cfg_scale: float) -> float | None:
        """The CFG scale when the unconditional branch runs, else ``None``; raises if it should run but ``cond``
        has no negative prompt (``condition`` was called without one)."""
        scale = self.cfg_scale(guidance_scale, true_cfg_scale)
        if scale <= 1:
            return None
        if "negative_prompt_embeds" not in cond:
            raise ValueError(
                f"Classifier-free guidance at scale {scale} needs the negative prompt's embeddings: pass "
                '`negative_prompt` ("" for the empty prompt) to `condition`.'
            )
        return scale

    def guided_velocity(
        self,
        call: Callable[[dict[str, Any]], torch.Tensor],
        branch_inputs: Callable[[str], dict[str, Any]],
        cond: Conditioning,
        *,
        guidance_scale: float,
        true_cfg_scale: float,
        uncond_grad: bool,
        rescale_to_cond_norm: bool = False,
    ) -> torch.Tensor:
        """One guided backbone evaluation, shared by the families' :meth:`predict_velocity`.

        ``branch_inputs(prefix)`` gives the backbone's per-row inputs of one branch (the conditioning keys with that
        prefix: ``""`` or ``"negative_"``) and ``call(inputs)`` runs the backbone on them. Without CFG that is one
        call. With CFG both branches run as one call on ``2B`` rows, unconditional half first (as SD3's pipeline
        does), except when a graph is being built and the unconditional branch gets no gradient (``uncond_grad``
        off): then the conditional call keeps a graph and the unconditional one runs under ``no_grad``, a constant
        that stores no activations, so the backward covers ``B`` rows, not ``2B``.
        """
        scale = self.guidance_branches(cond, guidance_scale, true_cfg_scale)
        if scale is None:
            return call(branch_inputs(""))
        if torch.is_grad_enabled() and not uncond_grad:
            conditional = call(branch_inputs(""))
            with torch.no_grad():
                uncond = call(branch_inputs("negative_"))
        else:
            uncond, conditional = call(self.batch_branches(branch_inputs("negative_"), branch_inputs(""))).chunk(2)
        return classifier_free_guidance(conditional, uncond, scale, rescale_to_cond_norm=rescale_to_cond_norm)

    def batch_branches(self, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
        """The backbone inputs of two branches as one batch, ``first``'s rows first: tensors concatenated along the
        batch, lists (list-input backbones: Z-Image) joined, ``None`` left as is. Families whose branch inputs may
        differ in length override it."""
        return {key: _joined(value, second[key]) for key, value in first.items()}

    def embedded_guidance(self, batch_size: int, guidance_scale: float) -> torch.Tensor | None:
        """The guidance value of guidance-distilled backbones (``guidance_embeds``), as the pipelines pass it
        (float32, unscaled: the transformer multiplies it by 1000); ``None`` for the others."""
        if not self.transformer.config.get("guidance_embeds", False):
            return None
        return torch.full((batch_size,), guidance_scale, device=self.device, dtype=torch.float32)

    def image_seq_len(self, height: int, width: int) -> int:
        """Tokens of the packed latent image: the input of the dynamic schedule shift."""
        scale = self.pipeline.vae_scale_factor * 2
        return (height // scale) * (width // scale)

    def schedule_shift(self, num_steps: int, height: int, width: int) -> float:
        """The dynamic shift ``mu`` of schedulers with ``use_dynamic_shifting``: the pipelines' ``calculate_shift``,
        linear in the packed sequence length between the scheduler config's base and max points."""
        config = self.pipeline.scheduler.config
        base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
        base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
        slope = (max_shift - base_shift) / (max_len - base_len)
        return self.image_seq_len(height, width) * slope + base_shift - slope * base_len

    def schedule(self, num_steps: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's own schedule for ``num_steps`` at this resolution.

        Returns ``(sigmas, timesteps)``: ``num_steps + 1`` float32 flow times ending at 0, and the ``num_steps``
        scheduler timesteps the backbone is called with.
        """
        scheduler = self.pipeline.scheduler
        config = scheduler.config
        kwargs: dict[str, Any] = {}
        if config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self.schedule_shift(num_steps, height, width)
        if self.linspace_sigmas and not config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device=self.device, **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device=self.device, **kwargs)
        return scheduler.sigmas.float().clone(), scheduler.timesteps.clone()

    def unpack_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Backbone latents to the VAE's layout: the pipeline's ``_unpack_latents`` for packed families."""
        if not self.packed_latents:
            return latents
        return self.pipeline._unpack_latents(latents, height, width, self.pipeline.vae_scale_factor)

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """VAE-decode to pixel space in [-1, 1], ``(batch, 3, height, width)``: the ``AutoencoderKL`` families'
        ``latents / scaling_factor + shift_factor`` (Flux, SD3)."""
        vae = self.pipeline.vae
        latents = self.unpack_latents(latents, height, width)
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> list[Image.Image]:
        """Latents to PIL images, through the pipeline's own image processor."""
        return self.to_images(self.decode_latents(latents, height, width))

    def to_images(self, pixels: torch.Tensor) -> list[Image.Image]:
        """Decoded pixels (:meth:`decode_latents`) to PIL images, through the pipeline's own image processor (a NaN
        becomes a black pixel: check the pixels first where it matters)."""
        return self.pipeline.image_processor.postprocess(pixels.float(), output_type="pil")


def _present(inputs: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Drop the optional inputs that are ``None``: only tensors can be indexed per sample."""
    return {key: value for key, value in inputs.items() if value is not None}
