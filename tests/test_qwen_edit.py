"""Qwen-Image-Edit and Qwen-Image-Edit-Plus on tiny pipelines built from config: the rollout at noise level 0 is the
pipeline's own loop (prompts encoded by Qwen2.5-VL with the source images, reference latents after the generated
tokens), the trained LoRA loads back with the pipeline's `load_lora_weights` and edits as the trainer did, W = 2
JAGG equals the exact gradient, the velocity cache gives the recomputed gradient, and two LoRA + JAGG steps train
through `DDPOJaggTrainer` on a dataset of prompts and source images (several per row for Edit-Plus)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from testing_utils import noise_image

from trl_jagg.models import QwenImageEditAdapter, QwenImageEditPlusAdapter, load_adapter
from trl_jagg.rollout import sample_trajectories

AREA = 64 * 32  # the source images' pixel area: 32 x 32 for a square image, 64 x 32 for a 2:1 one (not 1024^2)
CFG = {"guidance_scale": 1.0, "true_cfg_scale": 4.0}


@pytest.fixture
def small_area(monkeypatch):
    """The pipelines resize source images to a hard-coded 1024^2 px (`calculate_dimensions(1024 * 1024, ...)` in
    QwenImageEditPipeline.__call__, `VAE_IMAGE_SIZE` in the Plus pipeline); this one constant is patched to AREA,
    and the adapters are told the same through their `source_image_area`."""
    original = pipeline_qwenimage_edit.calculate_dimensions
    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", lambda area, ratio: original(AREA, ratio))
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", AREA)


def pipeline_latents(pipe, prompts, images, negative, **kwargs) -> torch.Tensor:
    """The final latents of the pipeline's own loop (captured after its last step)."""
    captured = {}

    def keep(pipeline, step, timestep, tensors):
        captured["latents"] = tensors["latents"]
        return {}

    pipe(
        image=images, prompt=prompts, negative_prompt=negative, height=32, width=32, num_inference_steps=4,
        generator=torch.Generator().manual_seed(0), callback_on_step_end=keep, **kwargs,
    )  # fmt: skip
    return captured["latents"]


def adapter_latents(adapter, prompts, sources, negative, *, sampler="sde", **guidance) -> torch.Tensor:
    cond = adapter.condition(prompts, height=32, width=32, negative_prompt=negative, source_images=sources)
    noise = adapter.prepare_latents(len(prompts), 32, 32, torch.Generator().manual_seed(0))
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(adapter, cond, noise, sigmas, timesteps, sampler=sampler, noise_level=0.0,
                                     **guidance)  # fmt: skip
    return trajectory.latents[:, -1]


def test_defaults_are_the_pipelines(tiny_qwenimage_edit_path, tiny_qwenimage_edit_plus_path):
    edit, plus = load_adapter(tiny_qwenimage_edit_path), load_adapter(tiny_qwenimage_edit_plus_path)
    assert type(edit) is QwenImageEditAdapter and type(plus) is QwenImageEditPlusAdapter
    assert edit.source_image_area == plus.source_image_area == 1024 * 1024
    assert plus.vision_image_area == 384 * 384


@pytest.mark.parametrize("negative", [None, "dark"], ids=["no-cfg", "true-cfg"])
def test_edit_rollout_at_noise_level_0_is_the_pipeline_loop(tiny_qwenimage_edit_path, small_area, negative):
    """A batch of two prompts of different lengths editing two source images."""
    pipe = DiffusionPipeline.from_pretrained(tiny_qwenimage_edit_path)
    adapter = load_adapter(pipe)
    adapter.source_image_area = AREA
    prompts, images = ["make it red", "a big blue square on the left"], [noise_image(0, 32), noise_image(1, 32)]
    guidance = CFG if negative else {"guidance_scale": 1.0, "true_cfg_scale": 1.0}
    expected = pipeline_latents(pipe, prompts, images, [negative] * 2 if negative else None,
                                true_cfg_scale=guidance["true_cfg_scale"])  # fmt: skip
    ours = adapter_latents(adapter, prompts, images, negative, **guidance)

    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # The source image is read, by the text encoder and as reference tokens: other sources give another edit.
    swapped = adapter_latents(adapter, prompts, images[::-1], negative, **guidance)
    assert not torch.allclose(swapped, ours, atol=1e-3)


def test_edit_plus_rollout_at_noise_level_0_is_the_pipeline_loop(tiny_qwenimage_edit_plus_path, small_area):
    """One prompt editing two source images of different aspect ratios (the pipeline takes a batch of one)."""
    pipe = DiffusionPipeline.from_pretrained(tiny_qwenimage_edit_plus_path)
    adapter = load_adapter(pipe)
    adapter.source_image_area = AREA
    images = [noise_image(0, 32), noise_image(1, 48).crop((0, 0, 48, 24))]  # 2:1: VAE-encoded at 64 x 32 px
    assert adapter.reference_sizes(images) == ((32, 32), (64, 32))  # two grids of reference tokens
    expected = pipeline_latents(pipe, ["put them together"], images, ["dark"], true_cfg_scale=CFG["true_cfg_scale"])
    ours = adapter_latents(adapter, ["put them together"], [images], "dark", **CFG)

    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    one = adapter_latents(adapter, ["put them together"], [images[:1]], "dark", **CFG)
    assert not torch.allclose(one, ours, atol=1e-3)  # the second image is read
