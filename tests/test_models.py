"""SD3 / SD3.5 and Qwen-Image adapters on tiny pipelines built from config (offline): the shared sampling loop
reproduces each diffusers pipeline, two LoRA + JAGG training steps run end to end, W = 2 JAGG equals the exact
gradient, and the gradient flows through the unconditional CFG branch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline, FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline
from peft import LoraConfig
from testing_utils import PROMPTS, assert_two_lora_jagg_steps, assert_w2_jagg_equals_exact, redness

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import MODEL_ADAPTERS, QwenImageAdapter, SD3Adapter, adapter_class, load_adapter
from trl_jagg.models.rollout import sample_trajectories

NEGATIVE = "dark"
# Each family with classifier-free guidance on: SD3's scale is guidance_scale, Qwen-Image's true_cfg_scale.
CFG = {
    "sd3": {"guidance_scale": 4.5, "true_cfg_scale": 1.0},
    "qwenimage": {"guidance_scale": 1.0, "true_cfg_scale": 4.0},
}


@pytest.fixture(params=["sd3", "qwenimage"])
def family(request) -> str:
    """Each new family, with its saved tiny pipeline built on first use."""
    request.getfixturevalue(f"tiny_{request.param}_path")
    return request.param


def tiny_path(request, family: str) -> str:
    return request.getfixturevalue(f"tiny_{family}_path")


def reference_run(pipe: DiffusionPipeline, prompts: list[str], negative: str | None, **guidance) -> tuple:
    """The pipeline's own sampling: final latents (captured after the last step) and PIL images."""
    captured = {}

    def keep_latents(pipeline, step, timestep, tensors):
        captured["latents"] = tensors["latents"]
        return {}

    if isinstance(pipe, QwenImagePipeline):
        kwargs = {"true_cfg_scale": guidance["true_cfg_scale"]}
        kwargs["negative_prompt"] = [negative] * len(prompts) if negative is not None else None
    elif isinstance(pipe, FluxPipeline):
        kwargs = {**guidance, "negative_prompt": negative}
    else:
        kwargs = {"guidance_scale": guidance["guidance_scale"], "negative_prompt": negative}
    images = pipe(
        prompts, height=32, width=32, num_inference_steps=4, max_sequence_length=16,
        generator=torch.Generator().manual_seed(0), callback_on_step_end=keep_latents, **kwargs,
    ).images  # fmt: skip
    return captured["latents"], images


@pytest.mark.parametrize(
    ("pipeline_class", "guidance", "prompts"),
    [
        (StableDiffusion3Pipeline, CFG["sd3"], ["a red circle", "a blue square"]),
        (StableDiffusion3Pipeline, {"guidance_scale": 1.0, "true_cfg_scale": 1.0}, ["a red circle", "a blue square"]),
        # Prompts of different lengths: the text mask is a tensor (padding), else None.
        (QwenImagePipeline, CFG["qwenimage"], ["a red circle", "a big blue square on the left"]),
        (QwenImagePipeline, CFG["qwenimage"], ["a red circle", "a blue square"]),
        (QwenImagePipeline, {"guidance_scale": 1.0, "true_cfg_scale": 1.0}, ["a red circle", "a blue square"]),
        # Flux's true CFG (two calls in the pipeline, one batched call here) on top of its embedded guidance.
        (FluxPipeline, {"guidance_scale": 3.5, "true_cfg_scale": 4.0}, ["a red circle", "a blue square"]),
    ],
    ids=["sd3-cfg", "sd3-nocfg", "qwen-cfg-mask", "qwen-cfg-nomask", "qwen-nocfg", "flux-true-cfg"],
)
def test_sampling_loop_reproduces_pipeline(request, pipeline_class, guidance, prompts):
    family = {StableDiffusion3Pipeline: "sd3", QwenImagePipeline: "qwenimage", FluxPipeline: "flux"}[pipeline_class]
    path = request.getfixturevalue(f"tiny_{family}_path")
    pipe = pipeline_class.from_pretrained(path)
    adapter = load_adapter(pipe)
    cfg = adapter.needs_negative_prompt(**guidance)
    expected_latents, expected_images = reference_run(pipe, prompts, NEGATIVE if cfg else None, **guidance)

    cond = adapter.condition(
        prompts, height=32, width=32, negative_prompt=NEGATIVE if cfg else None, max_sequence_length=16
    )
    assert ("negative_prompt_embeds" in cond) == cfg
    noise = adapter.prepare_latents(len(prompts), 32, 32, torch.Generator().manual_seed(0))
    sigmas, timesteps = adapter.schedule(4, 32, 32)
    trajectory = sample_trajectories(
        adapter, cond, noise, sigmas, timesteps, sampler="sde", noise_level=0.0, **guidance
    )
    torch.testing.assert_close(trajectory.latents[:, -1], expected_latents, atol=1e-5, rtol=0)
    images = adapter.decode(trajectory.latents[:, -1], 32, 32)
    for ours, theirs in zip(images, expected_images):
        diff = np.abs(np.asarray(ours, dtype=np.int16) - np.asarray(theirs, dtype=np.int16))
        assert diff.max() <= 1  # uint8 rounding only


def test_qwenimage_mask_follows_padding(tiny_qwenimage_path):
    adapter = load_adapter(QwenImagePipeline.from_pretrained(tiny_qwenimage_path))
    padded = adapter.condition(["a red circle", "a big blue square on the left"], height=32, width=32)
    unpadded = adapter.condition(["a red circle", "a blue square"], height=32, width=32)
    assert padded["prompt_embeds_mask"].shape == padded["prompt_embeds"].shape[:2]
    assert unpadded.get("prompt_embeds_mask") is None
    # Per-sample entries (the mask included) are indexed by `select`, as the trainer's micro-batches are.
    sub = padded.select(torch.tensor([1, 1, 0]))
    torch.testing.assert_close(sub["prompt_embeds_mask"][2], padded["prompt_embeds_mask"][0])


def sd3_cfg_grads(adapter, cond, latents, timestep, weight, **guidance) -> list[torch.Tensor]:
    params = list(adapter.transformer.parameters())
    velocity = adapter.predict_velocity(adapter.transformer, latents, timestep, cond, **guidance)
    return list(torch.autograd.grad((velocity * weight).sum(), params, allow_unused=True))


def test_sd3_cfg_gradient_is_the_guided_combination_of_both_branches(tiny_sd3_path):
    """d<v_cfg, w>/dθ = g·d<v_c, w>/dθ + (1-g)·d<v_u, w>/dθ: a detached unconditional branch would lose the
    (1-g) term (here -3.5 times the unconditional gradient)."""
    adapter = load_adapter(StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path))
    adapter.transformer.requires_grad_(True)
    cond = adapter.condition(["a red circle"], height=32, width=32, negative_prompt=NEGATIVE, max_sequence_length=16)
    uncond = type(cond)(
        {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"],
        }
    )
    generator = torch.Generator().manual_seed(1)
    latents = adapter.prepare_latents(1, 32, 32, generator)
    weight = torch.randn(latents.shape, generator=generator)
    timestep = adapter.schedule(4, 32, 32)[1][1].expand(1)
    g = CFG["sd3"]["guidance_scale"]
    guided = sd3_cfg_grads(adapter, cond, latents, timestep, weight, **CFG["sd3"])
    no_cfg = {"guidance_scale": 1.0, "true_cfg_scale": 1.0}
    conditional = sd3_cfg_grads(adapter, cond, latents, timestep, weight, **no_cfg)
    unconditional = sd3_cfg_grads(adapter, uncond, latents, timestep, weight, **no_cfg)
    checked = 0
    for a, c, u in zip(guided, conditional, unconditional):
        if a is None:
            continue
        torch.testing.assert_close(a, g * c + (1 - g) * u, atol=1e-5, rtol=1e-4)
        checked += int(u.abs().max() > 0)
    assert checked > 10


def test_gradient_reaches_negative_prompt_inputs(request, family):
    """The negative prompt's embeddings feed only the unconditional branch: they get a gradient iff that branch is
    differentiable."""
    adapter = load_adapter(tiny_path(request, family))
    guidance = CFG[family]
    cond = adapter.condition(PROMPTS[:2], height=32, width=32, negative_prompt=NEGATIVE, max_sequence_length=16)
    negative = cond.per_sample["negative_prompt_embeds"].clone().requires_grad_(True)
    cond.per_sample["negative_prompt_embeds"] = negative
    latents = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0))
    timestep = adapter.schedule(4, 32, 32)[1][0].expand(2)
    velocity = adapter.predict_velocity(adapter.transformer, latents, timestep, cond, **guidance)
    velocity.square().sum().backward()
    assert negative.grad is not None and negative.grad.abs().max() > 0


# ---------------------------------------------------------------- training


def make_trainer(path: str, tmp_path, guidance: dict, **overrides) -> DDPOJaggTrainer:
    torch.manual_seed(0)
    config = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2, num_inference_steps=4,
        height=32, width=32, max_steps=2, learning_rate=1e-2, epsilon=1e-1, noise_level=0.9, jagg_group_size=3,
        jagg_frac=1.0, max_sequence_length=16, negative_prompt=NEGATIVE, report_to="none", save_strategy="no",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    config |= guidance | overrides
    return DDPOJaggTrainer(
        model=path,
        reward_funcs=redness,
        args=GRPOJaggConfig(**config),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "add_q_proj"], init_lora_weights="gaussian"
        ),
    )


def test_two_training_steps_lora_jagg_cfg(request, family, tmp_path):
    trainer = make_trainer(tiny_path(request, family), tmp_path, CFG[family])
    assert trainer.adapter.needs_negative_prompt(trainer.args.guidance_scale, trainer.args.true_cfg_scale)
    assert_two_lora_jagg_steps(trainer)


def test_w2_jagg_gradient_equals_exact(request, family, tmp_path):
    """Theorem 1's exact limit on a real adapter with CFG: for W = 2 the joint backward through the two endpoints
    gives the sum of the per-step gradients."""
    trainer = make_trainer(tiny_path(request, family), tmp_path, CFG[family], num_inference_steps=5, max_steps=1)
    assert_w2_jagg_equals_exact(trainer)


def test_saved_lora_reloads_into_the_diffusers_pipeline(request, family, tmp_path):
    """The LoRA the trainer saves loads with the pipeline's own `load_lora_weights` and samples what it trained."""
    path = tiny_path(request, family)
    trainer = make_trainer(path, tmp_path, CFG[family], max_steps=1)
    trainer.train()
    trainer.save_model()
    ours = trainer.sample_images(["a red circle"], seed=0)[0]
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.load_lora_weights(trainer.args.output_dir)
    lora_latents, (theirs,) = reference_run(pipe, ["a red circle"], NEGATIVE, **CFG[family])
    diff = np.abs(np.asarray(ours, dtype=np.int16) - np.asarray(theirs, dtype=np.int16))
    assert diff.max() <= 1  # uint8 rounding only
    base_latents, _ = reference_run(DiffusionPipeline.from_pretrained(path), ["a red circle"], NEGATIVE, **CFG[family])
    assert not torch.allclose(base_latents, lora_latents)  # the LoRA did load and change the samples


# ---------------------------------------------------------------- registry
def test_registry_serves_sd3_and_qwenimage():
    assert adapter_class("StableDiffusion3Pipeline") is SD3Adapter
    assert adapter_class("QwenImagePipeline") is QwenImageAdapter
    assert SD3Adapter.pipeline_class is StableDiffusion3Pipeline  # SD3.5 checkpoints use the same class


def test_unsupported_class_lists_supported(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(ValueError, match="Unsupported pipeline class 'StableDiffusionXLPipeline'") as info:
        load_adapter(str(tmp_path))
    for name in MODEL_ADAPTERS:
        assert name in str(info.value)
    assert {"FluxPipeline", "StableDiffusion3Pipeline", "QwenImagePipeline"} <= set(MODEL_ADAPTERS)


def test_adapter_rejects_other_pipeline_class(tiny_qwenimage_path):
    with pytest.raises(TypeError, match="SD3Adapter serves StableDiffusion3Pipeline, got QwenImagePipeline"):
        SD3Adapter(QwenImagePipeline.from_pretrained(tiny_qwenimage_path))


def test_sd3_guidance_errors_name_the_fix(tiny_sd3_path):
    adapter = load_adapter(tiny_sd3_path)
    with pytest.raises(ValueError, match="true_cfg_scale.*guidance_scale"):
        adapter.needs_negative_prompt(guidance_scale=4.5, true_cfg_scale=2.0)
    cond = adapter.condition(["a red circle"], height=32, width=32, max_sequence_length=16)
    latents = adapter.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="negative_prompt"):
        adapter.predict_velocity(
            adapter.transformer, latents, torch.tensor([1000.0]), cond, guidance_scale=4.5, true_cfg_scale=1.0
        )


# ---------------------------------------------------------------- which CFG branch gets the gradient
# Flux has true CFG too (true_cfg_scale with embedded guidance); SD3 batches both branches in one call.
CFG_ALL = {**CFG, "flux": {"guidance_scale": 3.5, "true_cfg_scale": 4.0}}


@pytest.mark.parametrize("name", ["sd3", "qwenimage", "flux"])
def test_conditional_only_cfg_gradient_treats_the_unconditional_prediction_as_a_constant(request, name):
    """uncond_grad=False: the gradient equals that of the guided loss with the unconditional prediction computed
    apart as a constant (Flow-GRPO's July 2025 `noise_pred_uncond.detach()`), and the backbone's graph (forward
    with grad, gradient arriving at its output) covers only the B conditional samples; with both branches, 2B."""
    adapter = load_adapter(request.getfixturevalue(f"tiny_{name}_path"))
    transformer = adapter.transformer.requires_grad_(True)
    params = list(transformer.parameters())
    guidance = CFG_ALL[name]
    cond = adapter.condition(PROMPTS[:2], height=32, width=32, negative_prompt=NEGATIVE, max_sequence_length=16)
    generator = torch.Generator().manual_seed(2)
    latents = adapter.prepare_latents(2, 32, 32, generator)
    weight = torch.randn(latents.shape, generator=generator)
    timestep = adapter.schedule(4, 32, 32)[1][1].expand(2)

    # The guided velocity written out: one branch per call, the unconditional one under no_grad.
    single = {"guidance_scale": 1.0 if adapter.guidance_is_cfg else guidance["guidance_scale"], "true_cfg_scale": 1.0}
    negative = type(cond)(
        {k.removeprefix("negative_"): v for k, v in cond.per_sample.items() if k.startswith("negative_")}, cond.shared
    )
    with torch.no_grad():
        v_u = adapter.predict_velocity(transformer, latents, timestep, negative, **single)
    v_c = adapter.predict_velocity(transformer, latents, timestep, cond, **single)
    w = adapter.cfg_scale(**guidance)
    guided = v_u + w * (v_c - v_u)
    if name == "qwenimage":  # Qwen-Image rescales per token to the conditional prediction's norm
        guided = guided * (v_c.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
    expected = torch.autograd.grad((guided * weight).sum(), params, allow_unused=True)

    def run(uncond_grad: bool) -> tuple[list, list[int], list[int]]:
        forward, backward = [], []

        def before(module, args, kwargs):
            if torch.is_grad_enabled():
                forward.append(kwargs["hidden_states"].shape[0])

        def after(module, args, kwargs, output):
            if output[0].requires_grad:
                output[0].register_hook(lambda grad: backward.append(grad.shape[0]))

        hooks = [
            transformer.register_forward_pre_hook(before, with_kwargs=True),
            transformer.register_forward_hook(after, with_kwargs=True),
        ]
        velocity = adapter.predict_velocity(transformer, latents, timestep, cond, **guidance, uncond_grad=uncond_grad)
        grads = torch.autograd.grad((velocity * weight).sum(), params, allow_unused=True)
        for hook in hooks:
            hook.remove()
        return list(grads), forward, backward

    grads, forward, backward = run(uncond_grad=False)
    checked = 0
    for got, want in zip(grads, expected):
        if want is None:
            assert got is None or got.abs().max() == 0
            continue
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        checked += int(want.abs().max() > 0)
    assert checked > 10
    assert forward == [2] and backward == [2]
    both, forward, backward = run(uncond_grad=True)
    assert sum(forward) == 4 and sum(backward) == 4
    assert any(g is not None and e is not None and not torch.allclose(g, e, atol=1e-5) for g, e in zip(both, expected))


@pytest.mark.parametrize("name", ["sd3", "qwenimage", "flux"])
@pytest.mark.parametrize("grad", [False, True], ids=["rollout", "update"])
def test_cfg_branches_run_as_one_backbone_call(request, name, grad):
    """Both CFG branches in one backbone call on 2B rows (rollout, and update with both branches differentiable),
    equal to the guided combination of one call per branch written out here, each branch within 1e-6. Qwen-Image's negative
    prompt is shorter than the prompts, one of which is padded: the batched text is padded and masked."""
    adapter = load_adapter(request.getfixturevalue(f"tiny_{name}_path"))
    transformer = adapter.transformer.requires_grad_(grad)
    guidance = CFG_ALL[name]
    prompts = ["a red circle", "a big blue square on the left"]
    cond = adapter.condition(prompts, height=32, width=32, negative_prompt=NEGATIVE, max_sequence_length=16)
    generator = torch.Generator().manual_seed(3)
    latents = adapter.prepare_latents(2, 32, 32, generator)
    timestep = adapter.schedule(4, 32, 32)[1][1].expand(2)
    single = {"guidance_scale": 1.0 if adapter.guidance_is_cfg else guidance["guidance_scale"], "true_cfg_scale": 1.0}
    negative = type(cond)(
        {k.removeprefix("negative_"): v for k, v in cond.per_sample.items() if k.startswith("negative_")}, cond.shared
    )
    with torch.no_grad():
        v_u = adapter.predict_velocity(transformer, latents, timestep, negative, **single)
        v_c = adapter.predict_velocity(transformer, latents, timestep, cond, **single)
    w = adapter.cfg_scale(**guidance)
    expected = v_u + w * (v_c - v_u)
    if name == "qwenimage":
        expected = expected * (v_c.norm(dim=-1, keepdim=True) / expected.norm(dim=-1, keepdim=True))

    rows = []
    hook = transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    with torch.set_grad_enabled(grad):
        velocity = adapter.predict_velocity(transformer, latents, timestep, cond, **guidance)
    hook.remove()
    assert rows == [4]
    assert velocity.requires_grad == grad
    # Each branch within 1e-6 of its own call (batch rounding); v_u + w (v_c - v_u) scales that by up to 2w - 1.
    torch.testing.assert_close(velocity.detach(), expected, atol=(2 * w - 1) * 1e-6, rtol=0)


def test_trainer_passes_cfg_gradient_to_the_update(request, family, tmp_path):
    """cfg_gradient='conditional': every forward of the update that builds a graph runs on the micro-batch of 4 only
    (the unconditional branch runs without one); rollouts build no graph at all."""
    trainer = make_trainer(tiny_path(request, family), tmp_path, CFG[family], max_steps=1, cfg_gradient="conditional")
    graph = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            graph.append(kwargs["hidden_states"].shape[0]) if torch.is_grad_enabled() else None
        ),
        with_kwargs=True,
    )
    trainer.train()
    hook.remove()
    assert graph == [4, 4]  # one JAGG group of W = 3: the two endpoint forwards, conditional half only
