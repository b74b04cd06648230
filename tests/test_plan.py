"""``trl-jagg plan``: the architecture built on meta matches the real modules, the activations measured on meta match
a real CPU forward, the FLOPs match the hand count at FLUX.1-dev size, and the memory table places the copies as
each sharding strategy does."""

from __future__ import annotations

import json

import pytest
import torch
from test_flops import flux_forward_flops, flux_full_backward_flops

from trl_jagg.planning.architecture import Component, load_architecture, shipped_architectures
from trl_jagg.planning.inputs import backbone_inputs
from trl_jagg.planning.measure import ActivationProfile, CallFlops, count_flops, measure_activations
from trl_jagg.planning.memory import ModelSizes, RunCopies, memory_rows
from trl_jagg.planning.plan import BackboneMeasurement, GPUs, make_plan
from trl_jagg.planning.settings import RunSettings
from trl_jagg.recipes import get_recipe, list_recipes
from trl_jagg.scripts.cli import main as cli_main
from trl_jagg.testing.tiny_models import build_tiny_pipeline, save_tiny_pipeline

FAMILIES = ("flux", "sd3", "qwenimage", "wan", "zimage", "flux2_klein", "flux2_dev", "wan22")


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_pipeline(family, root / family) for family in FAMILIES}


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_build_of_a_local_folder_has_the_real_modules_parameters(tiny_folders, family):
    architecture = load_architecture(tiny_folders[family])
    real = build_tiny_pipeline(family, seed=0)
    for name, component in architecture.components.items():
        meta = component.build_on_meta()
        assert all(p.is_meta for p in meta.parameters())
        # Exact: the same classes from the same configs must have the same parameters.
        assert parameter_count(meta) == parameter_count(getattr(real, name)), name


def test_shipped_qwen_image_has_its_published_parameter_count():
    # 20,430,401,088: Qwen/Qwen-Image's transformer as published (40.86 GB of bf16 safetensors).
    assert parameter_count(load_architecture("Qwen/Qwen-Image").backbone.build_on_meta()) == 20_430_401_088


# Hub id -> (component, the published figure, its tolerance, the exact count public code records for the released
# checkpoint, or None). Published figures are rounded names ("1.3B"), hence the tolerances: Wan2.1's "1.3B" model
# holds 1.42B parameters (its 30 blocks alone 1.39B), Wan2.2's "27B total" README figure is 2 x 14.29B.
PUBLISHED_PARAMETERS = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": [("transformer", 1.3e9, 0.10, 1_418_996_800),
                                         ("text_encoder", 5.7e9, 0.01, 5_680_910_336)],  # umt5-xxl's encoder
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": [("transformer", 14e9, 0.03, 14_288_491_584)],
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": [("transformer", 14e9, 0.03, 14_288_491_584),
                                         ("transformer_2", 14e9, 0.03, 14_288_491_584)],
    "Tongyi-MAI/Z-Image": [("transformer", 6e9, 0.03, 6_154_908_736), ("text_encoder", 4.0e9, 0.01, None)],
    "Tongyi-MAI/Z-Image-Turbo": [("transformer", 6e9, 0.03, 6_154_908_736)],
    "black-forest-labs/FLUX.2-dev": [("transformer", 32e9, 0.01, 32_223_281_152), ("text_encoder", 24e9, 0.01, None)],
    "black-forest-labs/FLUX.2-klein-9B": [("transformer", 9e9, 0.01, 9_078_581_248),
                                          ("text_encoder", 8.2e9, 0.01, None)],  # Qwen3-8B
    "black-forest-labs/FLUX.2-klein-base-9B": [("transformer", 9e9, 0.01, 9_078_581_248)],
    "black-forest-labs/FLUX.2-klein-4B": [("transformer", 4e9, 0.04, 3_875_544_576),
                                          ("text_encoder", 4.0e9, 0.01, None)],  # Qwen3-4B
    "black-forest-labs/FLUX.1-dev": [("transformer", 12e9, 0.01, None)],
    "black-forest-labs/FLUX.1-Kontext-dev": [("transformer", 12e9, 0.01, None)],
}  # fmt: skip


@pytest.mark.parametrize("hub_id", sorted(PUBLISHED_PARAMETERS))
def test_shipped_architectures_have_their_published_parameter_counts(hub_id):
    architecture = load_architecture(hub_id)
    assert architecture.not_verified  # each says what was not read from the Hub repository itself
    for name, published, tolerance, exact in PUBLISHED_PARAMETERS[hub_id]:
        count = parameter_count(architecture.components[name].build_on_meta())
        assert count == pytest.approx(published, rel=tolerance), name
        if exact is not None:
            assert count == exact, name


def test_every_shipped_architecture_builds_and_has_a_published_count_test():
    # A shipped JSON without a published figure above would go unchecked.
    # Qwen-Image's exact count is checked above; SD3.5 Medium's published 2.5B counts its 226M positional
    # embedding, a buffer, not a parameter (2.24B parameters).
    checked_elsewhere = {"stabilityai/stable-diffusion-3.5-medium", "Qwen/Qwen-Image", "Qwen/Qwen-Image-Edit"}
    assert set(shipped_architectures()) - checked_elsewhere == set(PUBLISHED_PARAMETERS)


def test_an_editing_variant_shares_its_base_architecture():
    edit, base = load_architecture("Qwen/Qwen-Image-Edit"), load_architecture("Qwen/Qwen-Image")
    assert edit.pipeline == "QwenImageEditPipeline"
    assert {name: c.config for name, c in edit.components.items()} == {
        name: c.config for name, c in base.components.items()
    }
    with torch.device("meta"):
        inputs = backbone_inputs(
            edit.backbone.class_name, edit.backbone.config, rows=1, height=512, width=512, text_tokens=8, references=1
        )
    assert inputs["hidden_states"].shape[1] == 2 * (512 // 16) ** 2  # the generated image's tokens, then the source's


def test_an_unknown_hub_id_names_the_fix():
    with pytest.raises(ValueError, match="local folder"):
        load_architecture("someone/unknown-model")


def saved_bytes_on_cpu(model: torch.nn.Module, inputs: dict) -> int:
    """The bytes a real CPU forward keeps for its backward: every storage autograd saves, once, parameters aside."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = model(**inputs, return_dict=False)[0]
    output = torch.stack(output) if isinstance(output, list) else output  # Z-Image: one tensor per sample
    output.sum().backward()  # the graph is whole: the backward runs on what was saved
    return sum(storages.values())


@pytest.mark.parametrize(
    ("family", "references"),
    [("flux", 0), ("sd3", 0), ("qwenimage", 0), ("qwenimage", 1), ("flux", 1), ("wan", 0), ("zimage", 0),
     ("flux2_klein", 0), ("flux2_dev", 0)],
)  # fmt: skip
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activations_on_meta_match_a_real_cpu_forward(tiny_folders, family, references, lora):
    # references=1: an editing model's sequence, the source image's tokens after the generated ones. Wan: 9-frame
    # videos (3 latent frames).
    component = load_architecture(tiny_folders[family]).backbone
    frames = 9 if family == "wan" else None
    shape = {"rows": 2, "height": 64, "width": 64, "text_tokens": 8, "references": references, "num_frames": frames}
    models = []
    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        model = component.build_on_meta() if device == "meta" else build_tiny_pipeline(family, seed=0).transformer
        model.requires_grad_(True)  # full fine-tuning; LoRA freezes it again
        if lora:
            from peft import LoraConfig

            model.requires_grad_(False)
            model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
        with torch.device(device):
            inputs = backbone_inputs(component.class_name, component.config, **shape)
        models.append((model, inputs))
    predicted = measure_activations(*models[0]).total
    measured = saved_bytes_on_cpu(*models[1])
    # The tolerance; the two count the same tensors, so they agree exactly in practice.
    assert predicted == pytest.approx(measured, rel=0.15)


def test_video_inputs_have_the_pipelines_latent_frames(tiny_folders):
    # WanPipeline.prepare_latents sizes the latents the rollout denoises: the planner's video must be the same.
    pipe = build_tiny_pipeline("wan", seed=0)
    component = load_architecture(tiny_folders["wan"]).backbone
    for num_frames in (1, 5, 33):
        latents = pipe.prepare_latents(2, 16, 64, 96, num_frames, torch.float32, "cpu", torch.Generator())
        with torch.device("meta"):
            inputs = backbone_inputs(component.class_name, component.config, rows=2, height=64, width=96,
                                     text_tokens=8, num_frames=num_frames)  # fmt: skip
        assert inputs["hidden_states"].shape == latents.shape, num_frames
    with pytest.raises(ValueError, match="num_frames"):
        backbone_inputs(component.class_name, component.config, rows=1, height=64, width=64, text_tokens=8)


def test_checkpointing_keeps_less_and_every_kth_block_in_between():
    flux = load_architecture("black-forest-labs/FLUX.1-dev").backbone
    narrow = {"num_layers": 4, "num_single_layers": 4, "attention_head_dim": 16, "num_attention_heads": 2,
              "axes_dims_rope": [4, 6, 6]}  # fmt: skip
    component = Component("transformer", "diffusers", flux.class_name, {**flux.config, **narrow})
    with torch.device("meta"):
        inputs = backbone_inputs(component.class_name, component.config, rows=2, height=256, width=256, text_tokens=8)
    profile = measure_activations(component.build_on_meta(), inputs)
    every_block, every_other, none = profile.checkpointed_bytes(1), profile.checkpointed_bytes(2), profile.total
    assert every_block < every_other < none
    # Every block checkpointed: what runs outside the blocks, each block's inputs and one block recomputed.
    expected = profile.outside_blocks + sum(profile.block_inputs) + max(profile.per_block)
    assert every_block == expected


def test_flux_dev_flops_on_meta_match_the_hand_count():
    architecture = load_architecture("black-forest-labs/FLUX.1-dev")
    component = architecture.backbone
    with torch.device("meta"):
        inputs = backbone_inputs(component.class_name, component.config, rows=1, height=1024, width=1024,
                                 text_tokens=512)  # fmt: skip
    flops = count_flops(component.build_on_meta(), inputs)
    config = dict(component.config)
    assert flops.forward == pytest.approx(flux_forward_flops(config, 4096, 512), rel=0.01)
    assert flops.forward / 1e12 == pytest.approx(74.4, abs=0.05)  # the figure benchmarks/flops.py states
    assert flops.backward == pytest.approx(flux_full_backward_flops(config, 4096, 512), rel=0.01)


SIZES = ModelSizes(
    backbone_params=1000, backbone_bytes=4000, trainable_params=1000, trainable_bytes=4000, largest_block_bytes=100,
    frozen_bytes={"text_encoder": 600, "vae": 200},
)  # fmt: skip


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp2", "zero3"])
def test_memory_table_places_each_copy_as_the_strategy_does(strategy):
    copies = RunCopies(optimizer_state_bytes_per_param=8, ema=True, old_policy=True)
    rows = {row.component: row.bytes for row in memory_rows(SIZES, copies, 500, strategy=strategy, num_processes=4)}
    weights = 4000 / 4 if strategy in ("fsdp2", "zero3") else 4000
    state = 1 / 4 if strategy != "ddp" else 1
    expected = {
        "backbone, trained weights": weights,
        "gradients": 4000 * state,
        "optimizer state": 8000 * state,
        "DDP gradient buckets": 4000 if strategy == "ddp" else 0,
        "gathered blocks": 200 if strategy in ("fsdp2", "zero3") else 0,
        "EMA (float32)": weights,  # float32 copies of 1000 float32 parameters
        "old policy (float32)": weights,
        "text encoders + VAE": 800,
    }
    for component, value in expected.items():
        assert rows[component] == value, component
    assert rows["peak"] == sum(expected.values()) + 500


def test_offloaded_frozen_modules_visit_one_at_a_time():
    copies = RunCopies(optimizer_state_bytes_per_param=8, offload_frozen_modules=True)
    small, large = (
        {row.component: row.bytes for row in memory_rows(SIZES, copies, act, strategy="ddp", num_processes=1)}
        for act in (100, 5000)
    )
    static = 3 * 4000 + 8000  # weights, gradients, DDP buckets, optimizer state
    assert small["text encoders + VAE"] == 0
    assert small["peak"] == static + 600  # the text encoder, the largest, while it encodes
    assert large["peak"] == static + 5000


def test_plan_command_prints_the_table_and_the_fix(tiny_folders, tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = [
        "plan", "--model_name_or_path", tiny_folders["flux"], "--height", "64", "--width", "64",
        "--max_sequence_length", "8", "--per_device_train_batch_size", "2", "--num_generations", "2",
        "--num_processes", "4",
        "--gpu_memory_gb", "0.0012", "--json_output", str(path),
    ]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "peak" in out and "fits" in out
    plan = json.loads(path.read_text())
    assert plan["tables"]["ddp"]["peak"] > plan["usable_bytes"]  # the tiny model does not fit 1.2 MB under DDP ...
    assert plan["fix"] is not None and plan["fix_peak_bytes"] <= plan["usable_bytes"]  # ... and a fix is found
    assert plan["fix"] in out


@pytest.mark.slow
@pytest.mark.parametrize("preset", list_recipes())
def test_every_preset_fits_8_x_80_gb_or_names_a_fix(preset, tmp_path, capsys):
    recipe = get_recipe(preset)
    assert recipe.model in shipped_architectures()  # every preset's model is sized, none left out
    path = tmp_path / "plan.json"
    assert cli_main(["plan", "--recipe", preset, "--json_output", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak" in out and "fits" in out
    plan = json.loads(path.read_text())
    assert plan["fits"][plan["strategy"]] or plan["fix"], out
    assert (plan["fix"] or "").count("--activation_checkpointing ") <= 1  # one checkpointing interval, not each tried
    # A video preset is planned at its own clip length (Wan's pipeline default of 81 frames when unset).
    video = "wan" in recipe.model.lower()
    assert plan["num_frames"] == ((recipe.config.get("num_frames") or 81) if video else None)


def test_a_two_expert_model_holds_both_experts_and_trains_those_chosen(tiny_folders, tmp_path):
    # Wan2.2 A14B's tiny stand-in: two experts of the same size; train_experts says which get LoRA.
    expert = parameter_count(build_tiny_pipeline("wan22", seed=0).transformer)
    plans = {}
    for experts in ("both", "high_noise"):
        path = tmp_path / f"{experts}.json"
        argv = [
            "plan", "--model_name_or_path", tiny_folders["wan22"], "--height", "32", "--width", "32",
            "--num_frames", "5", "--max_sequence_length", "8", "--per_device_train_batch_size", "2",
            "--num_generations", "2", "--use_peft", "true", "--lora_r", "2", "--train_experts", experts,
            "--json_output", str(path),
        ]  # fmt: skip
        assert cli_main(argv) == 0
        plans[experts] = json.loads(path.read_text())
    assert plans["both"]["trainable_params"] == 2 * plans["high_noise"]["trainable_params"] > 0
    for experts, plan in plans.items():
        assert plan["backbone_params"] == 2 * expert + plan["trainable_params"], experts
        assert plan["num_frames"] == 5


def fake_settings(**changes) -> RunSettings:
    values = dict(
        model="m", height=64, width=64, text_tokens=8, micro_batch=4, branches=1, graph_branches=1, lora=None,
        checkpoint_every=1, weights_dtype=torch.float32, compute_dtype=torch.bfloat16,
        copies=RunCopies(optimizer_state_bytes_per_param=8, offload_frozen_modules=True), strategy="ddp",
        inference_steps=4, trained_steps=3, steps_per_generation=2, gradient_accumulation_steps=2,
    )  # fmt: skip
    return RunSettings(**(values | changes))


def fake_measure(settings: RunSettings) -> BackboneMeasurement:
    """1000 parameters, all trained (4000 bytes) or a 10-parameter LoRA; 10 bytes of activations per row; a
    600-byte text encoder that visits the GPU (it bounds the peak, whatever the micro-batch)."""
    trained = 1000 if settings.lora is None else 10
    sizes = ModelSizes(
        backbone_params=1000 + (trained if settings.lora else 0), backbone_bytes=4000 + 4 * (trained if settings.lora else 0),
        trainable_params=trained, trainable_bytes=4 * trained, largest_block_bytes=100, frozen_bytes={"text_encoder": 600},
    )  # fmt: skip
    activations = ActivationProfile(outside_blocks=0, per_block=(10 * settings.rows,), block_inputs=(0,))
    flops = CallFlops(
        forward=100 * settings.rows, backward=200 * settings.rows, recompute_per_block=(100 * settings.rows,)
    )
    return BackboneMeasurement(sizes=sizes, activations=activations, flops=flops, rows=settings.rows)


def test_the_fix_combines_only_changes_that_lower_the_peak():
    # DDP: weights, gradients, buckets 4000 each, optimizer 8000, the visiting text encoder 600: 20600. FSDP2 on 4:
    # 1000 + 1000 + 2000 + two blocks 200 + 600 = 4800. FSDP2 + LoRA: adapter 10 + frozen 1000 + gradients 10 +
    # optimizer 20 + 200 + 600 = 1840. Halving the micro-batch lowers nothing (the text encoder bounds the peak), so
    # it is not part of the fix.
    gpus = GPUs(num_processes=4, memory_gb=2000 / 1e9 / 0.9)  # 2000 bytes usable
    plan = make_plan(fake_settings(), gpus, fake_measure, default_lora={"r": 4})
    assert plan.peak("ddp") == 20600 and plan.peak("fsdp2") == 4800
    assert plan.fix == "--accelerate_config fsdp2 (or deepspeed_zero3) --use_peft true --lora_r 4"
    assert plan.fix_peak_bytes == 1840


def test_step_time_prices_the_counted_flops():
    settings = fake_settings()
    plan = make_plan(settings, GPUs(num_processes=1, memory_gb=1.0, tflops=1e-9, mfu=0.5), fake_measure,
                     default_lora={"r": 4})  # fmt: skip
    # Sampling: 4 images x 2 micro-batches x 4 steps x 100 FLOPs; update: 2 micro-batches x 3 steps x 4 rows x
    # (100 forward + 200 backward + 100 recomputed) FLOPs; at 1e3 FLOP/s x 0.5.
    flops = 4 * 2 * 4 * 100 + 2 * 3 * 4 * 400
    assert plan.time.rollout_flops == flops
    assert plan.time.seconds_per_rollout == pytest.approx(flops / 500)
    assert plan.time.seconds_per_optimizer_step == pytest.approx(flops / 500 / 1)  # 2 micro-batches, accumulation 2


def test_a_model_the_planner_ships_no_architecture_for_is_a_usage_error(capsys):
    argv = ["plan", "--recipe", "flow-grpo-sd35", "--model_name_or_path", "stabilityai/stable-diffusion-3.5-large"]
    assert cli_main(argv) == 2
    assert "stabilityai/stable-diffusion-3.5-large" in capsys.readouterr().err


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_predicted_peak_growth_of_a_step_matches_a_measured_cpu_step(checkpointing):
    # A narrow FLUX.1 (6 blocks, width 128) at 256 px, fully fine-tuned over two accumulated micro-batches: the
    # plan's growth above the weights is one micro-batch's activations (every block checkpointed: the blocks'
    # inputs and one block recomputed) plus the gradients; torch's MemTracker measures every live tensor of the
    # real CPU step, transients included.
    from torch.distributed._tools.mem_tracker import MemTracker

    flux = load_architecture("black-forest-labs/FLUX.1-dev").backbone
    narrow = {
        "num_layers": 2, "num_single_layers": 4, "attention_head_dim": 32, "num_attention_heads": 4,
        "axes_dims_rope": [8, 12, 12], "joint_attention_dim": 64, "pooled_projection_dim": 32,
    }  # fmt: skip
    component = Component("transformer", "diffusers", flux.class_name, {**flux.config, **narrow})
    shape = {"rows": 2, "height": 256, "width": 256, "text_tokens": 32}
    with torch.device("meta"):
        meta_inputs = backbone_inputs(component.class_name, component.config, **shape)
    weights = sum(p.numel() * p.element_size() for p in component.build_on_meta().parameters())
    profile = measure_activations(component.build_on_meta(), meta_inputs)
    activations = profile.checkpointed_bytes(1) if checkpointing else profile.total
    predicted = activations + weights  # the gradients: one per weight, same dtype

    torch.manual_seed(0)
    model = component.build_on_meta().to_empty(device="cpu")
    if checkpointing:
        model.enable_gradient_checkpointing()  # what the trainer calls for activation_checkpointing
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        for _ in range(2):
            inputs = backbone_inputs(component.class_name, component.config, **shape)
            model(**inputs, return_dict=False)[0].float().square().mean().backward()
            tracker.reset_mod_stats()  # per-module stats only; the peak snapshot spans both micro-batches
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - weights
    assert predicted == pytest.approx(measured, rel=0.15)  # the tolerance


def test_bad_machine_flags_are_usage_errors_naming_the_flag(capsys):
    assert cli_main(["plan", "--recipe", "flow-grpo-sd35", "--mfu", "1.5"]) == 2
    assert "mfu" in capsys.readouterr().err
