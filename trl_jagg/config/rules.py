"""Settings without effect: one table of the fields that act only under a condition, read by
``GRPOJaggConfig.__post_init__``. A field given a value other than its default where it does nothing is refused or
warned about, with a message naming the field, the condition under which it acts and the fix; a default value never
trips a rule.

Refused (a ``ValueError``), as the library refuses GRPO-only settings with ``objective="nft"``: a setting of a mode
the run does not use (DiffusionNFT's fields under GRPO, the SDE window's options without a window or with a schedule
that ignores them, an alias that transformers would drop in favour of the other name). Warned (a ``UserWarning``), as
``ema_offload`` without an EMA and ``cfg_gradient`` without CFG are: a sub-setting of a feature that is switched off,
or a run too short for it to act.

``use_jagg=False`` and ``jagg_mode="exact"`` are ablation switches: the grouping settings (``jagg_group_size``,
``jagg_frac``, ``jagg_mode``, ``jagg_endpoint_backward``, ``no_grad_batch_steps``) stay silent under them, so that one
flag turns a JAGG config into its exact baseline (the demo and the benchmarks do this). Settings whose effect depends
on the model (``train_experts``, ``guidance_scale_2``, ``num_frames``, ``source_image_area``, ``cfg_gradient``) are
checked where the model is known, by the trainer. ``eval_num_inference_steps`` and ``eval_seed`` act whenever
evaluation images are sampled, which ``trainer.evaluate()`` may do at any time: no rule. ``kl_std`` is a convention the presets carry with ``beta=0`` so
that a KL added on top is their peer's: silent without a KL."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trl_jagg.config.objective_registry import OBJECTIVES, get_objective
from trl_jagg.config.reporting import warn_user
from trl_jagg.core.sde_window import default_max_start


@dataclass(frozen=True)
class Rule:
    """A field that acts only under a condition.

    Attributes:
        field: the field's name.
        acts: whether the field acts in a config (the rule trips when it does not and the field is not its default).
        condition: when it acts, in words after "it acts only" (e.g. ``"with objective='nft'"``).
        context: the fields whose values the message shows.
        fix: what to do, a sentence.
        refuse: a ``ValueError`` (True) or a ``UserWarning``.
        message: the whole message from the config, where it predates this table (kept word for word).
    """

    field: str
    acts: Callable[[Any], bool]
    condition: str
    context: tuple[str, ...]
    fix: str
    refuse: bool = False
    message: Callable[[Any], str] | None = None

    def explain(self, config: Any) -> str:
        """The message for ``config``, where the field does not act."""
        if self.message is not None:
            return self.message(config)
        shown = ", ".join(f"{name}={getattr(config, name)!r}" for name in self.context)
        return (
            f"GRPOJaggConfig.{self.field} is {getattr(config, self.field)!r} with {shown}: it acts only "
            f"{self.condition}. {self.fix}"
        )


def _window_max_start(config: Any) -> int:
    if config.sde_window_max_start is not None:
        return config.sde_window_max_start
    return default_max_start(config.sde_window_schedule, config.num_inference_steps, config.sde_window_size)


def _rollouts(config: Any) -> int | None:
    """Rollouts the run samples (a rollout every ``steps_per_generation x num_iterations`` micro-batches), or
    ``None`` where unknown before the processes are (``generation_batch_size`` given, or a run counted in epochs)."""
    if config.max_steps <= 0 or (config.steps_per_generation is None and config.generation_batch_size is not None):
        return None
    per_rollout = (config.steps_per_generation or config.gradient_accumulation_steps) * config.num_iterations
    return math.ceil(config.max_steps * config.gradient_accumulation_steps / per_rollout)


def _window_slides(config: Any) -> bool:
    rollouts = _rollouts(config)
    return rollouts is None or rollouts > config.sde_window_shift_interval


def _updates_after_an_optimizer_step(config: Any) -> bool:
    """A rollout's micro-batches may be trained after an optimizer step since it was sampled (off-policy); assumed
    where unknown before the processes are (``generation_batch_size`` given)."""
    if config.num_iterations > 1 or (config.steps_per_generation is None and config.generation_batch_size is not None):
        return True
    return (config.steps_per_generation or config.gradient_accumulation_steps) > config.gradient_accumulation_steps


def _cache_corrects(config: Any) -> bool:
    return (
        config.use_jagg
        and config.jagg_cache_velocities
        and config.jagg_mode != "exact"
        and config.jagg_frac != 0
        and _updates_after_an_optimizer_step(config)
    )


def _without_window(name: str) -> Callable[[Any], str]:
    return lambda config: (
        f"GRPOJaggConfig.{name} is {getattr(config, name)!r} without an SDE window (sde_window_size=0). It acts on "
        "the SDE window and the ODE steps around it: set sde_window_size >= 1 (with train_timesteps='sde_window'), "
        "or leave it at its default."
    )


def _window_rule(name: str, acts: Callable[[Any], bool] | None = None, also: str = "") -> Rule:
    """An option of the SDE window, which does nothing without one."""
    return Rule(
        name,
        acts or (lambda config: config.sde_window_size > 0),
        f"with an SDE window (sde_window_size >= 1){also}",
        ("sde_window_size",),
        "",
        refuse=True,
        message=_without_window(name),
    )


def _progressive(name: str, what: str) -> Rule:
    return Rule(
        name,
        lambda config: config.sde_window_size == 0 or config.sde_window_schedule == "progressive",
        "with sde_window_schedule='progressive'",
        ("sde_window_schedule",),
        f"It sets how the progressive window {what}: use sde_window_schedule='progressive', or leave it at its "
        "default.",
        refuse=True,
    )


RULES: tuple[Rule, ...] = (
    # ---- the objectives' own fields (the registry says whose)
    *(
        Rule(
            name,
            lambda config, spec=spec: get_objective(config.objective) is spec,
            f"with objective={spec.name!r}",
            ("objective",),
            f"It is {spec.title}'s: set objective={spec.name!r}, or leave {name} at its default.",
            refuse=True,
        )
        for spec in OBJECTIVES.values()
        for name in spec.fields
    ),
    # ---- sampling and the trained steps
    Rule(
        "negative_prompt",
        lambda config: config.guidance_scale > 1 or config.true_cfg_scale > 1,
        "with classifier-free guidance (guidance_scale > 1 for a CFG model, or true_cfg_scale > 1)",
        ("guidance_scale", "true_cfg_scale"),
        "Turn guidance on, or drop negative_prompt.",
    ),
    Rule(
        "guidance_scale_2",
        lambda config: config.guidance_scale > 1,
        "with classifier-free guidance on (guidance_scale > 1), as Wan2.2's pipeline runs it",
        ("guidance_scale",),
        "Set guidance_scale > 1, or drop guidance_scale_2.",
    ),
    Rule(
        "train_timestep_fraction",
        lambda config: (
            config.train_timesteps in ("random", "random_but_last")
            or "train_timestep_fraction" in get_objective(config.objective).also_reads
        ),
        "with train_timesteps 'random' or 'random_but_last' (or objective='nft')",
        ("train_timesteps",),
        "Use train_timesteps='random' or 'random_but_last', or leave train_timestep_fraction at its default.",
    ),
    _window_rule("sde_window_schedule"),
    # A deterministic rollout (DiffusionNFT, AWM, DGPO) is all ODE: its solver order acts on every step.
    _window_rule(
        "ode_solver_order",
        lambda config: config.sde_window_size > 0 or get_objective(config.objective).deterministic_rollout,
        " or with an objective whose rollout is a deterministic ODE (nft, awm, dgpo)",
    ),
    _window_rule("ode_step_ratio"),
    _window_rule("sde_window_max_start"),
    _window_rule("sde_window_stride"),
    _window_rule("sde_window_shift_interval"),
    _progressive("sde_window_stride", "moves"),
    _progressive("sde_window_shift_interval", "moves"),
    Rule(
        "sde_window_stride",
        lambda config: (
            config.sde_window_schedule != "progressive" or config.sde_window_stride <= _window_max_start(config)
        ),
        "when it is at most the window's max start (sde_window_max_start, or its default for the schedule): a "
        "longer stride goes back to step 0 at once and the window never moves",
        ("sde_window_schedule", "sde_window_max_start"),
        "Use a stride <= the max start, or sde_window_schedule='fixed'.",
        refuse=True,
    ),
    Rule(
        "sde_window_shift_interval",
        lambda config: config.sde_window_schedule != "progressive" or _window_slides(config),
        "when the run samples more rollouts than the interval (max_steps x gradient_accumulation_steps / "
        "(steps_per_generation x num_iterations)): the window never moves in a shorter run",
        ("max_steps", "steps_per_generation", "gradient_accumulation_steps", "num_iterations"),
        "Use an interval shorter than the run's rollouts, or more max_steps.",
    ),
    # ---- the policy loss and the advantages
    *(
        Rule(
            name,
            lambda config: config.scale_rewards != "none",
            "when the advantages are scaled by a std (scale_rewards 'group' or 'batch')",
            ("scale_rewards",),
            f"Use scale_rewards 'group' or 'batch', or leave {name} at its default.",
        )
        for name in ("advantage_std_ddof", "advantage_eps")
    ),
    Rule(
        "stat_tracking_buffer_size",
        lambda config: config.per_prompt_stat_tracking,
        "with per_prompt_stat_tracking=True",
        ("per_prompt_stat_tracking",),
        "Turn the stat tracker on, or drop stat_tracking_buffer_size.",
    ),
    # ---- the EMA
    Rule(
        "ema_update_interval",
        lambda config: config.ema_decay == 0 or not 0 < config.max_steps < config.ema_update_interval,
        "when it is at most max_steps",
        ("max_steps",),
        "",
        message=lambda config: (
            f"GRPOJaggConfig.ema_update_interval ({config.ema_update_interval}) is larger than max_steps "
            f"({config.max_steps}): the EMA is never updated and stays the initial weights. Use an interval <= "
            "max_steps, or ema_decay=0."
        ),
    ),
    Rule(
        "ema_offload",
        lambda config: config.ema_decay > 0,
        "with an EMA (ema_decay > 0)",
        ("ema_decay",),
        "",
        message=lambda config: (
            "GRPOJaggConfig.ema_offload=True does nothing with ema_decay=0 (no EMA is kept). Set ema_decay > 0 "
            "(0.995 in DanceGRPO), or drop ema_offload."
        ),
    ),
    *(
        Rule(
            name,
            lambda config: config.ema_decay > 0,
            "with an EMA (ema_decay > 0)",
            ("ema_decay",),
            f"Set ema_decay > 0 (0.995 in DanceGRPO), or drop {name}.",
        )
        for name in ("ema_update_interval", "ema_schedule", "ema_warmup")
    ),
    # ---- JAGG's velocity cache and routing probe
    Rule(
        "jagg_cache_mode",
        _cache_corrects,
        "when cached velocities are used after an optimizer step since their rollout: use_jagg=True, "
        "jagg_cache_velocities=True, jagg_mode other than 'exact', jagg_frac > 0, and steps_per_generation > "
        "gradient_accumulation_steps or num_iterations > 1",
        (
            "use_jagg",
            "jagg_cache_velocities",
            "jagg_mode",
            "jagg_frac",
            "steps_per_generation",
            "gradient_accumulation_steps",
            "num_iterations",
        ),
        "Change the setting it depends on, or leave jagg_cache_mode at its default ('recompute').",
    ),
    Rule(
        "jagg_cache_tolerance",
        lambda config: config.jagg_cache_mode == "checked" and _cache_corrects(config),
        "with jagg_cache_mode='checked' (and a cache that acts, see jagg_cache_mode)",
        ("jagg_cache_mode",),
        "Use jagg_cache_mode='checked', or leave jagg_cache_tolerance at its default.",
    ),
    *(
        Rule(
            name,
            lambda config: config.jagg_frac == "auto",
            "with jagg_frac='auto' (the routing probe)",
            ("jagg_frac",),
            f"Set jagg_frac='auto', or leave {name} at its default.",
        )
        for name in ("jagg_probe_steps", "jagg_cos_threshold")
    ),
    # ---- speed, evaluation
    Rule(
        "compile_backend",
        lambda config: config.compile_repeated_blocks,
        "with compile_repeated_blocks=True",
        ("compile_repeated_blocks",),
        "Set compile_repeated_blocks=True, or drop compile_backend.",
    ),
    Rule(
        "image_log_steps",
        lambda config: bool(config.eval_prompts),
        "with eval_prompts (the prompts it renders)",
        ("eval_prompts",),
        "Give eval_prompts, or set image_log_steps=0.",
    ),
    Rule(
        "num_completions_to_print",
        lambda config: config.log_completions,
        "with log_completions=True",
        ("log_completions",),
        "Set log_completions=True, or drop num_completions_to_print.",
    ),
    # ---- transformers' deprecated aliases: given beside the new name, transformers drops them silently
    *(
        Rule(
            old,
            lambda config, new=new, old=old: (
                getattr(config, new) is None or getattr(config, new) == getattr(config, old)
            ),
            f"without {new} (it is transformers' former name of {new}, used only when {new} is not given)",
            (new,),
            f"Give only {new}.",
            refuse=True,
        )
        for old, new in (
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
            ("gradient_checkpointing", "activation_checkpointing"),
        )
    ),
)
"""Every field that acts only under a condition, in the order the config checks them."""


def _is_default(config: Any, name: str) -> bool:
    item = next(item for item in dataclasses.fields(config) if item.name == name)
    default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
    return getattr(config, name) == default


def tripped_rules(config: Any) -> list[Rule]:
    """The rules ``config`` trips: a field other than its default under a condition where it does nothing."""
    return [rule for rule in RULES if not _is_default(config, rule.field) and not rule.acts(config)]


def check_settings_without_effect(config: Any) -> None:
    """Refuse or warn about each setting of ``config`` that has no effect (before transformers resolves its
    aliases: it would drop the one it does not use)."""
    for rule in tripped_rules(config):
        if rule.refuse:
            raise ValueError(rule.explain(config))
        warn_user(rule.explain(config))
