"""The presets: each builds a valid GRPOJaggConfig with the published numbers, the CLI YAML files match them, the
Flow-GRPO-Fast preset trains only its SDE window and the DanceGRPO preset a random 60% of the steps."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import FluxPipeline

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.recipes import RECIPES, get_recipe, list_recipes
from trl_jagg.trainer import update

YAML_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "recipes")
NAMES = [
    "flow-grpo-sd35", "flow-grpo-flux", "flow-grpo-qwenimage", "flow-grpo-fast-flux", "dancegrpo-flux",
    "flow-factory-z-image", "flow-factory-z-image-turbo", "flow-factory-flux2-klein-base", "flow-factory-flux2-klein",
]  # fmt: skip

# The public numbers (JAGG spec section 5), written out independently of trl_jagg/recipes.py.
PUBLISHED = {
    "flow-grpo-sd35": dict(
        height=512, width=512, num_inference_steps=10, guidance_scale=4.5, sampler="sde", noise_level=0.7,
        num_generations=24, learning_rate=3e-4, beta=0.04, train_timesteps="all_but_last",
    ),
    "flow-grpo-flux": dict(num_inference_steps=6, guidance_scale=3.5, sampler="sde", noise_level=0.9),
    "flow-grpo-qwenimage": dict(true_cfg_scale=4.0, sampler="sde", noise_level=1.2),
    "flow-grpo-fast-flux": dict(train_timesteps="sde_window", sde_window_size=3, sde_window_max_start=0),
    "dancegrpo-flux": dict(
        height=720, width=720, num_inference_steps=16, sampler="dance", noise_level=0.3, learning_rate=1e-5,
        train_timestep_fraction=0.6,
    ),
    # Flow-Factory examples/grpo/lora/z_image{,_turbo}/default.yaml (L44-80)
    "flow-factory-z-image": dict(
        height=512, width=512, num_inference_steps=10, guidance_scale=4.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, clip_range=1e-4, adv_clip_max=5.0,
    ),
    "flow-factory-z-image-turbo": dict(
        height=512, width=512, num_inference_steps=6, guidance_scale=0.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, clip_range=1e-4, adv_clip_max=5.0,
    ),
    # Flow-Factory examples/grpo/lora/flux2_klein{_base,}/default.yaml (L43-90)
    "flow-factory-flux2-klein-base": dict(
        height=384, width=384, num_inference_steps=8, guidance_scale=4.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, clip_range=1e-4, adv_clip_max=5.0,
    ),
    "flow-factory-flux2-klein": dict(
        height=384, width=384, num_inference_steps=4, guidance_scale=1.0, sampler="sde", noise_level=0.5,
        num_generations=16, learning_rate=3e-4, beta=0.0, clip_range=1e-4, adv_clip_max=5.0,
    ),
}  # fmt: skip
# The peers' conventions around the formulas, read from their code (docs/models.md lists file and line for each).
# Flow-GRPO: config/grpo.py (pickscore_sd3, pickscore_flux, pickscore_flux_fast, pickscore_qwenimage),
# flow_grpo/stat_tracking.py, flow_grpo/ema.py, scripts/train_sd3.py / train_flux.py; DanceGRPO:
# fastvideo/train_grpo_flux.py and scripts/finetune/finetune_flux_grpo.sh.
_FLOW_GRPO = dict(
    per_prompt_stat_tracking=True, stat_tracking_buffer_size=None, advantage_std_ddof=0, advantage_eps=1e-4,
    kl_std="flow_grpo", same_group_noise=False, quantize_timesteps=False,
)  # fmt: skip
_FLOW_GRPO_EMA = dict(ema_decay=0.9, ema_update_interval=8, ema_warmup=True)
PEER_CONVENTIONS = {
    "flow-grpo-sd35": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="batch", max_sequence_length=128, eval_num_inference_steps=40,
        drop_zero_advantages=True, cfg_gradient="both",
    ),
    "flow-grpo-flux": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="batch", max_sequence_length=128, eval_num_inference_steps=28,
        drop_zero_advantages=False,
    ),
    "flow-grpo-qwenimage": dict(
        **_FLOW_GRPO, ema_decay=0.0, scale_rewards="batch", max_sequence_length=512, eval_num_inference_steps=50,
        cfg_gradient="both",
    ),
    "flow-grpo-fast-flux": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="group", max_sequence_length=128, eval_num_inference_steps=28,
    ),
    "dancegrpo-flux": dict(
        per_prompt_stat_tracking=False, scale_rewards="group", advantage_std_ddof=1, advantage_eps=1e-8,
        quantize_timesteps=True, same_group_noise=True, max_sequence_length=512, train_timesteps="random_but_last",
        ema_decay=0.0, beta=0.0,
    ),
    # Flow-Factory: global_std false (L59), EMA 0.9 every 4 (L73-74), the pipeline's 512 prompt tokens.
    "flow-factory-z-image": dict(
        scale_rewards="group", ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=40, negative_prompt="",
    ),
    "flow-factory-z-image-turbo": dict(
        scale_rewards="group", ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=10,
    ),
    "flow-factory-flux2-klein-base": dict(
        scale_rewards="group", ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=28, negative_prompt="",
    ),
    "flow-factory-flux2-klein": dict(
        scale_rewards="group", ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=10,
    ),
}  # fmt: skip
PUBLISHED_LORA = {
    "flow-grpo-sd35": (32, 64),
    "flow-grpo-flux": (64, 128),
    "flow-grpo-qwenimage": (64, 128),
    "flow-grpo-fast-flux": (64, 128),
    "dancegrpo-flux": None,  # full fine-tuning
    "flow-factory-z-image": (64, 128),
    "flow-factory-z-image-turbo": (64, 128),
    "flow-factory-flux2-klein-base": (64, 128),
    "flow-factory-flux2-klein": (64, 128),
}
MODELS = {
    "flow-grpo-sd35": "stabilityai/stable-diffusion-3.5-medium",
    "flow-grpo-flux": "black-forest-labs/FLUX.1-dev",
    "flow-grpo-qwenimage": "Qwen/Qwen-Image",
    "flow-grpo-fast-flux": "black-forest-labs/FLUX.1-dev",
    "dancegrpo-flux": "black-forest-labs/FLUX.1-dev",
    "flow-factory-z-image": "Tongyi-MAI/Z-Image",
    "flow-factory-z-image-turbo": "Tongyi-MAI/Z-Image-Turbo",
    "flow-factory-flux2-klein-base": "black-forest-labs/FLUX.2-klein-base-9B",
    "flow-factory-flux2-klein": "black-forest-labs/FLUX.2-klein-9B",
}


def test_list_recipes():
    assert list_recipes() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_preset_builds_a_valid_config(name, tmp_path):
    recipe = get_recipe(name)
    config = GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path))
    assert isinstance(config, GRPOJaggConfig) and config.output_dir == str(tmp_path)
    for key, value in {**recipe.config, **PUBLISHED[name], **PEER_CONVENTIONS[name]}.items():
        assert getattr(config, key) == value, key
    # The paper's JAGG settings; W = 3 where only 3 steps are trained (the Fast preset's window, the 4-step distilled
    # klein): a W = 4 group would never fit.
    assert config.use_jagg and config.jagg_frac == 0.6 and config.jagg_mode == "jagg"
    assert config.jagg_group_size == (3 if name in ("flow-grpo-fast-flux", "flow-factory-flux2-klein") else 4)
    assert config.generation_batch_size % config.num_generations == 0
    assert recipe.model == MODELS[name]
    assert recipe.description and recipe.source and recipe.reward_funcs
    lora = recipe.lora_config()
    if PUBLISHED_LORA[name] is None:
        assert lora is None
    else:
        assert (lora.r, lora.lora_alpha) == PUBLISHED_LORA[name]
        assert {"to_q", "to_k", "to_v", "to_out.0"} <= set(lora.target_modules)


def test_overrides_apply_and_are_validated(tmp_path):
    config = GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), max_steps=7, noise_level=0.5)
    assert (config.max_steps, config.noise_level, config.num_inference_steps) == (7, 0.5, 10)
    with pytest.raises(ValueError, match="num_generations"):
        GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), num_generations=1)
    with pytest.raises(TypeError, match="no field 'noise_levl'.*'noise_level'"):
        GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), noise_levl=0.5)


def test_output_dir_is_required():
    with pytest.raises(ValueError, match="output_dir"):
        GRPOJaggConfig.from_recipe("flow-grpo-flux")


def test_unknown_recipe_lists_the_presets():
    with pytest.raises(ValueError, match="Did you mean 'flow-grpo-sd35'") as info:
        get_recipe("flow-grpo-sd3")
    for name in NAMES:
        assert name in str(info.value)


def test_recipes_are_read_only():
    with pytest.raises(TypeError):
        RECIPES["flow-grpo-sd35"].config["noise_level"] = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["flow-grpo-sd35"].model = "other"


# ---------------------------------------------------------------- YAML files for the CLI
def test_yaml_files_match_the_presets():
    """examples/recipes/*.yaml are generated (`python -m trl_jagg.recipes examples/recipes`): no drift."""
    assert sorted(f for f in os.listdir(YAML_DIR) if f.endswith(".yaml")) == sorted(f"{n}.yaml" for n in NAMES)
    for name in NAMES:
        with open(os.path.join(YAML_DIR, f"{name}.yaml")) as handle:
            assert handle.read() == get_recipe(name).to_yaml(), f"{name}.yaml is stale: regenerate it"


@pytest.mark.parametrize("name", NAMES)
def test_yaml_file_parses_to_the_preset_through_the_cli(name, tmp_path):
    from trl_jagg.scripts.train import parse_train_args

    path = os.path.join(YAML_DIR, f"{name}.yaml")
    script_args, config = parse_train_args(["--config", path, "--output_dir", str(tmp_path), "--prompts", "a cat"])
    expected = GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path))
    for item in dataclasses.fields(GRPOJaggConfig):
        if item.init:
            assert getattr(config, item.name) == getattr(expected, item.name), item.name
    recipe = get_recipe(name)
    assert script_args.recipe == name  # names the preset, so the CLI applies its scheduler override
    assert script_args.model_name_or_path == recipe.model
    assert script_args.reward_funcs == list(recipe.reward_funcs)
    assert script_args.use_peft == (recipe.lora is not None)
    if recipe.lora is not None:
        assert (script_args.lora_r, script_args.lora_alpha) == (recipe.lora["r"], recipe.lora["lora_alpha"])
        assert script_args.lora_target_modules == list(recipe.lora["target_modules"])


# ---------------------------------------------------------------- the presets train what they say
TINY = dict(
    height=32, width=32, per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=1,
    max_steps=1, dtype="float32", max_sequence_length=16, activation_checkpointing=False, report_to="none",
    save_strategy="no", disable_tqdm=True, seed=0,
)  # fmt: skip


def redness(prompts, images, **kwargs):
    return [float(np.asarray(im, dtype=np.float32)[..., 0].mean() / 255.0) for im in images]


def recipe_trainer(name: str, model, tmp_path, monkeypatch, **overrides) -> tuple[DDPOJaggTrainer, list]:
    """A trainer on the preset (tiny sizes), recording each update's trained steps and its rollout."""
    recipe = get_recipe(name)
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=redness,
        args=GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path / "out"), **(TINY | overrides)),
        train_dataset=Dataset.from_dict(
            {"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}
        ),
        peft_config=recipe.lora_config(),
    )
    recorded = []
    trained_steps = update.trained_steps

    def spy(args, batch, **counters):
        steps = trained_steps(args, batch, **counters)
        recorded.append((steps, batch))
        return steps

    monkeypatch.setattr(update, "trained_steps", spy)
    return trainer, recorded


def test_fast_preset_trains_only_the_sde_window(tiny_flux_path, tmp_path, monkeypatch):
    trainer, recorded = recipe_trainer("flow-grpo-fast-flux", tiny_flux_path, tmp_path, monkeypatch)
    trainer.train()
    args = trainer.args
    assert recorded
    for steps, batch in recorded:
        window = batch["stochastic_steps"]
        assert steps == window and len(window) == args.sde_window_size == 3
        assert max(window) < args.num_inference_steps // 2  # the first half of the schedule
        stochastic = batch["log_probs"].abs().sum(dim=0) != 0
        assert stochastic.tolist() == [k in window for k in range(args.num_inference_steps)]
    entry = next(e for e in trainer.state.log_history if "jagg/backward_calls" in e)
    assert entry["jagg/groups_jagg"] == 1 and entry["jagg/backward_calls"] == 1  # the window is one JAGG group


def test_dance_preset_trains_the_requested_fraction_never_the_last_step(tiny_flux_path, tmp_path, monkeypatch):
    recipe = get_recipe("dancegrpo-flux")
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path))
    trainer, recorded = recipe_trainer(
        "dancegrpo-flux", pipeline, tmp_path, monkeypatch, gradient_accumulation_steps=2
    )
    assert trainer.peft_config is None  # full fine-tuning
    trainer.train()
    args = trainer.args
    # DanceGRPO trains int(len(timesteps) * timestep_fraction) of its samples' timesteps, which exclude the last:
    expected = int((args.num_inference_steps - 1) * 0.6)  # 9 of the first 15
    assert len(recorded) == 2  # one update per micro-batch
    for steps, _ in recorded:
        assert len(steps) == expected and steps == sorted(set(steps)) and set(steps) <= set(range(15))
    assert recorded[0][0] != recorded[1][0]  # a fresh random subset at every update
    entry = next(e for e in trainer.state.log_history if "jagg/backward_calls" in e)
    # 9 steps in groups of 4, 4, 1: round(0.6 * 3) = 2 JAGG groups (1 backward each) and 1 exact step.
    assert entry["jagg/groups_jagg"] == 2 and entry["jagg/backward_calls"] == 3


def test_dance_scheduler_override_is_dancegrpo_shift_3(tiny_flux_path):
    recipe = get_recipe("dancegrpo-flux")
    pipeline = FluxPipeline.from_pretrained(tiny_flux_path)
    own, _ = load_adapter(pipeline).schedule(16, 720, 720)
    sigmas, timesteps = load_adapter(recipe.apply_scheduler(pipeline)).schedule(16, 720, 720)
    t = torch.linspace(1, 0, 17)
    torch.testing.assert_close(sigmas, 3 * t / (1 + 2 * t), atol=1e-6, rtol=0)  # DanceGRPO's sd3_time_shift
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, atol=1e-3, rtol=0)
    assert not torch.allclose(own, sigmas)  # Flux's own resolution-dependent shift differs


def test_recipes_import_nothing_of_trl_jagg():
    # The arrow points one way: the config reads the presets, the presets never import the config.
    import subprocess
    import sys

    code = "import sys, trl_jagg.recipes; print(sorted(m for m in sys.modules if m.startswith('trl_jagg.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['trl_jagg.recipes']"
