"""Settings without effect (trl_jagg/config/rules.py) are refused or warned about, naming the field; the presets, the
demo and the defaults trip none. ``clip_range``, the former name of ``epsilon``, is still accepted with a
FutureWarning."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import yaml

from trl_jagg import GRPOJaggConfig
from trl_jagg.config.rules import RULES, tripped_rules
from trl_jagg.demo.run import demo_config
from trl_jagg.objectives import OBJECTIVES
from trl_jagg.recipes import RECIPES
from trl_jagg.scripts import train

BASE = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, report_to="none")
WINDOW = dict(train_timesteps="sde_window", sde_window_size=2, jagg_group_size=2)  # one full JAGG group
OFF_POLICY = dict(steps_per_generation=2)  # two micro-batches per rollout, one per optimizer step


def config(**overrides) -> GRPOJaggConfig:
    return GRPOJaggConfig(**{**BASE, **overrides})


# (field, the settings under which it has no effect, refused or warned): each a setting of the list or of
# a field that acts only under a condition.
def _other_value(default):
    """A value of the default's type other than the default (its range is checked only under its objective)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default * 2 + 1
    return f"{default}-other"


_DEFAULTS = {item.name: item.default for item in dataclasses.fields(GRPOJaggConfig)}
# Each objective's own fields, set under another objective: refused.
OBJECTIVE_FIELDS = [
    (name, {name: _other_value(_DEFAULTS[name]), **({} if spec.name != "grpo" else {"objective": "nft"})}, "refuse")
    for spec in OBJECTIVES.values()
    for name in spec.fields
]
NO_EFFECT = [
    *OBJECTIVE_FIELDS,
    ("nft_beta", dict(nft_beta=0.1), "refuse"),
    ("negative_prompt", dict(negative_prompt="blurry", guidance_scale=1.0), "warn"),
    ("guidance_scale_2", dict(guidance_scale_2=3.0, guidance_scale=1.0), "warn"),  # Wan2.2 runs no CFG at all
    ("train_timestep_fraction", dict(train_timestep_fraction=0.3), "warn"),  # train_timesteps='all_but_last'
    ("sde_window_schedule", dict(sde_window_schedule="fixed"), "refuse"),
    ("ode_solver_order", dict(ode_solver_order=2), "refuse"),
    ("ode_step_ratio", dict(ode_step_ratio=0.5), "refuse"),
    ("sde_window_max_start", dict(sde_window_max_start=1), "refuse"),  # without a window
    ("sde_window_stride", dict(sde_window_stride=2), "refuse"),  # without a window
    ("sde_window_shift_interval", dict(sde_window_shift_interval=5), "refuse"),  # without a window
    ("sde_window_stride", dict(sde_window_stride=2, **WINDOW), "refuse"),  # the random schedule
    ("sde_window_shift_interval", dict(sde_window_shift_interval=5, **WINDOW), "refuse"),  # the random schedule
    # progressive, max start 2: a stride of 3 goes back to step 0 at once
    (
        "sde_window_stride",
        dict(sde_window_stride=3, sde_window_schedule="progressive", sde_window_max_start=2, **WINDOW),
        "refuse",
    ),  # fmt: skip
    # 5 optimizer steps of one rollout each: the window would shift after the 10th rollout
    (
        "sde_window_shift_interval",
        dict(sde_window_shift_interval=10, sde_window_schedule="progressive", max_steps=5, **WINDOW),
        "warn",
    ),  # fmt: skip
    ("advantage_std_ddof", dict(advantage_std_ddof=0, scale_rewards="none"), "warn"),
    ("advantage_eps", dict(advantage_eps=1e-8, scale_rewards="none"), "warn"),
    ("stat_tracking_buffer_size", dict(stat_tracking_buffer_size=16), "warn"),
    ("ema_update_interval", dict(ema_decay=0.9, ema_update_interval=8, max_steps=5), "warn"),
    ("ema_update_interval", dict(ema_update_interval=8), "warn"),  # no EMA
    ("ema_offload", dict(ema_offload=True), "warn"),
    ("ema_schedule", dict(ema_schedule="flow_grpo"), "warn"),
    ("ema_warmup", dict(ema_warmup=True), "warn"),
    ("jagg_cache_mode", dict(jagg_cache_mode="corrected", use_jagg=False, **OFF_POLICY), "warn"),
    ("jagg_cache_mode", dict(jagg_cache_mode="corrected", jagg_cache_velocities=False, **OFF_POLICY), "warn"),
    ("jagg_cache_mode", dict(jagg_cache_mode="stale"), "warn"),  # on-policy: no optimizer step since the rollout
    ("jagg_cache_tolerance", dict(jagg_cache_tolerance=1e-2, jagg_cache_mode="corrected", **OFF_POLICY), "warn"),
    ("jagg_cache_tolerance", dict(jagg_cache_tolerance=1e-2), "warn"),  # 'recompute', the default
    ("jagg_probe_steps", dict(jagg_probe_steps=10), "warn"),
    ("jagg_cos_threshold", dict(jagg_cos_threshold=0.5), "warn"),
    ("compile_backend", dict(compile_backend="aot_eager"), "warn"),
    ("image_log_steps", dict(image_log_steps=5), "warn"),
    ("num_completions_to_print", dict(num_completions_to_print=4), "warn"),
    (
        "gradient_checkpointing_kwargs",
        dict(
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"every_n_layers": 2},
            gradient_checkpointing_kwargs={"every_n_layers": 3},
        ),
        "refuse",
    ),  # fmt: skip
    ("gradient_checkpointing", dict(activation_checkpointing=True, gradient_checkpointing=False), "refuse"),
]


def _label(case):
    name, overrides, _ = case
    return f"{name}-" + "-".join(k for k in overrides if k != name)


@pytest.mark.parametrize(("name", "overrides", "kind"), NO_EFFECT, ids=[_label(c) for c in NO_EFFECT])
def test_a_setting_without_effect_is_refused_or_warned_naming_the_field(name, overrides, kind):
    if kind == "refuse":
        with pytest.raises(ValueError, match=rf"GRPOJaggConfig\.{name}\b"):
            config(**overrides)
    else:
        with pytest.warns(UserWarning, match=rf"GRPOJaggConfig\.{name}\b"):
            config(**overrides)


def test_the_warning_points_at_the_users_call():
    with pytest.warns(UserWarning, match="ema_offload") as record:
        GRPOJaggConfig(**BASE, ema_offload=True)
    assert [warning.filename for warning in record] == [__file__]


def test_every_rule_of_the_table_is_tried():
    """Each example, set on a config built with the field at its default, trips a rule of its field; together they
    trip every rule of the table (a new rule needs an example above)."""
    tried = set()
    for name, overrides, _ in NO_EFFECT:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = config(**{k: v for k, v in overrides.items() if k != name})
        setattr(args, name, overrides[name])
        tripped = tripped_rules(args)
        assert [rule.field for rule in tripped][:1] == [name], (name, overrides)
        tried.update(id(rule) for rule in tripped)
    missing = [(rule.field, rule.condition) for rule in RULES if id(rule) not in tried]
    assert missing == []


@pytest.mark.parametrize(
    "overrides",
    [
        dict(nft_beta=0.1, objective="nft"),
        dict(sde_window_stride=2, sde_window_shift_interval=5, sde_window_schedule="progressive", **WINDOW),
        dict(sde_window_shift_interval=4, sde_window_schedule="progressive", max_steps=5, **WINDOW),
        dict(jagg_cache_mode="checked", jagg_cache_tolerance=1e-2, **OFF_POLICY),
        dict(jagg_cache_mode="corrected", num_iterations=2),
        dict(jagg_frac="auto", jagg_probe_steps=10, jagg_cos_threshold=0.5),
        dict(ema_decay=0.9, ema_update_interval=5, max_steps=5, ema_offload=True, ema_warmup=True),
        dict(stat_tracking_buffer_size=16, per_prompt_stat_tracking=True),
        dict(negative_prompt="blurry", true_cfg_scale=4.0, guidance_scale=1.0),
        dict(guidance_scale_2=3.0, guidance_scale=4.0),
        dict(train_timestep_fraction=0.5, train_timesteps="random"),
        dict(image_log_steps=5, eval_prompts=["a cat"]),
        dict(num_completions_to_print=4, log_completions=True),
        dict(gradient_checkpointing=True),  # the alias alone is transformers' to resolve
    ],
    ids=lambda overrides: "-".join(overrides),
)
def test_the_same_settings_where_they_act_are_accepted_in_silence(overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        args = config(**overrides)
    assert tripped_rules(args) == []


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_no_preset_trips_a_rule(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)  # a deprecated preset says so
        args = GRPOJaggConfig.from_recipe(name, output_dir="unused", report_to="none")
    assert tripped_rules(args) == []


def test_the_defaults_and_the_demo_trip_no_rule(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        configs = [config(), *(demo_config(str(tmp_path), steps=3, seed=0, use_jagg=on) for on in (True, False))]
    assert [tripped_rules(args) for args in configs] == [[], [], []]


# ---------------------------------------------------------------- clip_range, the former name of epsilon
def test_clip_range_sets_epsilon_with_a_future_warning_naming_it():
    with pytest.warns(FutureWarning, match=r"GRPOJaggConfig\.clip_range is deprecated.*Use epsilon=0\.0002"):
        args = config(clip_range=2e-4)
    assert (args.epsilon, args.clip_range) == (2e-4, 2e-4)
    assert "clip_range" not in args.to_dict() and args.to_dict()["epsilon"] == 2e-4  # one name in the trackers


def test_clip_range_reads_epsilon_and_refuses_another_value():
    args = config(epsilon=3e-4)
    assert args.clip_range == 3e-4
    args.clip_range = 3e-4  # a copy that sets every field (training_args.bin's redaction) sets the same value
    with pytest.raises(AttributeError, match="Set epsilon instead"):
        args.clip_range = 1e-3
    assert args.epsilon == 3e-4


def test_clip_range_and_a_different_epsilon_are_refused():
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=r"clip_range is 0\.0002 and epsilon is 0\.0003"):
        config(clip_range=2e-4, epsilon=3e-4)


def test_clip_range_as_a_flag_and_a_yaml_key_sets_epsilon(tmp_path):
    base = ["--model_name_or_path", "x", "--reward_funcs", "prompt_color", "--prompts", "p"]
    with pytest.warns(FutureWarning, match="Use epsilon=0.0002"):
        _, args = train.parse_train_args([*base, "--clip_range", "2e-4"])
    assert args.epsilon == 2e-4
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"clip_range": 3e-4}))
    with pytest.warns(FutureWarning, match="Use epsilon=0.0003"):
        _, args = train.parse_train_args([*base, "--config", str(path)])
    assert args.epsilon == 3e-4
