"""Wan2.1, Wan2.2 A14B and Wan2.2 TI2V-5B text-to-video (``WanPipeline``): UMT5 prompts, 5-D video latents ``(batch,
channels, frames, h, w)`` denoised by a 3-D DiT predicting the flow velocity (Wan2.2 A14B: two experts, switched at
``boundary_ratio``; TI2V-5B: one timestep per latent patch token), and the causal video VAE with per-channel latent
statistics."""

from __future__ import annotations

import os
from typing import Any

import torch
from diffusers import WanPipeline
from PIL import Image

from trl_jagg.models.base import Conditioning, FlowMatchingAdapter
from trl_jagg.models.wan_experts import EXPERTS, TRAIN_EXPERTS, WanExperts, check_saved_experts

DEFAULT_NUM_FRAMES = 81
"""``WanPipeline``'s default ``num_frames``."""


class WanAdapter(FlowMatchingAdapter):
    """Adapter for :class:`~diffusers.WanPipeline`: Wan2.1 (one transformer) and Wan2.2 A14B (two experts).

    Differs from the base in five ways. Latents are videos ``(batch, channels, latent frames, h, w)``, drawn by the
    pipeline's ``prepare_latents`` for :attr:`num_frames` pixel frames; the sampler, log-probs (means over every
    latent dimension) and the engine take them as they take images. ``guidance_scale`` is a CFG scale
    (``v_u + g (v_c - v_u)``, on from ``g > 1``; both branches in one backbone call on ``2B``, where the pipeline
    makes two). The schedule is the scheduler's own (``set_timesteps(N)`` with its shift), as the pipeline sets it.
    Decoding undoes the VAE's ``latents_mean`` / ``latents_std`` and returns ``(batch, 3, frames, H, W)`` pixels, and
    :meth:`to_images` one list of PIL frames per sample (a video; rewards score it per frame or whole, see
    :func:`~trl_jagg.rewards.takes_videos`).

    Wan2.2 A14B (``transformer_2`` and ``boundary_ratio``): the trained backbone is :class:`WanExperts`, and each
    backbone call goes to the expert ``WanPipeline.__call__`` picks, ``transformer`` for timesteps ``>=
    boundary_ratio * num_train_timesteps`` and ``transformer_2`` below, with :attr:`guidance_scale_2` for the latter.
    :meth:`choose_experts` says which experts are trained.

    Wan2.2 TI2V-5B (``expand_timesteps``, one transformer, the 48-channel Wan2.2 VAE): the backbone takes one timestep
    per latent patch token, ``(batch, tokens)``, as the pipeline builds it (:meth:`backbone_timestep`). Text-to-video
    only: ``WanPipeline`` takes no image, so its first-frame conditioning (a mask that keeps the image's tokens at
    timestep 0) never arises here.
    """

    pipeline_class = WanPipeline
    linspace_sigmas = False  # the pipeline calls set_timesteps(num_inference_steps)
    guidance_is_cfg = True
    packed_latents = False  # the transformer patchifies 1x2x2 itself
    makes_videos = True
    # Flow-GRPO's Wan targets include `add_*_proj` (image-to-video cross-attention), absent from text-to-video.
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipeline: WanPipeline):
        super().__init__(pipeline)
        if (pipeline.transformer_2 is None) != (pipeline.config.boundary_ratio is None):
            # The pipeline itself runs one expert then (whichever is present); nothing to train the switch on.
            raise ValueError(
                "This WanPipeline has one of `transformer_2` and `boundary_ratio` without the other. Wan2.2 A14B "
                "has both (two experts), Wan2.1 neither: load a complete checkpoint."
            )
        self.experts: WanExperts | None = None
        if pipeline.transformer_2 is not None:
            boundary = pipeline.config.boundary_ratio * pipeline.scheduler.config.num_train_timesteps
            self.experts = WanExperts(pipeline.transformer, pipeline.transformer_2, boundary)
        self.guidance_scale_2: float | None = None
        self._num_frames = DEFAULT_NUM_FRAMES

    @property
    def transformer(self) -> torch.nn.Module:
        """The trained backbone: the pipeline's transformer, or Wan2.2's :class:`WanExperts`."""
        return self.experts if self.experts is not None else self.pipeline.transformer

    @property
    def trained_experts(self) -> tuple[str, ...]:
        return self.experts.trained if self.experts is not None else EXPERTS[:1]

    def choose_experts(self, train_experts: str) -> None:
        """``GRPOJaggConfig.train_experts``: train ``"both"`` experts, the ``"high_noise"`` or the ``"low_noise"``
        one (set before the trainer prepares the backbone: the others get no LoRA)."""
        if train_experts not in TRAIN_EXPERTS:
            raise ValueError(f"train_experts={train_experts!r}: use one of {tuple(TRAIN_EXPERTS)}.")
        if self.experts is None:
            raise ValueError(f"train_experts={train_experts!r}: this WanPipeline has one transformer (Wan2.1).")
        self.experts.trained = TRAIN_EXPERTS[train_experts]

    def expert_of(self, timestep: float | torch.Tensor) -> str:
        return self.experts.expert_of(timestep) if self.experts is not None else EXPERTS[0]

    # Wan2.2 A14B's backbone is its two experts: each trained expert is a part, saved in its component folder.
    def trained_parts(self, backbone: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return backbone.trained_parts() if isinstance(backbone, WanExperts) else super().trained_parts(backbone)

    def config_module(self, backbone: torch.nn.Module) -> torch.nn.Module:
        return backbone.transformer if isinstance(backbone, WanExperts) else backbone  # the experts share one

    def saved_parts(self, backbone: torch.nn.Module, folder: str) -> list[tuple[str, torch.nn.Module, str]]:
        """Wan2.2 A14B: each trained expert in its component folder, ``folder/transformer`` and
        ``folder/transformer_2`` (the pipeline's layout; a LoRA there loads with ``load_lora_weights``,
        ``load_into_transformer_2=True`` for the second)."""
        if not isinstance(backbone, WanExperts):
            return super().saved_parts(backbone, folder)
        return [(name, part, os.path.join(folder, name)) for name, part in backbone.trained_parts().items()]

    def part_state(self, backbone: torch.nn.Module, name: str, state_dict: dict | None) -> dict | None:
        """Wan2.2 A14B: the expert's ``name.*`` keys, without the prefix."""
        if state_dict is None or not isinstance(backbone, WanExperts):
            return state_dict
        return {key.removeprefix(f"{name}."): value for key, value in state_dict.items() if key.startswith(f"{name}.")}

    def check_saved_parts(self, path: str, backbone: torch.nn.Module, args: Any) -> None:
        if isinstance(backbone, WanExperts):
            check_saved_experts(path, backbone.trained, args.train_experts)

    def card_parts(self, backbone: torch.nn.Module) -> list[str]:
        return list(backbone.trained_parts()) if isinstance(backbone, WanExperts) else []

    @property
    def num_frames(self) -> int:
        """Pixel frames of each video (``GRPOJaggConfig.num_frames``): ``4 k + 1`` for the 4x temporal VAE."""
        return self._num_frames

    @num_frames.setter
    def num_frames(self, value: int) -> None:
        temporal = self.pipeline.vae_scale_factor_temporal
        if not isinstance(value, int) or value < 1 or (value - 1) % temporal:
            # The pipeline rounds such a value with a warning; a training run should not sample another length.
            raise ValueError(
                f"num_frames={value!r}: Wan's VAE compresses time {temporal}x, so videos have {temporal} k + 1 frames "
                f"(e.g. {DEFAULT_NUM_FRAMES}, or 33 as Flow-GRPO trains). Set GRPOJaggConfig.num_frames to one."
            )
        self._num_frames = value

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None) -> dict[str, torch.Tensor | None]:
        embeds, _ = self.pipeline.encode_prompt(
            list(prompts),
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length or 512,  # the pipeline's default; padded with zeros to it
            device=self.device,
        )
        return {"prompt_embeds": embeds}

    def prepare_latents(self, batch_size: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        channels = self.transformer.config.in_channels
        return self.pipeline.prepare_latents(
            batch_size, channels, height, width, self.num_frames, torch.float32, self.device, generator
        )

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
        hidden = latents.to(self.dtype)
        if self.experts is None:
            return self._guided(transformer, {}, hidden, timestep, cond, guidance_scale, true_cfg_scale, uncond_grad)
        # One backbone call may batch several steps (the update's no-grad velocities): each row goes to its expert.
        high = timestep >= self.experts.boundary_timestep
        scales = {EXPERTS[0]: guidance_scale, EXPERTS[1]: self._low_noise_scale(guidance_scale)}
        if high.all() or not high.any():
            expert = EXPERTS[0] if high.all() else EXPERTS[1]
            return self._guided(
                transformer, {"expert": expert}, hidden, timestep, cond, scales[expert], true_cfg_scale, uncond_grad
            )
        velocity = None
        for expert, rows in ((EXPERTS[0], high.nonzero()[:, 0]), (EXPERTS[1], (~high).nonzero()[:, 0])):
            part = self._guided(
                transformer, {"expert": expert}, hidden[rows], timestep[rows], cond.select(rows), scales[expert],
                true_cfg_scale, uncond_grad,
            )  # fmt: skip
            velocity = part.new_zeros(hidden.shape) if velocity is None else velocity
            velocity = velocity.index_copy(0, rows, part)
        return velocity

    def _low_noise_scale(self, guidance_scale: float) -> float:
        """The low-noise expert's CFG scale as the pipeline has it: CFG runs on both experts or neither (from
        ``guidance_scale > 1``), the low-noise one at ``guidance_scale_2`` (``guidance_scale`` when unset)."""
        return guidance_scale if self.guidance_scale_2 is None or guidance_scale <= 1 else self.guidance_scale_2

    def _guided(
        self, transformer: torch.nn.Module, route: dict[str, str], hidden: torch.Tensor, timestep: torch.Tensor,
        cond: Conditioning, guidance_scale: float, true_cfg_scale: float, uncond_grad: bool,
    ) -> torch.Tensor:  # fmt: skip
        """One guided call of ``transformer`` (``route``: Wan2.2's expert keyword) on these rows."""

        def branch_inputs(prefix: str) -> dict[str, Any]:
            return {
                "hidden_states": hidden,
                "timestep": self.backbone_timestep(timestep, hidden),
                "encoder_hidden_states": cond[f"{prefix}prompt_embeds"],
            }

        def call(inputs: dict[str, Any]) -> torch.Tensor:
            return transformer(**route, **inputs, return_dict=False)[0]

        return self.guided_velocity(
            call, branch_inputs, cond, guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale,
            uncond_grad=uncond_grad,
        )  # fmt: skip

    def backbone_timestep(self, timestep: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The backbone's ``timestep`` for ``hidden``, one value per row: ``timestep`` itself, or with
        ``expand_timesteps`` one value per latent patch token, ``(batch, tokens)``.

        The pipeline's text-to-video loop takes ``(mask[0][0][:, ::2, ::2] * t).flatten()`` with an all-ones mask
        (tokens: latent frames x every other latent row x every other column, the 1x2x2 patch grid), expanded over
        the batch. The rows here may hold different steps (the update batches several), so each row's own timestep
        fills its tokens; with one step per call this is the pipeline's tensor.
        """
        if not self.pipeline.config.expand_timesteps:
            return timestep
        tokens = hidden[0, 0, :, ::2, ::2].numel()
        return timestep.to(torch.float32)[:, None].expand(-1, tokens)  # float32: the pipeline's mask times t

    def decode_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        # The pipeline's `latents / (1 / std) + mean`, per latent channel.
        vae = self.pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]

    def to_images(self, pixels: torch.Tensor) -> list[list[Image.Image]]:
        """Decoded videos ``(batch, 3, frames, H, W)`` to one list of PIL frames per sample, through the pipeline's
        video processor."""
        return self.pipeline.video_processor.postprocess_video(pixels.float(), output_type="pil")
