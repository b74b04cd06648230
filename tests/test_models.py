"""The registry and the shared classifier-free guidance on tiny SD3, Qwen-Image and Flux pipelines (offline): which
adapter serves which pipeline class, Qwen-Image's text mask, SD3's guidance errors, both CFG branches in one backbone
call, and which branch the gradient flows through. What every family must do is tests/test_family_contract.py."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline, StableDiffusion3Pipeline
from testing_utils import PROMPTS

from trl_jagg.models import MODEL_ADAPTERS, QwenImageAdapter, SD3Adapter, adapter_class, load_adapter
from trl_jagg.models.families import family

NEGATIVE = "dark"
# Each family's guided setting (its record's): SD3's CFG scale is guidance_scale, Qwen-Image's true_cfg_scale, and
# Flux runs true CFG on top of its embedded guidance.
GUIDED = {name: dict(family(name).guided) for name in ("sd3", "qwenimage", "flux")}


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
    g = GUIDED["sd3"]["guidance_scale"]
    guided = sd3_cfg_grads(adapter, cond, latents, timestep, weight, **GUIDED["sd3"])
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


@pytest.mark.parametrize("name", ["sd3", "qwenimage", "flux"])
def test_conditional_only_cfg_gradient_treats_the_unconditional_prediction_as_a_constant(request, name):
    """uncond_grad=False: the gradient equals that of the guided loss with the unconditional prediction computed
    apart as a constant (Flow-GRPO's July 2025 `noise_pred_uncond.detach()`), and the backbone's graph (forward
    with grad, gradient arriving at its output) covers only the B conditional samples; with both branches, 2B."""
    adapter = load_adapter(request.getfixturevalue(f"tiny_{name}_path"))
    transformer = adapter.transformer.requires_grad_(True)
    params = list(transformer.parameters())
    guidance = GUIDED[name]
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
    guidance = GUIDED[name]
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
