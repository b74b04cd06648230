"""Qwen-Image-Edit and Qwen-Image-Edit-Plus on tiny pipelines built from config: the rollout at noise level 0 is the
pipeline's own loop (prompts encoded by Qwen2.5-VL with the source images, reference latents after the generated
tokens), the trained LoRA loads back with the pipeline's `load_lora_weights` and edits as the trainer did, W = 2
JAGG equals the exact gradient, the velocity cache gives the recomputed gradient, and two LoRA + JAGG steps train
through `DDPOJaggTrainer` on a dataset of prompts and source images (several per row for Edit-Plus)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from peft import LoraConfig
from testing_utils import (
    assert_two_lora_jagg_steps,
    assert_velocity_cache_equals_recomputation,
    assert_w2_jagg_equals_exact,
    noise_image,
    redness,
)

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import QwenImageEditAdapter, QwenImageEditPlusAdapter, load_adapter
from trl_jagg.models.rollout import generate_images, sample_trajectories
from trl_jagg.trainer.data import EpochSeededRepeatSampler
from trl_jagg.utils.prompts import check_source_images

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


def adapter_latents(adapter, prompts, sources, negative, *, sampler="sde", noise=None, **guidance) -> torch.Tensor:
    cond = adapter.condition(prompts, height=32, width=32, negative_prompt=negative, source_images=sources)
    if noise is None:
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


def mixed_plus_dataset() -> Dataset:
    """Edit-Plus rows of one and of two source images (a square and a 2:1 one), interleaved, prompts of different
    lengths."""
    wide = [noise_image(seed, 48).crop((0, 0, 48, 24)) for seed in (7, 8)]
    column = [[noise_image(0, 32)], [noise_image(1, 32), wide[0]], [noise_image(2, 32)], [noise_image(3, 32), wide[1]]]
    prompts = ["make it red", "put the second picture left of the first", "a cat on it, in the rain", "swap them"]
    return Dataset.from_dict({"prompt": prompts, "source_image": column})


def test_edit_plus_rows_of_each_bucket_roll_out_as_the_pipeline_edits_each(tiny_qwenimage_edit_plus_path, small_area):
    """The trainer's sampler on a dataset mixing rows of one and two source images: each rollout of two prompts
    holds rows of one count, and each row of the batch is the pipeline's own loop on that row alone (its
    `__call__` takes one prompt), from the same initial noise."""
    pipe = DiffusionPipeline.from_pretrained(tiny_qwenimage_edit_plus_path)
    adapter = load_adapter(pipe)
    adapter.source_image_area = AREA
    dataset = mixed_plus_dataset()
    buckets = check_source_images(dataset, "train_dataset", adapter.max_source_images, adapter.reference_sizes)
    order = list(EpochSeededRepeatSampler(dataset, 1, batch_size=2, shuffle=False, buckets=buckets))
    assert order == [0, 2, 1, 3]  # each bucket's rows together, emitted once two of them are drawn
    for rows in (order[:2], order[2:]):
        prompts, sources = dataset[rows]["prompt"], dataset[rows]["source_image"]
        assert len({len(images) for images in sources}) == 1
        noise = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0))
        ours = adapter_latents(adapter, prompts, sources, "dark", noise=noise, **CFG)
        for i in range(2):
            expected = pipeline_latents(pipe, [prompts[i]], sources[i], ["dark"], latents=noise[i : i + 1],
                                        true_cfg_scale=CFG["true_cfg_scale"])  # fmt: skip
            torch.testing.assert_close(ours[i : i + 1], expected, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- training

PLUS = "plus"  # the family parameter of the training tests: Edit (one source image per row) or Edit-Plus (two)


@pytest.fixture(params=["edit", PLUS])
def variant(request) -> str:
    return request.param


def edit_path(request, variant: str) -> str:
    return request.getfixturevalue("tiny_qwenimage_edit_plus_path" if variant == PLUS else "tiny_qwenimage_edit_path")


def edit_dataset(variant: str, rows: int = 2) -> Dataset:
    """Instructions and source images: one per row (Edit), two per row (Edit-Plus)."""
    sources = [noise_image(seed, 32) for seed in range(rows)]
    column = [[image, noise_image(9, 32)] for image in sources] if variant == PLUS else sources
    return Dataset.from_dict({"prompt": ["make it red"] * rows, "source_image": column})


def make_trainer(path: str, variant: str, tmp_path, reward=redness, dataset=None, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    config = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, negative_prompt="dark", source_image_area=AREA, report_to="none", save_strategy="no",
        seed=0, disable_tqdm=True, **CFG,
    )  # fmt: skip
    return DDPOJaggTrainer(
        model=path, reward_funcs=reward, args=GRPOJaggConfig(**config | overrides),
        train_dataset=dataset if dataset is not None else edit_dataset(variant),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip


def test_two_training_steps_and_rewards_receive_the_source_images(request, variant, tmp_path):
    """Two LoRA + JAGG steps (W = 3) with true CFG; every reward call receives each sample's source image(s).
    Edit-Plus trains on rows of one and of two images, interleaved: each rollout (2 prompts x G = 2) draws rows of
    one count, one bucket and then the other (unshuffled: each bucket's rows in dataset order, emitted once full)."""
    received = []

    def change(prompts, images, source_images, **kwargs):
        received.append(source_images)
        return redness(prompts, images)

    dataset = mixed_plus_dataset() if variant == PLUS else edit_dataset(variant)
    trainer = make_trainer(edit_path(request, variant), variant, tmp_path, reward=change, dataset=dataset,
                           shuffle_dataset=False, offload_frozen_modules=True)  # fmt: skip
    assert trainer.adapter.source_image_area == AREA
    # Offloaded frozen modules visit the accelerator while they run: conditioning runs the VAE too (source images).
    visits, on_accelerator = [], trainer.frozen.on_accelerator
    trainer.frozen.on_accelerator = lambda modules: visits.append(list(modules)) or on_accelerator(modules)
    assert_two_lora_jagg_steps(trainer)
    vae, text_encoder = trainer.adapter.pipeline.vae, trainer.adapter.pipeline.text_encoder
    assert any(any(m is vae for m in v) and any(m is text_encoder for m in v) for v in visits)
    steps = [[0, 0, 2, 2], [1, 1, 3, 3]] if variant == PLUS else [[0, 0, 1, 1]] * 2  # rows, each G = 2 times

    def pixels(sample) -> list[bytes]:
        images = sample if variant == PLUS else [sample]
        assert all(image.mode == "RGB" for image in images)
        return [image.tobytes() for image in images]

    assert [[pixels(sample) for sample in sources] for sources in received] == [
        [pixels(dataset[row]["source_image"]) for row in rows] for rows in steps
    ]
    if variant == PLUS:
        assert [{len(sample) for sample in sources} for sources in received] == [{1}, {2}]


def test_edit_plus_evaluates_rows_of_different_image_counts(tiny_qwenimage_edit_plus_path, tmp_path, small_area):
    """evaluate() renders the rows of one image count together (rows 0 and 2, then 1 and 3: batches of 2, a seed
    from each batch's first row) and scores them in row order; each image is the pipeline's own edit of its row
    (untrained full fine-tuning: the pipeline's weights) from that batch's noise."""
    received = []

    def change(prompts, images, source_images, **kwargs):
        received.append(([len(sample) for sample in source_images], list(images)))
        return redness(prompts, images)

    dataset = mixed_plus_dataset()
    config = GRPOJaggConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4, height=32,
        width=32, per_device_eval_batch_size=2, eval_seed=5, negative_prompt="dark", source_image_area=AREA,
        use_jagg=False, report_to="none", disable_tqdm=True, **CFG,
    )  # fmt: skip
    trainer = DDPOJaggTrainer(tiny_qwenimage_edit_plus_path, change, config, train_dataset=dataset)
    trainer.evaluate(dataset)
    [(counts, images)] = received
    assert counts == [1, 2, 1, 2]
    pipe = DiffusionPipeline.from_pretrained(tiny_qwenimage_edit_plus_path)
    expected = [None] * 4
    for rows in ([0, 2], [1, 3]):
        noise = trainer.adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(5 + rows[0]))
        for i, row in enumerate(rows):
            expected[row] = pipe(
                image=dataset[row]["source_image"], prompt=[dataset[row]["prompt"]], negative_prompt=["dark"],
                height=32, width=32, num_inference_steps=4, true_cfg_scale=CFG["true_cfg_scale"],
                latents=noise[i : i + 1],
            ).images[0]  # fmt: skip
    for ours, theirs in zip(images, expected, strict=True):
        assert np.abs(np.asarray(ours, np.int16) - np.asarray(theirs, np.int16)).max() <= 1  # uint8 rounding only


def test_edit_w2_jagg_gradient_equals_exact(request, variant, tmp_path):
    assert_w2_jagg_equals_exact(make_trainer(edit_path(request, variant), variant, tmp_path, num_inference_steps=5))


def test_velocity_cache_gives_the_recomputed_gradient(request, variant, tmp_path):
    trainer = make_trainer(edit_path(request, variant), variant, tmp_path, num_inference_steps=5, jagg_group_size=4)
    assert_velocity_cache_equals_recomputation(trainer, 1)  # both CFG branches in one backbone call


def test_lora_reloads_into_the_pipeline_and_edits_as_the_trainer(request, variant, tmp_path, small_area):
    """The LoRA loads with the pipeline's own `load_lora_weights`, and the pipeline edits the source images as the
    trainer's adapter does (ODE sampling, the same seed)."""
    path = edit_path(request, variant)
    trainer = make_trainer(path, variant, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    sources = edit_dataset(variant, rows=1)["source_image"][0]
    settings = dict(num_steps=4, height=32, width=32, guidance_scale=1.0, true_cfg_scale=CFG["true_cfg_scale"])
    ours = generate_images(trainer.adapter, ["make it red"], source_images=[sources], negative_prompt="dark",
                           seed=0, **settings)  # fmt: skip

    def pipeline_edit(pipe) -> np.ndarray:
        return pipe(
            image=sources, prompt=["make it red"], negative_prompt=["dark"], height=32, width=32,
            num_inference_steps=4, true_cfg_scale=CFG["true_cfg_scale"], generator=torch.Generator().manual_seed(0),
        ).images[0]  # fmt: skip

    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.load_lora_weights(trainer.args.output_dir)
    theirs = pipeline_edit(pipe)
    assert np.abs(np.asarray(ours[0], np.int16) - np.asarray(theirs, np.int16)).max() <= 1  # uint8 rounding only
    base = pipeline_edit(DiffusionPipeline.from_pretrained(path))
    assert not np.array_equal(np.asarray(base), np.asarray(theirs))  # the LoRA did load and change the edit


def test_source_images_are_checked_at_init(request, tiny_qwenimage_edit_path, tiny_qwenimage_edit_plus_path, tmp_path):
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none")

    def trainer(path, column, **overrides):
        dataset = Dataset.from_dict(
            {"prompt": ["make it red", "make it blue", "a cat"][: len(column)], "source_image": column}
        )
        return DDPOJaggTrainer(model=path, reward_funcs=redness, args=GRPOJaggConfig(**config | overrides),
                               train_dataset=dataset)  # fmt: skip

    square, wide = noise_image(0, 32), noise_image(1, 48).crop((0, 0, 48, 24))
    with pytest.raises(ValueError, match=r"train_dataset row 1 'source_image' holds 2 images; this model edits one"):
        trainer(tiny_qwenimage_edit_path, [[square], [square, square]])
    square.save(tmp_path / "square.png")
    path = str(tmp_path / "square.png")
    with pytest.raises(ValueError, match=r"row 1 'source_image'\[1\] cannot be read"):
        trainer(tiny_qwenimage_edit_plus_path, [[path, path], [path, "missing.png"]])
    # A rollout's 2 prompts come from one bucket of equal grids: a bucket of one row could never be drawn.
    with pytest.raises(ValueError, match=r"row 2 \(1 of 3\) resize 'source_image' to \(\(64, 32\),\).*its 2 prompts"):
        trainer(
            tiny_qwenimage_edit_path, [square, square, wide], source_image_area=AREA, per_device_train_batch_size=4
        )
    # A side that resizes to 0 (a 20:1 image at 2048 px) would fail in PIL at the first rollout: refused here.
    thin = noise_image(2, 160).crop((0, 0, 160, 8))
    for path in (tiny_qwenimage_edit_path, tiny_qwenimage_edit_plus_path):
        with pytest.raises(ValueError, match=r"row 1 'source_image'.*a 160x8 source image resizes to 192x0 at 2048 "
                           r"pixels .*raise source_image_area"):  # fmt: skip
            trainer(path, [square, thin], source_image_area=AREA)
    with pytest.raises(ValueError, match="precompute_prompt_embeds cannot be used"):
        trainer(tiny_qwenimage_edit_path, [square, square], precompute_prompt_embeds=True)
    with pytest.raises(ValueError, match="FluxKontextAdapter does not resize source images by area"):
        trainer(request.getfixturevalue("tiny_flux_kontext_path"), [square, square], source_image_area=AREA)
