"""Wan2.2 TI2V-5B text-to-video on its tiny pipeline (`expand_timesteps`: one timestep per latent patch token; the
48-channel Wan2.2 VAE at 16x): the backbone gets the pipeline's per-token timesteps and the rollout at noise level 0
is WanPipeline's own loop; W = 2 equals exact; the trained LoRA loads with `load_lora_weights`; source images
(image-to-video conditioning) are refused."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from testing_utils import assert_same_images, assert_w2_jagg_equals_exact, family_trainer, noise_image, pipeline_run

from trl_jagg.models import load_adapter
from trl_jagg.models.rollout import sample_trajectories

CFG = {"guidance_scale": 5.0, "true_cfg_scale": 1.0}
PROMPTS = ["a red circle", "a big blue square on the left"]


def backbone_timesteps(pipe) -> list[torch.Tensor]:
    """The `timestep` of each call of the pipeline's transformer, appended as it runs."""
    seen: list[torch.Tensor] = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"].detach().clone()), with_kwargs=True
    )
    return seen


def ti2v_trainer(path, tmp_path, **overrides):
    return family_trainer("wan", path, tmp_path, CFG, **overrides)  # the Wan2.1 settings: 5 frames, negative "dark"


def test_rollout_at_noise_level_0_is_the_pipeline_loop_with_per_token_timesteps(tiny_wan22_ti2v_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_wan22_ti2v_path)
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None and pipe.vae.config.z_dim == 48
    adapter = load_adapter(pipe)
    adapter.num_frames = 5
    seen = backbone_timesteps(pipe)
    expected_latents, expected_videos = pipeline_run(pipe, "wan", PROMPTS, "dark", CFG)
    # 32 px / 16 = 2 x 2 latents, 2 latent frames: one 1x2x2 token per frame. Two calls a step (CFG), 4 steps.
    theirs = seen[::2]
    assert [t.shape for t in seen] == [(2, 2)] * 8
    assert all((t == t[0, 0]).all() for t in theirs)  # text-to-video: every token at the step's timestep
    seen.clear()

    cond = adapter.condition(PROMPTS, height=32, width=32, negative_prompt="dark", max_sequence_length=16)
    noise = adapter.prepare_latents(len(PROMPTS), 32, 32, torch.Generator().manual_seed(0))
    assert noise.shape == (2, 48, 2, 2, 2)
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(
        adapter, cond, noise, sigmas, timesteps, sampler="sde", noise_level=0.0, guidance_scale=5.0,
        true_cfg_scale=1.0,
    )  # fmt: skip
    # One call a step on both branches (4 rows); each branch's rows get the pipeline's tensor. Exact: the same
    # scheduler timesteps copied onto the tokens, no arithmetic between them.
    assert len(seen) == 4
    for ours, pipeline_step in zip(seen, theirs, strict=True):
        assert torch.equal(ours, torch.cat([pipeline_step, pipeline_step]))
    torch.testing.assert_close(trajectory.latents[:, -1], expected_latents, atol=1e-5, rtol=0)
    assert_same_images(adapter.decode(trajectory.latents[:, -1], 32, 32), expected_videos)
    # Rows of different steps in one call (the update batches them): each row's tokens at its own step; 4 x 4
    # latents, 2 frames: 2 x 2 x 2 tokens.
    per_token = adapter.backbone_timestep(torch.tensor([1000.0, 500.0]), torch.zeros(2, 48, 2, 4, 4))
    assert torch.equal(per_token, torch.tensor([[1000.0] * 8, [500.0] * 8]))


def test_ti2v_w2_jagg_gradient_equals_exact(tiny_wan22_ti2v_path, tmp_path):
    """5 steps, 4 trained: for W = 2 the joint backward equals the sum of the per-step gradients."""
    assert_w2_jagg_equals_exact(ti2v_trainer(tiny_wan22_ti2v_path, tmp_path, num_inference_steps=5))


def test_saved_lora_reloads_with_load_lora_weights(tiny_wan22_ti2v_path, tmp_path):
    """The LoRA the trainer saves loads with WanPipeline's `load_lora_weights` and samples what it trained."""
    trainer = ti2v_trainer(tiny_wan22_ti2v_path, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    ours = trainer.sample_images(["a red circle"], seed=0)
    pipe = DiffusionPipeline.from_pretrained(tiny_wan22_ti2v_path)
    pipe.load_lora_weights(trainer.args.output_dir)
    lora_latents, theirs = pipeline_run(pipe, "wan", ["a red circle"], "dark", CFG)
    assert_same_images(ours, theirs)
    base = DiffusionPipeline.from_pretrained(tiny_wan22_ti2v_path)
    base_latents, _ = pipeline_run(base, "wan", ["a red circle"], "dark", CFG)
    assert not torch.allclose(base_latents, lora_latents)  # the LoRA did load and change the samples


def test_image_to_video_conditioning_is_refused(tiny_wan22_ti2v_path, tmp_path):
    """TI2V's first-frame conditioning is not trained: a dataset's source images are refused, not ignored."""
    dataset = Dataset.from_dict({"prompt": PROMPTS, "source_image": [noise_image(0, size=32)] * 2})
    with pytest.raises(ValueError, match="'source_image' column, but WanAdapter trains text-to-video only"):
        ti2v_trainer(tiny_wan22_ti2v_path, tmp_path, dataset=dataset)
