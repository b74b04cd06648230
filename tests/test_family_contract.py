"""The family contract: the same tests for every model family whose record names this file (`COMMON`), as diffusers'
`PipelineTesterMixin` gives every pipeline the same tests. On each family's tiny pipeline: the rollout at noise level
0 is the pipeline's own loop, prompts encoded one at a time collate to the batch encoding, the negative prompt gets a
gradient through the unconditional branch, two LoRA + JAGG steps train end to end, W = 2 JAGG equals the exact
gradient, the velocity cache gives the recomputed gradient with fewer forwards, the trained LoRA loads back with the
pipeline's `load_lora_weights` and samples what the trainer sampled, and `cfg_gradient="conditional"` builds graphs
on the conditional half only.

A family added with its record (trl_jagg/models/families.py) runs here without another line; families whose contract
differs (source images, two experts) name their own test file in the record, and
`test_every_adapter_has_a_record_and_every_record_a_contract` checks that none is left out."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from testing_utils import (
    PROMPTS,
    assert_same_images,
    assert_two_lora_jagg_steps,
    assert_velocity_cache_equals_recomputation,
    assert_w2_jagg_equals_exact,
    family_trainer,
    frames_of,
    pipeline_run,
    prompt_length,
    tiny_path,
)

import trl_jagg.models
from trl_jagg.models import MODEL_ADAPTERS, FlowMatchingAdapter, load_adapter
from trl_jagg.models.families import COMMON, FAMILIES
from trl_jagg.models.rollout import sample_trajectories

CONTRACT = [record for record in FAMILIES if record.contract == COMMON]
"""The families this file tests."""
WITH_CFG = [record for record in CONTRACT if record.negative_prompt is not None]
"""Those with an unconditional branch (FLUX.2 dev's guidance is embedded only)."""
PROMPT_PAIR = ["a red circle", "a big blue square on the left"]
"""Prompts of different lengths: variable-length families pad them into a batch with a mask."""


def ids(record) -> str:
    return record.name


@pytest.fixture(params=CONTRACT, ids=ids)
def family(request):
    """Each family of the contract: its record."""
    return request.param


# ---------------------------------------------------------------- the records
def test_every_adapter_has_a_record_and_every_record_a_contract():
    """Every adapter class of trl_jagg.models is served by a family record (and so registered), every record's
    adapter serves its pipeline class and its tiny builder exists, and every family is tested: here, or in the test
    file its record names, which uses its tiny pipeline."""
    adapters = set()
    for module in pkgutil.iter_modules(trl_jagg.models.__path__):
        for _, cls in inspect.getmembers(importlib.import_module(f"trl_jagg.models.{module.name}"), inspect.isclass):
            if issubclass(cls, FlowMatchingAdapter) and "pipeline_class" in vars(cls):
                adapters.add(cls)
    records = {record.adapter_class() for record in FAMILIES}
    assert adapters == records, "an adapter without a record in trl_jagg/models/families.py"
    assert MODEL_ADAPTERS == {record.pipeline: record.adapter_class() for record in FAMILIES}
    names = [record.name for record in FAMILIES]
    assert len(set(names)) == len(names)
    hub_ids = [hub_id for record in FAMILIES for hub_id in record.hub_ids]
    assert len(set(hub_ids)) == len(hub_ids)
    root = Path(__file__).resolve().parents[1]
    for record in FAMILIES:
        assert record.adapter_class().pipeline_class.__name__ == record.pipeline, record.name
        assert callable(record.tiny_pipeline_builder()), record.name
        assert record.hub_ids and record.words, record.name
        if record.contract == COMMON:
            assert record in CONTRACT
        else:  # a contract of its own: that file runs the family's tiny pipeline
            assert f"tiny_{record.name}_path" in (root / record.contract).read_text(), record.name


# ---------------------------------------------------------------- sampling
def rollout_cases() -> list:
    """Each family with guidance on and off; a masked family's guided setting also on prompts of one length (no
    padding: its mask is None)."""
    cases = [
        pytest.param(record, setting, PROMPT_PAIR, id=f"{record.name}-{setting}")
        for record in CONTRACT
        for setting in ("guided", "unguided")
    ]
    cases += [
        pytest.param(record, "guided", ["a red circle", "a blue square"], id=f"{record.name}-guided-same-length")
        for record in CONTRACT
        if record.adapter_class().prompt_mask_dtype is not None
    ]
    return cases


@pytest.mark.parametrize(("record", "setting", "prompts"), rollout_cases())
def test_rollout_at_noise_level_0_is_the_pipeline_loop(request, record, setting, prompts):
    pipe = DiffusionPipeline.from_pretrained(tiny_path(request, record))
    assert type(pipe).__name__ == record.pipeline
    adapter = load_adapter(pipe)
    if adapter.makes_videos:
        adapter.num_frames = frames_of(record.name)["num_frames"]
    guidance = dict(getattr(record, setting))
    negative = record.negative_prompt if adapter.needs_negative_prompt(**guidance) else None
    assert (negative is not None) == (setting == "guided" and record.negative_prompt is not None)
    expected_latents, expected_images = pipeline_run(pipe, record.name, prompts, negative, guidance)

    cond = adapter.condition(
        prompts, height=32, width=32, negative_prompt=negative, max_sequence_length=prompt_length(record.name)
    )
    assert ("negative_prompt_embeds" in cond) == (negative is not None)
    noise = adapter.prepare_latents(len(prompts), 32, 32, torch.Generator().manual_seed(0))
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(
        adapter, cond, noise, sigmas, timesteps, sampler="sde", noise_level=0.0, **guidance
    )
    torch.testing.assert_close(trajectory.latents[:, -1], expected_latents, atol=1e-5, rtol=0)
    assert_same_images(adapter.decode(trajectory.latents[:, -1], 32, 32), expected_images)


def test_precomputed_encodings_collate_to_the_batch_encoding(request, family):
    """Prompts encoded one at a time and collated give what encoding them together gives (the trainer's
    `precompute_prompt_embeds` table)."""
    adapter = load_adapter(tiny_path(request, family))
    length = prompt_length(family.name)
    together = adapter.encode_prompts(PROMPT_PAIR, length)
    collated = adapter.collate([adapter.encode_prompts([p], length) for p in PROMPT_PAIR])
    assert collated.keys() == {k for k, v in together.items() if v is not None}
    for key, value in collated.items():
        torch.testing.assert_close(value, together[key], atol=1e-6, rtol=0)


@pytest.mark.parametrize("record", WITH_CFG, ids=ids)
def test_gradient_reaches_negative_prompt_inputs(request, record):
    """The negative prompt's embeddings feed only the unconditional branch: they get a gradient iff that branch is
    differentiable."""
    adapter = load_adapter(tiny_path(request, record))
    if adapter.makes_videos:
        adapter.num_frames = frames_of(record.name)["num_frames"]
    cond = adapter.condition(
        PROMPTS[:2], height=32, width=32, negative_prompt=record.negative_prompt,
        max_sequence_length=prompt_length(record.name),
    )  # fmt: skip
    negative = cond.per_sample["negative_prompt_embeds"].clone().requires_grad_(True)
    cond.per_sample["negative_prompt_embeds"] = negative
    latents = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0))
    timestep = adapter.schedule(4, 32, 32)[1][0].expand(2)
    velocity = adapter.predict_velocity(adapter.transformer, latents, timestep, cond, **record.guided)
    velocity.square().sum().backward()
    assert negative.grad is not None and negative.grad.abs().max() > 0


# ---------------------------------------------------------------- training
def test_two_training_steps_lora_jagg_cfg(request, family, tmp_path):
    trainer = family_trainer(family.name, tiny_path(request, family), tmp_path, dict(family.guided))
    has_cfg = family.negative_prompt is not None  # FLUX.2 dev: embedded guidance, one branch
    assert trainer.adapter.needs_negative_prompt(trainer.args.guidance_scale, trainer.args.true_cfg_scale) == has_cfg
    assert_two_lora_jagg_steps(trainer)


def test_w2_jagg_gradient_equals_exact(request, family, tmp_path):
    """Theorem 1's exact limit with guidance: for W = 2 the joint backward through the two endpoints gives the sum
    of the per-step gradients (float rounding only)."""
    trainer = family_trainer(
        family.name, tiny_path(request, family), tmp_path, dict(family.guided), num_inference_steps=5
    )
    assert_w2_jagg_equals_exact(trainer)


def test_velocity_cache_gives_the_recomputed_gradient_with_fewer_forwards(request, family, tmp_path):
    """One JAGG group of W = 4 (5 steps, 4 trained): the cached rollout velocities replace the no-grad forward of
    the two intermediate steps; the gradient is the one recomputing them, and both make two graph forwards (the
    endpoints) and one backward. Every family batches both guidance branches in one backbone call."""
    trainer = family_trainer(
        family.name, tiny_path(request, family), tmp_path, dict(family.guided), num_inference_steps=5,
        jagg_group_size=4,
    )  # fmt: skip
    assert_velocity_cache_equals_recomputation(trainer, calls_per_velocity=1)


def test_saved_lora_reloads_into_the_diffusers_pipeline(request, family, tmp_path):
    """The LoRA the trainer saves loads with the pipeline's own `load_lora_weights` and samples what it trained."""
    path, guidance = tiny_path(request, family), dict(family.guided)
    trainer = family_trainer(family.name, path, tmp_path, guidance, max_steps=1)
    trainer.train()
    trainer.save_model()
    assert os.path.isfile(os.path.join(trainer.args.output_dir, "pytorch_lora_weights.safetensors"))
    ours = trainer.sample_images(["a red circle"], seed=0)
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.load_lora_weights(trainer.args.output_dir)
    negative = family.negative_prompt
    lora_latents, theirs = pipeline_run(pipe, family.name, ["a red circle"], negative, guidance)
    assert_same_images(ours, theirs)
    base_latents, _ = pipeline_run(
        DiffusionPipeline.from_pretrained(path), family.name, ["a red circle"], negative, guidance
    )
    assert not torch.allclose(base_latents, lora_latents)  # the LoRA did load and change the samples


def backbone_rows(kwargs: dict) -> int:
    """The rows of one backbone call: its latent input's batch (Z-Image's backbone takes a list of latents, `x`)."""
    latents = kwargs["hidden_states"] if "hidden_states" in kwargs else kwargs["x"]
    return len(latents) if isinstance(latents, list) else latents.shape[0]


@pytest.mark.parametrize("record", WITH_CFG, ids=ids)
def test_trainer_passes_cfg_gradient_to_the_update(request, record, tmp_path):
    """cfg_gradient='conditional': every forward of the update that builds a graph runs on the micro-batch of 4 only
    (the unconditional branch runs without one); rollouts build no graph at all."""
    trainer = family_trainer(
        record.name, tiny_path(request, record), tmp_path, dict(record.guided), max_steps=1,
        cfg_gradient="conditional",
    )  # fmt: skip
    graph = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: graph.append(backbone_rows(kwargs)) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    trainer.train()
    hook.remove()
    assert graph == [4, 4]  # one JAGG group of W = 3: the two endpoint forwards, conditional half only
