"""The embedded CPU demo: the shipped pipeline, the pretraining data generator and a short `run_demo`.

The demo's real claim (the reward rises, measured in the closing note of issue 5) needs ~100 steps; here a 2-step
run checks that every output is written and well-formed, without asserting a rise.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image

from trl_jagg.demo.run import (
    DEMO_ASSET_DIR,
    DEMO_COLORS,
    DEMO_GUIDANCE_SCALE,
    DEMO_IMAGE_SIZE,
    DEMO_MAX_SEQUENCE_LENGTH,
    DEMO_SHAPES,
    GroupRewardStd,
    color_accuracy,
    demo_prompts,
    run_demo,
    shape_area,
)


@pytest.fixture(scope="module")
def pretrain():
    """The pretraining script as a module (importing it trains nothing)."""
    return importlib.import_module("trl_jagg.demo.pretrain")


# ---------------------------------------------------------------- the shipped pipeline
def test_shipped_pipeline_loads_offline_and_is_small():
    from diffusers import AutoencoderKL, FluxPipeline, FluxTransformer2DModel

    pipe = FluxPipeline.from_pretrained(DEMO_ASSET_DIR, local_files_only=True)
    assert isinstance(pipe.transformer, FluxTransformer2DModel) and isinstance(pipe.vae, AutoencoderKL)
    assert pipe.vae.config.latent_channels == 16 and pipe.vae_scale_factor == 8  # as FLUX.1's VAE
    assert pipe.transformer.config.in_channels == 64  # 16 channels packed 2x2
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(DEMO_ASSET_DIR) for f in files)
    assert total < 2_000_000, f"the demo assets weigh {total} bytes"

    image = pipe(
        "a red circle", height=DEMO_IMAGE_SIZE, width=DEMO_IMAGE_SIZE, num_inference_steps=4,
        guidance_scale=DEMO_GUIDANCE_SCALE, max_sequence_length=DEMO_MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip
    assert image.size == (DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE)
    pixels = np.asarray(image, dtype=np.float32) / 255
    assert pixels.max() > 0.5, "the pretrained model should draw a bright shape"


def test_colour_words_are_single_tokens_with_distinct_embeddings():
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(DEMO_ASSET_DIR, local_files_only=True)
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        for word in (*DEMO_COLORS, *DEMO_SHAPES):
            assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, (type(tokenizer).__name__, word)
    prompts = [f"a {color} circle" for color in DEMO_COLORS]
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompts, prompt_2=None, max_sequence_length=DEMO_MAX_SEQUENCE_LENGTH)
    for i in range(3):
        for j in range(i + 1, 3):
            assert (embeds[i] - embeds[j]).abs().max() > 0.1
            assert (pooled[i] - pooled[j]).abs().max() > 0.1


def test_pretrain_info_records_the_recipe():
    with open(os.path.join(DEMO_ASSET_DIR, "pretrain_info.json")) as f:
        info = json.load(f)
    assert info["script"] == "python -m trl_jagg.demo.pretrain"
    assert info["arguments"]["seed"] == 0
    evaluation = info["evaluation"]
    assert evaluation["shape_accuracy"] > 0.8  # draws the shape it is asked for
    assert 0.15 < evaluation["color_match_rate"] < 0.5  # ... in a random colour (chance 1/3)


# ---------------------------------------------------------------- the pretraining data
def test_generator_draws_the_labelled_shape_and_colour(pretrain):
    images, shapes, colors = pretrain.generate_shapes(36, seed=0)
    assert images.shape == (36, DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE, 3) and images.dtype == np.uint8
    pairs = list(zip(shapes, colors))
    assert all(pairs.count((s, c)) == 4 for s in DEMO_SHAPES for c in DEMO_COLORS)  # balanced
    background = np.array(pretrain.BACKGROUND)
    for image, color in zip(images, colors):
        assert (image[0, 0] == background).all() and (image[-1, -1] == background).all()  # dark corners
        shape_pixels = image[np.abs(image.astype(int) - background).max(axis=-1) > 60]
        assert len(shape_pixels) > 100
        channel = DEMO_COLORS.index(color)
        assert (shape_pixels.argmax(axis=-1) == channel).all(), color
        assert (image[16, 16] == np.array(pretrain.PALETTE[color])).all()  # the centre is fully inside
    again, _, _ = pretrain.generate_shapes(36, seed=0)
    assert (again == images).all()
    other, _, _ = pretrain.generate_shapes(36, seed=1)
    assert not (other == images).all()


def test_generator_shapes_differ_where_they_should(pretrain):
    masks = {}
    for shape in DEMO_SHAPES:
        image = pretrain.draw_shape(shape, "red", center=(16.0, 16.0), half_size=12.0)
        masks[shape] = image[..., 0] > 128
    # A square's top corners are filled, a circle's and a triangle's are not; a triangle is narrow at the top.
    top = 16 - int(0.85 * 12) + 1
    assert masks["square"][top, 16 - 9] and masks["square"][top, 16 + 8]
    assert not masks["circle"][top, 16 - 9] and not masks["triangle"][top, 16 - 9]
    assert masks["circle"][16, 16 - 11] and not masks["triangle"][6, 16 - 6]
    assert masks["triangle"].sum() < masks["square"].sum() < masks["circle"].sum() * 1.1
    with pytest.raises(ValueError, match="shape"):
        pretrain.draw_shape("star", "red")
    with pytest.raises(ValueError, match="colour"):
        pretrain.draw_shape("circle", "yellow")


def test_captions_name_the_shape_never_the_colour(pretrain):
    rng = random.Random(0)
    for _ in range(300):
        shape = rng.choice(DEMO_SHAPES)
        words = pretrain.make_caption(shape, rng).split()
        assert shape in words
        assert not set(words) & set(DEMO_COLORS)
    assert set(DEMO_COLORS) <= set(pretrain.demo_vocabulary())


# ---------------------------------------------------------------- diagnostics
def test_diagnostic_rewards():
    red = Image.new("RGB", (32, 32), (24, 24, 24))
    red.paste((225, 45, 45), (8, 8, 24, 24))  # a 16x16 red square: a quarter of the image
    blue = Image.new("RGB", (32, 32), (24, 24, 24))
    blue.paste((45, 45, 225), (8, 8, 24, 24))
    prompts = ["a red square", "a red square", "a blue square", "a blue square"]
    images = [red, blue, blue, blue]
    assert color_accuracy(prompts, images) == [1.0, 0.0, 1.0, 1.0]
    assert shape_area(prompts, images) == [0.25] * 4
    stds = GroupRewardStd(2)(prompts, images)
    assert stds[0] == stds[1] > 0.1 and stds[2] == stds[3] == 0.0
    assert len(demo_prompts()) == 9 and "a red circle" in demo_prompts()


# ---------------------------------------------------------------- run_demo end to end (short)
@pytest.mark.slow
def test_run_demo_writes_every_output(tmp_path):
    out = tmp_path / "demo"
    summary = run_demo(output_dir=str(out), compare=True, steps=2, seed=0, timing_repeats=1)
    for name in ("metrics.jsonl", "metrics_exact.jsonl", "reward_curve.png", "before_after.png", "summary.json"):
        assert (out / name).is_file(), name
    for name in ("lora", "lora_exact"):
        assert (out / name / "pytorch_lora_weights.safetensors").is_file(), name

    for name in ("metrics.jsonl", "metrics_exact.jsonl"):
        entries = [json.loads(line) for line in (out / name).read_text().splitlines()]
        steps = [e for e in entries if "reward" in e]
        assert [e["step"] for e in steps] == [1, 2]
        for entry in steps:
            for key in ("reward", "loss", "grad_norm", "kl", "engine/latents/final_std", "rewards/color_accuracy/mean",
                        "rewards/group_reward_std/mean", "rewards/shape_area/mean", "time/update_s"):  # fmt: skip
                assert math.isfinite(entry[key]), (name, key)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert summary["steps"] == 2 and summary["exact"]["steps"] == 2
    assert summary["backward_calls_per_step"] == 1 and summary["exact"]["backward_calls_per_step"] == 4
    for key in (
        "reward_first",
        "reward_last",
        "reward_rise",
        "reward_rise_mean2",
    ):
        assert math.isfinite(summary[key]) and math.isfinite(summary["exact"][key]), key
    speedup = summary["update_speedup_vs_exact"]
    assert speedup["repeats"] == 1 and speedup["min"] <= speedup["median"] <= speedup["max"]
    assert speedup["update_exact_s"] > 0 and speedup["update_jagg_s"] > 0
    # JAGG and exact start from the same weights and the same seed: the first rollout is the same.
    assert summary["reward_first"] == summary["exact"]["reward_first"]

    with Image.open(out / "before_after.png") as grid:
        assert grid.width > 9 * DEMO_IMAGE_SIZE and grid.height > 6 * DEMO_IMAGE_SIZE  # 9 prompts x 6 rows
    with Image.open(out / "reward_curve.png") as curve:
        assert curve.width > 500

    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(DEMO_ASSET_DIR, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora"))  # the saved LoRA is in the diffusers format
