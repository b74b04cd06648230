"""GRPOJaggConfig refuses bad values when it is built, before anything loads, with a message naming the field."""

from __future__ import annotations

import math
import sys
import warnings

import pytest

from trl_jagg import GRPOJaggConfig

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")
WINDOW = dict(train_timesteps="sde_window", sde_window_size=2)  # an SDE window, which the ODE options act around


def config(**overrides) -> GRPOJaggConfig:
    return GRPOJaggConfig(**{**BASE, **overrides})


FLOAT_FIELDS = [
    "noise_level", "guidance_scale", "true_cfg_scale", "epsilon", "learning_rate", "beta", "adv_clip_max",
    "train_timestep_fraction", "jagg_frac", "weight_decay", "max_grad_norm", "ode_step_ratio",
]  # fmt: skip


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_every_float_field_must_be_finite(name, value):
    with pytest.raises(ValueError, match=rf"GRPOJaggConfig\.{name} is -?(nan|inf)\. Use a finite number"):
        config(**{name: value})


def test_non_finite_reward_weight():
    with pytest.raises(ValueError, match=r"GRPOJaggConfig\.reward_weights is \[1\.0, nan\]"):
        config(reward_weights=[1.0, math.nan])


@pytest.mark.parametrize(
    ("overrides", "field", "fix"),
    [
        (dict(noise_level=0.0), "noise_level", "stochastic"),
        (dict(noise_level=0.0, sampler="dance"), "noise_level", "stochastic"),
        (dict(noise_level=-0.5), "noise_level", "> 0"),
        (dict(noise_level=1.5, sampler="cps"), "noise_level", r"\(0, 1\]"),
        (dict(guidance_scale=-1.0), "guidance_scale", ">= 0"),
        (dict(true_cfg_scale=0.5), "true_cfg_scale", "1 \\(off\\)"),
        (dict(epsilon=0.0), "epsilon", "positive"),
        (dict(learning_rate=-1e-4), "learning_rate", ">= 0"),
        (dict(beta=-0.1), "beta", "positive"),
        (dict(adv_clip_max=0.0), "adv_clip_max", "positive"),
        (dict(train_timestep_fraction=0.0, train_timesteps="random"), "train_timestep_fraction", r"\(0, 1\]"),
        (dict(max_grad_norm=-1.0), "max_grad_norm", ">= 0"),
        (dict(adam_beta2=1.0), "adam_beta2", r"\[0, 1\)"),
        (dict(per_device_train_batch_size=0), "per_device_train_batch_size", "1 or more"),
        (dict(steps_per_generation=0), "steps_per_generation", "1 or more"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps", "1 or more"),
        (dict(max_sequence_length=0), "max_sequence_length", "positive"),
        (dict(eval_num_inference_steps=0), "eval_num_inference_steps", "positive"),
        (dict(stat_tracking_buffer_size=0), "stat_tracking_buffer_size", "positive"),
        (dict(reward_retries=-1), "reward_retries", "0"),
        (dict(reward_timeout=0.0), "reward_timeout", "> 0"),
        (dict(sde_window_schedule="sliding"), "sde_window_schedule", "random"),
        (dict(sde_window_schedule="progressive"), "sde_window_schedule", "sde_window_size >= 1"),
        (dict(sde_window_schedule="fixed"), "sde_window_schedule", "sde_window_size >= 1"),
        (dict(sde_window_schedule="fixed", sde_window_max_start=9, **WINDOW), "sde_window_max_start", r"\[0, "),
        (dict(ode_solver_order=2), "ode_solver_order", "sde_window_size >= 1"),
        (dict(ode_solver_order=4, **WINDOW), "ode_solver_order", "DPM"),
        (dict(ode_step_ratio=0.0, **WINDOW), "ode_step_ratio", r"\(0, 1\]"),
        (dict(sde_window_stride=0, **WINDOW), "sde_window_stride", ">= 1"),
        (dict(sde_window_shift_interval=0, **WINDOW), "sde_window_shift_interval", ">= 1"),
        (dict(compile_repeated_blocks=True, compile_backend="inductr"), "compile_backend", "inductor"),
        (dict(ratio_normalization=True, sampler="cps"), "ratio_normalization", r"\('sde', 'dance'\)"),
        (dict(max_steps=-1, num_train_epochs=0), "max_steps", "0 steps"),
        (dict(eval_prompts=["a cat", ""]), r"eval_prompts\[1\]", "empty"),
        (dict(eval_prompts=["a cat", None]), r"eval_prompts\[1\]", "NoneType"),
        (
            dict(per_device_eval_batch_size=0, eval_strategy="steps", eval_steps=1),
            "per_device_eval_batch_size",
            "1 or",
        ),
        (dict(save_steps=0, save_strategy="steps"), "save_steps", "ever be saved.*save_strategy='no'"),
        (dict(jagg_frac=True), "jagg_frac", "not a fraction"),
        (dict(noise_level=1e6), "noise_level", r"diverges.*\(0, 2\.0\]"),
        (dict(noise_level=2.5, sampler="dance"), "noise_level", r"\(0, 2\.0\]"),
        (dict(adam_epsilon=0.0), "adam_epsilon", "positive"),
        (dict(seed=-1), "seed", r"\[0, 2\*\*32\)"),
        (dict(seed=2**32), "seed", r"\[0, 2\*\*32\)"),
        (dict(data_seed=2**32), "data_seed", r"\[0, 2\*\*32\)"),
        (dict(eval_seed=-5), "eval_seed", r"\[0, 2\*\*32\)"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_out_of_range_values_name_the_field(overrides, field, fix):
    with pytest.raises(ValueError, match=rf"GRPOJaggConfig\.{field}.*{fix}"):
        config(**overrides)


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("num_generations", 2.0, "an integer"),  # YAML `num_generations: 2.0`
        ("num_inference_steps", 5.5, "an integer"),
        ("max_steps", [1, 2], "an integer"),
        ("learning_rate", "1e-4", "a number"),  # YAML 1.1 reads `1e-4` (no dot) as a string
        ("use_jagg", 1, "true or false"),
        ("reward_weights", ["1", 2.0], "a list of numbers"),
        ("max_sequence_length", 77.0, "an integer or None"),
    ],
)
def test_wrong_types_are_refused_before_transformers_uses_them(name, value, expected):
    with pytest.raises(TypeError, match=rf"GRPOJaggConfig\.{name} is .*expected {expected}"):
        config(**{name: value})


def test_scalars_where_lists_are_expected_mean_a_list_of_one():
    args = config(eval_prompts="a red circle", reward_weights=2.0)
    assert args.eval_prompts == ["a red circle"]  # not one prompt per character
    assert args.reward_weights == [2.0]


def test_conversational_eval_prompt_becomes_its_user_text():
    args = config(eval_prompts=[[{"role": "system", "content": "be nice"}, {"role": "user", "content": "a cat"}]])
    assert args.eval_prompts == ["a cat"]


@pytest.mark.parametrize(
    ("overrides", "trained"),
    [
        (dict(num_inference_steps=4, jagg_group_size=4), 3),  # all_but_last: 3 steps
        (dict(num_inference_steps=10, train_timesteps="random", train_timestep_fraction=0.3, jagg_group_size=4), 3),
        (dict(num_inference_steps=6, train_timesteps="sde_window", sde_window_size=2, jagg_group_size=3), 2),
    ],
)
def test_group_larger_than_the_trained_steps_warns_with_the_count(overrides, trained):
    with pytest.warns(UserWarning, match=rf"jagg_group_size \({overrides['jagg_group_size']}\) is larger than the "
                      rf"{trained} trained steps.*JAGG stays idle"):  # fmt: skip
        config(**overrides)


def test_group_that_fits_or_jagg_off_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config(num_inference_steps=5, jagg_group_size=4)
        config(num_inference_steps=4, jagg_group_size=4, use_jagg=False)


@pytest.mark.parametrize("value", [0.2, 1e-9])
def test_clip_range_far_from_the_recipes_warns_naming_their_values(value):
    # TRL's token default 0.2 is 2000x the Flow-GRPO recipes' 1e-4.
    with pytest.warns(UserWarning, match=rf"epsilon is {value:g}.*flow-grpo-flux 0.0001.*flow-grpo-fast-flux 1e-05"):
        config(epsilon=value)


def test_clip_ranges_of_the_diffusion_scale_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in (1e-5, 1e-4, 2e-4, 1e-2):
            config(epsilon=value)


def test_valid_config_passes_and_counts_prompts_per_rollout():
    args = config(steps_per_generation=3)
    assert args.prompts_per_rollout == 4 * 3 // 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(ema_decay=0.9, ema_update_interval=8, max_steps=5),
            r"ema_update_interval \(8\) is larger than max_steps",
        ),
        (dict(ema_offload=True), "ema_offload=True does nothing with ema_decay=0"),
    ],
)
def test_ema_settings_that_do_nothing_warn(overrides, message):
    with pytest.warns(UserWarning, match=message):
        config(**overrides)


def test_bounds_themselves_are_accepted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config(noise_level=2.0, seed=2**32 - 1, data_seed=0, adam_epsilon=1e-12, jagg_frac=1)
        config(ema_decay=0.9, ema_update_interval=5, max_steps=5, ema_offload=True, save_steps=1)


@pytest.mark.parametrize("report_to", ["tensorboard", ["none", "tensorboard"]], ids=["str", "list"])
def test_report_to_a_tracker_that_is_not_installed_names_the_package(monkeypatch, report_to):
    # `pip install trl-jagg` installs no tracker: TensorBoard (either of the two packages transformers takes) is made
    # unimportable.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(
        ValueError, match=r"report_to names 'tensorboard', which is not installed.*`pip install tensorboard`"
    ):
        config(report_to=report_to)


def test_report_to_an_installed_tracker_is_accepted(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", sys)  # any importable module stands for the package
    assert config(report_to="tensorboard").report_to == ["tensorboard"]
