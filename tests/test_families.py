"""What some families do beyond the common contract (tests/test_family_contract.py), on their tiny pipelines: FLUX.1
Kontext edits source images (its own contract: rollout, training, evaluation, LoRA reload and the checks of its
inputs), Wan2.1 makes videos (frame counts, per-frame rewards, frame strips), FLUX.2 dev has no CFG, and the model card's
snippet of an editing and a video model reproduces the trained samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from testing_utils import (
    PROMPTS,
    assert_same_images,
    assert_velocity_cache_equals_recomputation,
    assert_w2_jagg_equals_exact,
    family_trainer,
    noise_image,
    redness,
)

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.models.families import family as family_record
from trl_jagg.models.rollout import generate_images, sample_trajectories

# ---------------------------------------------------------------- editing: FLUX.1 Kontext (rollout side)
EDIT_PROMPTS = ["a red circle", "a big blue square on the left"]


def source_images() -> list:
    return [noise_image(seed, size=32) for seed in range(len(EDIT_PROMPTS))]


@pytest.mark.parametrize(
    "guidance",
    [{"guidance_scale": 3.5, "true_cfg_scale": 1.0}, {"guidance_scale": 3.5, "true_cfg_scale": 2.0}],
    ids=["embedded", "true-cfg"],
)
def test_kontext_rollout_at_noise_level_0_is_the_pipeline_loop(tiny_flux_kontext_path, guidance):
    """The source images' latents join the sequence as extra tokens (frame 1 of the position ids), and only the
    generated tokens are denoised: the pipeline's own loop, called on source images of the output size without its
    resize to Kontext's preferred resolutions."""
    pipe = DiffusionPipeline.from_pretrained(tiny_flux_kontext_path)
    adapter = load_adapter(pipe)
    images = source_images()
    negative = "dark" if guidance["true_cfg_scale"] > 1 else None
    captured = {}

    def keep_latents(pipeline, step, timestep, tensors):
        captured["latents"] = tensors["latents"]
        return {}

    expected_images = pipe(
        image=images, prompt=list(EDIT_PROMPTS), negative_prompt=negative, height=32, width=32, max_area=32 * 32,
        _auto_resize=False, num_inference_steps=4, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        callback_on_step_end=keep_latents, **guidance,
    ).images  # fmt: skip

    cond = adapter.condition(
        EDIT_PROMPTS, height=32, width=32, negative_prompt=negative, max_sequence_length=16, source_images=images
    )
    noise = adapter.prepare_latents(len(EDIT_PROMPTS), 32, 32, torch.Generator().manual_seed(0))
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(
        adapter, cond, noise, sigmas, timesteps, sampler="sde", noise_level=0.0, **guidance
    )
    # The trajectory holds the generated tokens only; the reference tokens are conditioning.
    assert trajectory.latents.shape[2] == cond["reference_latents"].shape[1] == noise.shape[1]
    torch.testing.assert_close(trajectory.latents[:, -1], captured["latents"], atol=1e-5, rtol=0)
    assert_same_images(adapter.decode(trajectory.latents[:, -1], 32, 32), expected_images)
    # The source image is read: other sources give another edit.
    swapped = adapter.condition(
        EDIT_PROMPTS, height=32, width=32, negative_prompt=negative, max_sequence_length=16, source_images=images[::-1]
    )
    other = sample_trajectories(adapter, swapped, noise, sigmas, timesteps, sampler="ode", noise_level=0.0, **guidance)
    assert not torch.allclose(other.latents[:, -1], trajectory.latents[:, -1], atol=1e-3)


def test_source_images_are_required_by_editing_and_refused_by_text_to_image(tiny_flux_kontext_path, tiny_zimage_path):
    kontext = load_adapter(tiny_flux_kontext_path)
    with pytest.raises(ValueError, match="edits images: pass `source_images`"):
        kontext.condition(EDIT_PROMPTS, height=32, width=32, max_sequence_length=16)
    with pytest.raises(ValueError, match="2 prompts: give one per prompt"):
        kontext.condition(EDIT_PROMPTS, height=32, width=32, max_sequence_length=16, source_images=source_images()[:1])
    with pytest.raises(ValueError, match="ZImageAdapter generates from text only"):
        load_adapter(tiny_zimage_path).condition(
            EDIT_PROMPTS, height=32, width=32, max_sequence_length=16, source_images=source_images()
        )


def test_kontext_trains_on_source_images_and_rewards_receive_them(tiny_flux_kontext_path, tmp_path):
    """Two LoRA + JAGG steps of FLUX.1 Kontext through DDPOJaggTrainer on a dataset of prompts and source images:
    every reward call receives each sample's source image (decoded, RGB) by keyword, and the same instruction on
    two different images forms two groups for the per-prompt statistics."""
    images = [noise_image(seed, size=32) for seed in range(2)]
    received = []

    def change(prompts, images, source_images, **kwargs):
        received.append(source_images)
        return [float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean()) for a, b in
                zip(images, source_images, strict=True)]  # fmt: skip

    torch.manual_seed(0)
    config = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=16, per_prompt_stat_tracking=True, report_to="none", save_strategy="no",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["make it red"] * 2, "source_image": images})
    trainer = DDPOJaggTrainer(
        model=tiny_flux_kontext_path, reward_funcs=change, args=config, train_dataset=dataset,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == 2 and all(entry["engine/jagg/groups_jagg"] == 1 for entry in logs)
    assert len(received) == 2
    for sources in received:
        assert len(sources) == 4 and all(s.mode == "RGB" and s.size == (32, 32) for s in sources)
        seen = {np.asarray(s).tobytes() for s in sources}
        assert seen <= {np.asarray(image).tobytes() for image in images}
    assert len(trainer.generation.stat_tracker.history) == 2  # one group per (instruction, source image)


# True CFG: both branches carry the reference tokens, in one backbone call.
KONTEXT = family_record("flux_kontext")
KONTEXT_CFG = dict(KONTEXT.guided) | {"negative_prompt": KONTEXT.negative_prompt}  # its record's: 3.5 embedded, 2 true


def kontext_trainer(path: str, tmp_path, **overrides) -> DDPOJaggTrainer:
    """A LoRA trainer of the tiny Kontext model on two instructions, each with its own source image."""
    dataset = Dataset.from_dict({"prompt": EDIT_PROMPTS, "source_image": source_images()})
    return family_trainer("flux_kontext", path, tmp_path, KONTEXT_CFG, dataset, **overrides)


def test_kontext_w2_jagg_gradient_equals_exact(tiny_flux_kontext_path, tmp_path):
    """Theorem 1's exact limit on the longer [generated, reference] sequence: for W = 2 the joint backward gives
    the sum of the per-step gradients (float rounding only)."""
    assert_w2_jagg_equals_exact(kontext_trainer(tiny_flux_kontext_path, tmp_path, num_inference_steps=5))


def test_kontext_velocity_cache_gives_the_recomputed_gradient(tiny_flux_kontext_path, tmp_path):
    """The cached velocities are the generated tokens' (the reference tokens are cut off the backbone's output), so
    the cache gives the recomputed gradient with one no-grad forward fewer."""
    trainer = kontext_trainer(tiny_flux_kontext_path, tmp_path, num_inference_steps=5, jagg_group_size=4)
    assert_velocity_cache_equals_recomputation(trainer, calls_per_velocity=1)


def kontext_pipeline_edit(path: str, prompts: list[str], sources: list, **settings) -> list:
    """FluxKontextPipeline's own edits (untrained weights, noise seeded 0, no resize to Kontext's resolutions)."""
    return DiffusionPipeline.from_pretrained(path)(
        image=sources, prompt=prompts, height=32, width=32, max_area=32 * 32, _auto_resize=False,
        num_inference_steps=4, guidance_scale=3.5, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        **settings,
    ).images  # fmt: skip


def test_kontext_evaluate_and_sample_images_edit_their_source_images(tiny_flux_kontext_path, tmp_path):
    """evaluate() renders each eval row's edit of its own source image (before training: the pipeline's own edit)
    and scores it with the source by keyword; sample_images() edits `eval_source_images` (paths) by default."""
    sources = source_images()
    paths = [str(tmp_path / f"source{i}.png") for i in range(len(sources))]
    for image, file in zip(sources, paths):
        image.save(file)
    received = []

    def change(prompts, images, source_images, **kwargs):
        received.append((list(images), list(source_images)))
        return [float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).mean()) for a, b in
                zip(images, source_images, strict=True)]  # fmt: skip

    config = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_sequence_length=16, guidance_scale=3.5, per_device_eval_batch_size=2,
        eval_prompts=EDIT_PROMPTS, eval_source_images=paths, image_log_steps=1, report_to="none", disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": EDIT_PROMPTS, "source_image": sources})
    trainer = DDPOJaggTrainer(
        model=tiny_flux_kontext_path, reward_funcs=change, args=config, train_dataset=dataset, eval_dataset=dataset
    )  # full fine-tuning, untrained: the pipeline's weights
    expected = kontext_pipeline_edit(tiny_flux_kontext_path, EDIT_PROMPTS, sources)
    metrics = trainer.evaluate()
    [(images, seen)] = received
    assert_same_images(images, expected)
    assert [np.asarray(s).tobytes() for s in seen] == [np.asarray(s).tobytes() for s in sources]
    assert metrics["eval_reward"] == pytest.approx(float(np.mean(change(EDIT_PROMPTS, images, sources))))
    assert_same_images(trainer.sample_images(), expected)  # eval_prompts with eval_source_images, seed eval_seed
    assert_same_images(trainer.sample_images(EDIT_PROMPTS, seed=0, source_images=sources[::-1]),
                       kontext_pipeline_edit(tiny_flux_kontext_path, EDIT_PROMPTS, sources[::-1]))  # fmt: skip
    with pytest.raises(ValueError, match="edits images: sample_images\\(\\) needs the image each prompt edits"):
        trainer.sample_images(["make it red"])
    with pytest.raises(ValueError, match="eval_dataset has no 'source_image' column"):
        trainer.evaluate(Dataset.from_dict({"prompt": EDIT_PROMPTS}))


def test_sample_images_of_an_editing_model_need_source_images_at_init(
    tiny_flux_kontext_path, tiny_flux_path, tmp_path
):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none")
    edits = Dataset.from_dict({"prompt": ["make it red"], "source_image": source_images()[:1]})
    config = GRPOJaggConfig(**settings, eval_prompts=["make it red"], image_log_steps=1)
    with pytest.raises(ValueError, match="set GRPOJaggConfig.eval_source_images"):
        DDPOJaggTrainer(model=tiny_flux_kontext_path, reward_funcs=redness, args=config, train_dataset=edits)
    config = GRPOJaggConfig(**settings, eval_prompts=["make it red"], eval_source_images=["missing.png"])
    with pytest.raises(ValueError, match="eval_source_images\\[0\\] cannot be read"):
        DDPOJaggTrainer(model=tiny_flux_kontext_path, reward_funcs=redness, args=config, train_dataset=edits)
    with pytest.raises(ValueError, match="FluxAdapter generates from text only"):
        DDPOJaggTrainer(model=tiny_flux_path, reward_funcs=redness, args=config,
                        train_dataset=Dataset.from_dict({"prompt": ["a red circle"]}))  # fmt: skip
    with pytest.raises(ValueError, match="eval_source_images has 2 images for 1 eval_prompts"):
        GRPOJaggConfig(**settings, eval_prompts=["make it red"], eval_source_images=["a.png", "b.png"])


def test_kontext_trainer_checks_the_source_images_at_init(tiny_flux_kontext_path, tmp_path):
    config = GRPOJaggConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                            report_to="none")  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["make it red", "make it blue"], "source_image": ["missing.png"] * 2})
    with pytest.raises(ValueError, match="train_dataset row 0 'source_image' cannot be read"):
        DDPOJaggTrainer(model=tiny_flux_kontext_path, reward_funcs=redness, args=config, train_dataset=dataset)


def test_kontext_lora_reloads_into_the_diffusers_pipeline(tiny_flux_kontext_path, tmp_path):
    """The LoRA trained on source images loads with FluxKontextPipeline's own `load_lora_weights`, and the pipeline
    edits a source image as the trainer's adapter does."""
    source = noise_image(0, size=32)
    config = GRPOJaggConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=1, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=16, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=tiny_flux_kontext_path, reward_funcs=redness, args=config,
        train_dataset=Dataset.from_dict({"prompt": ["make it red"], "source_image": [source]}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], init_lora_weights="gaussian"),
    )  # fmt: skip
    trainer.train()
    trainer.save_model()
    settings = dict(num_steps=4, height=32, width=32, guidance_scale=3.5, max_sequence_length=16)
    ours = generate_images(trainer.adapter, ["make it red"], source_images=[source], seed=0, **settings)

    def pipeline_edit(pipe) -> list:
        return pipe(
            image=[source], prompt=["make it red"], height=32, width=32, max_area=32 * 32, _auto_resize=False,
            num_inference_steps=4, guidance_scale=3.5, max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
        ).images  # fmt: skip

    pipe = DiffusionPipeline.from_pretrained(tiny_flux_kontext_path)
    pipe.load_lora_weights(trainer.args.output_dir)
    assert_same_images(ours, pipeline_edit(pipe))
    base = pipeline_edit(DiffusionPipeline.from_pretrained(tiny_flux_kontext_path))
    assert not np.array_equal(np.asarray(base[0]), np.asarray(ours[0]))  # the LoRA did load and change the edit


# ---------------------------------------------------------------- video: Wan2.1


def test_wan_num_frames_is_checked_and_image_models_refuse_it(tiny_wan_path, tiny_zimage_path, tmp_path):
    from trl_jagg.trainer.inputs import checked_model_inputs

    adapter = load_adapter(tiny_wan_path)
    assert adapter.num_frames == 81  # WanPipeline's default
    with pytest.raises(ValueError, match=r"num_frames=4: .* 4 k \+ 1 frames"):
        adapter.num_frames = 4
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    args = GRPOJaggConfig(output_dir=str(tmp_path), num_frames=9, per_device_train_batch_size=2, num_generations=2)
    checked_model_inputs(adapter, args, dataset, None)
    assert adapter.num_frames == 9
    noise = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0))
    assert noise.shape == (2, 16, 3, 4, 4)  # 9 frames: 3 latent frames
    with pytest.raises(ValueError, match="num_frames is 9, but ZImagePipeline makes images"):
        checked_model_inputs(load_adapter(tiny_zimage_path), args, dataset, None)
    with pytest.raises(ValueError, match="GRPOJaggConfig.num_frames is 0"):
        GRPOJaggConfig(output_dir=str(tmp_path), num_frames=0)


def test_wan_rollout_scores_videos_and_logs_frame_strips(tiny_wan_path, tmp_path):
    """The rollout's samples are videos of `num_frames` frames, scored per frame by an image reward (the mean of
    its frames' scores, recomputed here frame by frame), and the completions are logged as frame strips."""
    trainer = family_trainer("wan", tiny_wan_path, tmp_path, dict(family_record("wan").guided), log_completions=True)
    rollout = trainer._generate_and_score(next(iter(trainer.get_train_dataloader())))
    assert rollout.latents.shape == (4, 5, 16, 2, 4, 4)  # (batch, steps + 1, channels, latent frames, h, w)
    prompts, videos, scores = trainer.generation.completions
    assert [len(video) for video in videos] == [5] * 4 and videos[0][0].size == (32, 32)
    by_frame = [np.mean([redness([p], [frame])[0] for frame in video]) for p, video in zip(prompts, videos)]
    np.testing.assert_allclose(scores["redness"], by_frame, rtol=1e-5)
    from trl_jagg.trainer.image_logging import frame_strip

    strip = frame_strip(videos[0])
    assert strip.size == (5 * 32, 32)
    assert np.array_equal(np.asarray(strip)[:, 32:64], np.asarray(videos[0][1]))  # frames left to right


# ---------------------------------------------------------------- FLUX.2 dev: embedded guidance only


def test_flux2_dev_refuses_true_cfg_at_init(tiny_flux2_dev_path, tmp_path):
    """Flux2Pipeline has no negative prompt nor CFG: a true CFG scale is an error naming the field, before training."""
    with pytest.raises(ValueError, match="true_cfg_scale=2.0: Flux2Pipeline has no negative prompt"):
        family_trainer("flux2_dev", tiny_flux2_dev_path, tmp_path, {"guidance_scale": 4.0, "true_cfg_scale": 2.0})


@pytest.mark.parametrize("family", ["flux_kontext", "wan"])
def test_card_snippet_of_an_editing_and_a_video_model_reproduces_the_trained_samples(request, family, tmp_path):
    """The card's snippet for an editing model passes the image to edit (at the output size, as training encodes
    it) and tags the card image-to-image; for a video model it reads `.frames[0]` with the training's `num_frames`
    and writes an MP4."""
    import re

    import yaml

    path = request.getfixturevalue(f"tiny_{family}_path")
    if family == "flux_kontext":
        trainer = kontext_trainer(path, tmp_path, max_steps=1)
    else:
        trainer = family_trainer(family, path, tmp_path, dict(family_record(family).guided), max_steps=1)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    card = (out / "README.md").read_text()
    tag = {"flux_kontext": "image-to-image", "wan": "text-to-video"}[family]
    assert yaml.safe_load(card.split("---")[1])["pipeline_tag"] == tag
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    source = source_images()[0]
    source.save(tmp_path / "source.png")
    code = snippet.replace("path/to/the/local/base/pipeline", path).replace('"out"', f'"{out}"')
    code = code.replace('.to("cuda")', "").replace("path/to/the/image/to/edit.png", str(tmp_path / "source.png"))
    code = re.sub(r'prompt="[^"]*",', 'prompt="a red circle", generator=torch.Generator().manual_seed(3),', code)
    # export_to_video needs imageio or OpenCV, which the test environment does not install: the frames are compared.
    assert ("export_to_video(video," in code) == (family == "wan")
    code = "\n".join(line for line in code.splitlines() if not line.startswith("export_to_video("))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    if family == "wan":
        frames = np.round(np.asarray(namespace["video"]) * 255)  # (frames, H, W, 3) in [0, 1]: numpy output
        expected = trainer.sample_images(["a red circle"], seed=3)[0]
        assert frames.shape[0] == len(expected) == 5
        diff = np.abs(frames - np.stack([np.asarray(f, dtype=np.float64) for f in expected]))
    else:
        expected = trainer.sample_images(["a red circle"], seed=3, source_images=[source])[0]
        diff = np.abs(np.asarray(namespace["image"], dtype=np.int16) - np.asarray(expected, dtype=np.int16))
    assert diff.max() <= 1  # uint8 rounding only
