"""Tests of the tiny offline pipelines, and the manual sampling recipe that reproduces each pipeline's latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    Flux2KleinPipeline,
    Flux2Pipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    WanPipeline,
    ZImagePipeline,
)
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import ProcessorMixin

from trl_jagg.testing.tiny_models import (
    DEFAULT_VOCAB_WORDS,
    FAMILIES,
    build_clip_tokenizer,
    build_qwen2_tokenizer,
    build_t5_tokenizer,
    build_tiny_pipeline,
)
from trl_jagg.testing.tokenizers import build_mistral3_processor

PIPELINE_CLASSES = {
    "flux": FluxPipeline,
    "sd3": StableDiffusion3Pipeline,
    "qwenimage": QwenImagePipeline,
    "zimage": ZImagePipeline,
    "flux2_klein": Flux2KleinPipeline,
    "flux2_dev": Flux2Pipeline,
    "flux_kontext": FluxKontextPipeline,
    "qwenimage_edit": QwenImageEditPipeline,
    "qwenimage_edit_plus": QwenImageEditPlusPipeline,
    "wan": WanPipeline,
    "wan22": WanPipeline,  # two experts
    "wan22_ti2v": WanPipeline,  # per-token timesteps
}
# The families whose pipelines also sample from text alone; the Qwen-Image-Edit pipelines need a source image, and
# tests/test_qwen_edit.py checks their calls.
TEXT_FAMILIES = tuple(family for family in FAMILIES if not family.startswith("qwenimage_edit"))
PROMPTS = ["a red circle", "a small blue square on a dark background"]  # different lengths on purpose
EXTRA_WORDS = ["crimson", "teal", "hexagon", "Zebra"]


def _call_kwargs(family: str) -> dict:
    """Keyword arguments that switch guidance on the way each family is used: Flux's distilled guidance, SD3's
    CFG, Qwen-Image's true CFG (which needs a negative prompt), Z-Image's and FLUX.2 klein's CFG, FLUX.2 dev's
    embedded guidance (its system message takes 31 tokens: 48 leave room for the prompt)."""
    return {
        "flux": {"guidance_scale": 3.5},
        "sd3": {"guidance_scale": 4.5},
        "qwenimage": {"true_cfg_scale": 4.0, "negative_prompt": " "},
        "zimage": {"guidance_scale": 3.0},
        "flux2_klein": {"guidance_scale": 4.0},  # the negative prompt is always ""
        "flux2_dev": {"guidance_scale": 4.0, "max_sequence_length": 48},
        "flux_kontext": {"guidance_scale": 3.5},  # without a source image: FLUX.1's text-to-image
        "wan": {"guidance_scale": 4.5, "num_frames": 5},  # 5 frames: 2 latent frames
        "wan22": {"guidance_scale": 4.0, "guidance_scale_2": 3.0, "num_frames": 5},  # Flow-Factory's two scales
        "wan22_ti2v": {"guidance_scale": 5.0, "num_frames": 5},
    }[family]


def _size_kwargs(family: str, size: int) -> dict:
    """The output size; FluxKontextPipeline also rescales it to ``max_area`` (1024^2 by default)."""
    return {"height": size, "width": size, **({"max_area": size * size} if family == "flux_kontext" else {})}


def _tokenizers(pipe: DiffusionPipeline) -> list:
    """The pipeline's tokenizers (a processor's, for FLUX.2 dev's PixtralProcessor)."""
    components = [
        pipe.components[name] for name in ("tokenizer", "tokenizer_2", "tokenizer_3") if name in pipe.components
    ]
    return [c.tokenizer if isinstance(c, ProcessorMixin) else c for c in components]


def _state_dicts(pipe: DiffusionPipeline) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: module.state_dict() for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)
    }


def _reloaded(request: pytest.FixtureRequest) -> tuple[str, str, DiffusionPipeline]:
    path = request.getfixturevalue(f"tiny_{request.param}_path")
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return request.param, path, pipe


@pytest.fixture(scope="module", params=TEXT_FAMILIES)
def saved(request: pytest.FixtureRequest) -> tuple[str, str, DiffusionPipeline]:
    """``(family, path, pipeline reloaded with DiffusionPipeline.from_pretrained)`` for each text-to-image family."""
    return _reloaded(request)


@pytest.fixture(scope="module", params=FAMILIES)
def saved_any(request: pytest.FixtureRequest) -> tuple[str, str, DiffusionPipeline]:
    """As ``saved``, for every family (the editing ones too)."""
    return _reloaded(request)


# --------------------------------------------------------------------------------------------------------------------
# Building, saving, reloading
# --------------------------------------------------------------------------------------------------------------------


def test_reload_has_identical_weights(saved_any):
    family, path, loaded = saved_any
    assert type(loaded) is PIPELINE_CLASSES[family]
    via_class = PIPELINE_CLASSES[family].from_pretrained(path)
    built = build_tiny_pipeline(family, seed=0)  # building is deterministic, so this is what was saved
    expected = _state_dicts(built)
    for other in (loaded, via_class):
        actual = _state_dicts(other)
        assert actual.keys() == expected.keys()
        for name, state in expected.items():
            assert actual[name].keys() == state.keys(), name
            for key, tensor in state.items():
                # Integer buffers (a batch norm's counter) keep their dtype.
                assert actual[name][key].dtype == (torch.float32 if tensor.is_floating_point() else tensor.dtype)
                assert torch.equal(actual[name][key], tensor), (name, key)
            assert not other.components[name].training, name
    for name, component in built.components.items():
        assert type(loaded.components[name]) is type(component), name


def test_build_is_deterministic_and_leaves_global_rng_alone():
    rng_state = torch.get_rng_state()
    first, second = build_tiny_pipeline("flux", seed=0), build_tiny_pipeline("flux", seed=0)
    other_seed = build_tiny_pipeline("flux", seed=1)
    assert torch.equal(torch.get_rng_state(), rng_state)
    a, b, c = _state_dicts(first), _state_dicts(second), _state_dicts(other_seed)
    for name in a:
        assert all(torch.equal(a[name][key], b[name][key]) for key in a[name]), name
        assert not all(torch.equal(a[name][key], c[name][key]) for key in a[name]), name


@pytest.mark.parametrize("size", [32, 64])
def test_pipeline_call_is_finite_sized_and_deterministic(saved, size):
    family, _, pipe = saved

    def generate() -> np.ndarray:
        output = pipe(
            prompt=PROMPTS[0],  # by name: Flux2KleinPipeline's first argument is the reference image
            **_size_kwargs(family, size),
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
            **_call_kwargs(family),
        )
        return output.frames if family.startswith("wan") else output.images

    images = generate()
    assert images.shape == ((1, 5, size, size, 3) if family.startswith("wan") else (1, size, size, 3))
    assert np.isfinite(images).all()
    np.testing.assert_array_equal(images, generate())


def test_default_vocabulary_survives_save_and_reload(saved_any):
    family, _, pipe = saved_any
    for tokenizer in _tokenizers(pipe):
        for word in DEFAULT_VOCAB_WORDS:
            assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, (family, type(tokenizer), word)
    if family.startswith("qwenimage"):
        # The Qwen-Image pipelines drop the hidden states of the template prefix by count: it must be exactly 34
        # tokens (64 for the editing template, whose prefix ends before the image placeholder).
        prefix = pipe.prompt_template_encode.split("{}")[0].split("<|vision_start|>")[0]
        expected = 34 if family == "qwenimage" else 64
        assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == expected


# --------------------------------------------------------------------------------------------------------------------
# Vocabulary
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_vocab_words_are_single_tokens_with_own_embeddings(family):
    pipe = build_tiny_pipeline(family, vocab_words=EXTRA_WORDS)
    encoders = [
        pipe.components[name]
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
        if name in pipe.components
    ]
    for tokenizer, encoder in zip(_tokenizers(pipe), encoders, strict=True):
        assert encoder.get_input_embeddings().num_embeddings == len(tokenizer)
        for word in EXTRA_WORDS:
            # Qwen's byte-level BPE attaches the preceding space to a word; CLIP lower-cases.
            texts = [word, " " + word] if family.startswith(("qwenimage", "zimage", "flux2")) else [word]
            for text in texts:
                ids = tokenizer(text, add_special_tokens=False).input_ids
                assert len(ids) == 1, (type(tokenizer).__name__, text, tokenizer.convert_ids_to_tokens(ids))
            in_prompt = tokenizer(f"a {word} circle", add_special_tokens=False).input_ids
            assert len(in_prompt) == 3, (type(tokenizer).__name__, word)
    distinct_ids = {_tokenizers(pipe)[0](word, add_special_tokens=False).input_ids[0] for word in EXTRA_WORDS}
    assert len(distinct_ids) == len(EXTRA_WORDS)


def test_tokenizers_still_encode_unknown_text():
    text = "an unseen word: xylophone 42!"
    tokenizers = (
        build_clip_tokenizer(),
        build_t5_tokenizer(),
        build_qwen2_tokenizer(),
        build_mistral3_processor().tokenizer,
    )
    for tokenizer in tokenizers:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) > 5
        assert tokenizer.unk_token_id not in ids  # byte-level BPE covers every byte; T5 has every ASCII character


def test_invalid_arguments():
    with pytest.raises(ValueError, match="Unknown family"):
        build_tiny_pipeline("sdxl")
    with pytest.raises(ValueError, match="letters only"):
        build_clip_tokenizer(["red-ish"])
    with pytest.raises(TypeError):
        build_t5_tokenizer("red")
    with pytest.raises(ValueError, match="axes_dims_rope"):
        build_tiny_pipeline("flux", transformer={"axes_dims_rope": (4, 4, 4)})
    with pytest.raises(ValueError, match="d_model"):
        build_tiny_pipeline("sd3", text_encoder_3={"d_model": 48})
    with pytest.raises(TypeError, match="hiden_size"):  # transformers configs would silently keep the typo
        build_tiny_pipeline("flux", text_encoder={"hiden_size": 64})


# --------------------------------------------------------------------------------------------------------------------
# Manual sampling: the loop the model adapters implement, checked against the pipelines' own latents
# --------------------------------------------------------------------------------------------------------------------


def _euler(pipe: DiffusionPipeline, step: int, latents: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """``FlowMatchEulerDiscreteScheduler.step`` without its internal step counter."""
    sigmas = pipe.scheduler.sigmas
    return latents + (sigmas[step + 1] - sigmas[step]) * velocity


def _dynamic_shift(pipe: DiffusionPipeline, image_seq_len: int) -> float:
    config = pipe.scheduler.config
    return calculate_shift(
        image_seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift
    )


@torch.no_grad()
def _flux_by_hand(pipe: FluxPipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch = len(PROMPTS)
    prompt_embeds, pooled_embeds, text_ids = pipe.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=512)
    args = (
        batch, pipe.transformer.config.in_channels // 4, height, width, prompt_embeds.dtype, torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )  # fmt: skip
    if isinstance(pipe, FluxKontextPipeline):  # its source image comes first; without one, the noise alone
        latents, _, image_ids, _ = pipe.prepare_latents(None, *args)
    else:
        latents, image_ids = pipe.prepare_latents(*args)
    # Unshifted sigmas linspace(1, 1/N, N); the scheduler applies the dynamic shift mu of the packed sequence length.
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=_dynamic_shift(pipe, latents.shape[1]))
    guidance = torch.full((batch,), _call_kwargs("flux")["guidance_scale"], dtype=torch.float32)
    for step, t in enumerate(pipe.scheduler.timesteps):
        velocity = pipe.transformer(
            hidden_states=latents,
            timestep=t.expand(batch).to(latents.dtype) / 1000,  # the transformer multiplies by 1000 again
            guidance=guidance,  # as is (3.5): also multiplied by 1000 inside
            pooled_projections=pooled_embeds,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        latents = _euler(pipe, step, latents, velocity)
    return latents


@torch.no_grad()
def _sd3_by_hand(pipe: StableDiffusion3Pipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch = len(PROMPTS)
    scale = _call_kwargs("sd3")["guidance_scale"]
    prompt_embeds, negative_embeds, pooled_embeds, negative_pooled = pipe.encode_prompt(
        PROMPTS, prompt_2=None, prompt_3=None, do_classifier_free_guidance=True, max_sequence_length=256
    )  # negative_prompt=None encodes "" for every prompt
    latents = pipe.prepare_latents(
        batch,
        pipe.transformer.config.in_channels,
        height,
        width,
        prompt_embeds.dtype,
        torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )
    # Static shift: no sigmas, no mu (the scheduler spaces timesteps between its own shifted sigma_max/sigma_min).
    pipe.scheduler.set_timesteps(steps)
    encoder_states = torch.cat([negative_embeds, prompt_embeds])  # unconditional half first
    pooled = torch.cat([negative_pooled, pooled_embeds])
    for step, t in enumerate(pipe.scheduler.timesteps):
        velocity = pipe.transformer(
            hidden_states=torch.cat([latents, latents]),
            timestep=t.expand(2 * batch),  # in [0, 1000]: SD3 takes the timestep unscaled
            encoder_hidden_states=encoder_states,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        uncond, cond = velocity.chunk(2)
        latents = _euler(pipe, step, latents, uncond + scale * (cond - uncond))
    return latents


@torch.no_grad()
def _qwenimage_by_hand(pipe: QwenImagePipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch = len(PROMPTS)
    kwargs = _call_kwargs("qwenimage")
    prompt_embeds, prompt_mask = pipe.encode_prompt(PROMPTS, max_sequence_length=512)
    negative_embeds, negative_mask = pipe.encode_prompt([kwargs["negative_prompt"]] * batch, max_sequence_length=512)
    latents = pipe.prepare_latents(
        batch,
        pipe.transformer.config.in_channels // 4,
        height,
        width,
        prompt_embeds.dtype,
        torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )
    packed_height, packed_width = height // pipe.vae_scale_factor // 2, width // pipe.vae_scale_factor // 2
    img_shapes = [[(1, packed_height, packed_width)]] * batch
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=_dynamic_shift(pipe, latents.shape[1]))
    for step, t in enumerate(pipe.scheduler.timesteps):
        timestep = t.expand(batch).to(latents.dtype) / 1000
        cond, uncond = (
            pipe.transformer(
                hidden_states=latents,
                timestep=timestep,
                guidance=None,
                encoder_hidden_states=embeds,
                encoder_hidden_states_mask=mask,  # None when no prompt in the batch is padded
                img_shapes=img_shapes,
                return_dict=False,
            )[0]
            for embeds, mask in ((prompt_embeds, prompt_mask), (negative_embeds, negative_mask))
        )
        combined = uncond + kwargs["true_cfg_scale"] * (cond - uncond)
        # Rescale each token's guided velocity to the conditional velocity's norm.
        velocity = combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        latents = _euler(pipe, step, latents, velocity)
    return latents


@torch.no_grad()
def _zimage_by_hand(pipe: ZImagePipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch, scale = len(PROMPTS), _call_kwargs("zimage")["guidance_scale"]
    # One (tokens, dim) embedding per prompt, its padding dropped; the negative prompt defaults to "".
    prompt_embeds, negative_embeds = pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=True)
    latents = pipe.prepare_latents(
        batch, pipe.transformer.config.in_channels, height, width, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )  # fmt: skip
    # Static shift 3 applied by the scheduler to linspace(1, 1/N, N) (Z-Image-Turbo has no dynamic shifting).
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps).tolist(), mu=0.0)
    for step, t in enumerate(pipe.scheduler.timesteps):
        out = pipe.transformer(
            [x.unsqueeze(1) for x in latents] * 2,  # one (C, 1 frame, h, w) latent per call, conditional first
            ((1000 - t) / 1000).expand(2 * batch),  # reversed time in [0, 1]
            prompt_embeds + negative_embeds,
            return_dict=False,
        )[0]
        cond, uncond = torch.stack(out[:batch])[:, :, 0], torch.stack(out[batch:])[:, :, 0]
        # The backbone predicts noise minus data: the velocity is its negative, guided as v_c + g (v_c - v_u).
        latents = _euler(pipe, step, latents, -(cond + scale * (cond - uncond)))
    return latents


@torch.no_grad()
def _flux2_klein_by_hand(pipe: Flux2KleinPipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch, scale = len(PROMPTS), _call_kwargs("flux2_klein")["guidance_scale"]
    prompt_embeds, text_ids = pipe.encode_prompt(list(PROMPTS))  # hidden states 9, 18, 27 stacked per token
    negative_embeds, negative_ids = pipe.encode_prompt([""] * batch)
    latents, image_ids = pipe.prepare_latents(
        batch, pipe.transformer.config.in_channels // 4, height, width, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )  # fmt: skip
    # linspace(1, 1/N, N) shifted by BFL's empirical mu of (tokens, steps), not Flux's linear calculate_shift.
    mu = compute_empirical_mu(latents.shape[1], steps)
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    for step, t in enumerate(pipe.scheduler.timesteps):
        cond, uncond = (
            pipe.transformer(
                hidden_states=latents, timestep=t.expand(batch) / 1000, guidance=None, encoder_hidden_states=embeds,
                txt_ids=ids, img_ids=image_ids, return_dict=False,
            )[0]
            for embeds, ids in ((prompt_embeds, text_ids), (negative_embeds, negative_ids))
        )  # fmt: skip
        latents = _euler(pipe, step, latents, uncond + scale * (cond - uncond))
    # output_type="latent" returns the VAE's latents: tokens onto the patch grid, batch norm undone, patches unfolded.
    grid = pipe._unpack_latents_with_ids(latents, image_ids, height // 16, width // 16)
    bn = pipe.vae.bn
    grid = grid * torch.sqrt(bn.running_var.view(1, -1, 1, 1) + bn.eps) + bn.running_mean.view(1, -1, 1, 1)
    return pipe._unpatchify_latents(grid)


@torch.no_grad()
def _flux2_dev_by_hand(pipe: Flux2Pipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    batch, kwargs = len(PROMPTS), _call_kwargs("flux2_dev")
    # Mistral's chat template around the system message and each prompt, then hidden states 10, 20, 30 side by side.
    texts = [f"<s>[SYSTEM_PROMPT]{SYSTEM_MESSAGE}[/SYSTEM_PROMPT][INST]{prompt}[/INST]" for prompt in PROMPTS]
    tokens = pipe.tokenizer.tokenizer(
        texts, add_special_tokens=False, padding="max_length", max_length=kwargs["max_sequence_length"],
        return_tensors="pt",
    )  # fmt: skip
    hidden = pipe.text_encoder(**tokens, output_hidden_states=True, use_cache=False).hidden_states
    prompt_embeds = torch.cat([hidden[10], hidden[20], hidden[30]], dim=-1)
    text_ids = pipe._prepare_text_ids(prompt_embeds)
    latents, image_ids = pipe.prepare_latents(
        batch, pipe.transformer.config.in_channels // 4, height, width, torch.float32, torch.device("cpu"),
        torch.Generator().manual_seed(seed),
    )  # fmt: skip
    pipe.scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(latents.shape[1], steps)
    )
    guidance = torch.full((batch,), kwargs["guidance_scale"])  # embedded: one call per step, no negative prompt
    for step, t in enumerate(pipe.scheduler.timesteps):
        velocity = pipe.transformer(
            hidden_states=latents, timestep=t.expand(batch) / 1000, guidance=guidance,
            encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=image_ids, return_dict=False,
        )[0]  # fmt: skip
        latents = _euler(pipe, step, latents, velocity)
    return latents  # output_type="latent": the packed tokens


@torch.no_grad()
def _wan_by_hand(pipe: WanPipeline, *, height: int, width: int, steps: int, seed: int) -> torch.Tensor:
    two_experts, ti2v = pipe.transformer_2 is not None, pipe.config.expand_timesteps
    batch, kwargs = len(PROMPTS), _call_kwargs("wan22" if two_experts else "wan22_ti2v" if ti2v else "wan")
    # The call pads the prompts with zeros to 512 tokens, which cross-attention attends to ("" for the negatives).
    prompt_embeds, negative_embeds = pipe.encode_prompt(
        PROMPTS, do_classifier_free_guidance=True, max_sequence_length=512
    )
    # Video latents: (batch, channels, (frames - 1) / 4 + 1, height / s, width / s); Wan2.2's VAE: 48 channels, 16x.
    latents = pipe.prepare_latents(
        batch, pipe.transformer.config.in_channels, height, width, kwargs["num_frames"], torch.float32,
        torch.device("cpu"), torch.Generator().manual_seed(seed),
    )  # fmt: skip
    channels, scale = (48, 16) if ti2v else (16, 8)
    assert latents.shape == (batch, channels, 2, height // scale, width // scale)
    # TI2V: the step's timestep on each 1x2x2 patch token, (batch, frames x h / 2 x w / 2).
    tokens = latents.shape[2] * (latents.shape[3] // 2) * (latents.shape[4] // 2)
    pipe.scheduler.set_timesteps(steps)  # the scheduler's own shifted schedule
    for step, t in enumerate(pipe.scheduler.timesteps):
        # Wan2.2 A14B: the low-noise expert and its own scale below boundary_ratio * 1000 (the tiny one: 800).
        low = two_experts and t < pipe.config.boundary_ratio * 1000
        model, scale = (
            (pipe.transformer_2, kwargs["guidance_scale_2"]) if low else (pipe.transformer, kwargs["guidance_scale"])
        )
        cond, uncond = (
            model(
                hidden_states=latents, timestep=t.expand(batch, tokens) if ti2v else t.expand(batch),
                encoder_hidden_states=embeds, return_dict=False,
            )[0]
            for embeds in (prompt_embeds, negative_embeds)
        )  # fmt: skip
        latents = _euler(pipe, step, latents, uncond + scale * (cond - uncond))
    return latents


MANUAL_SAMPLERS = {
    "flux": _flux_by_hand,
    "sd3": _sd3_by_hand,
    "qwenimage": _qwenimage_by_hand,
    "zimage": _zimage_by_hand,
    "flux2_klein": _flux2_klein_by_hand,
    "flux2_dev": _flux2_dev_by_hand,
    "flux_kontext": _flux_by_hand,  # no source image: Flux's loop
    "wan": _wan_by_hand,
    "wan22": _wan_by_hand,  # with its expert switch
    "wan22_ti2v": _wan_by_hand,  # with per-token timesteps
}


def test_manual_sampling_reproduces_pipeline_latents(saved):
    family, _, pipe = saved
    height, width, steps, seed = 32, 32, 2, 7
    expected = pipe(
        prompt=list(PROMPTS),  # ZImagePipeline rewrites the list it is given into chat-templated prompts
        **_size_kwargs(family, height),
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(seed),
        output_type="latent",
        **_call_kwargs(family),
    )
    expected = expected.frames if family.startswith("wan") else expected.images
    actual = MANUAL_SAMPLERS[family](pipe, height=height, width=width, steps=steps, seed=seed)
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < 1e-5
