"""The checks of :class:`~trl_jagg.GRPOJaggConfig` that span its groups or concern the fields it inherits from
``TrainingArguments``: the types and finiteness of every field, the run's length, seeds, saves and optimizer, the
trackers, activation checkpointing as diffusers takes it, and the generation batch derived from the others (run by
``GRPOJaggConfig.__post_init__``; each field group checks its own fields)."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
import typing

from transformers import TrainingArguments

from trl_jagg.config.field_types import type_problem
from trl_jagg.config.policy_loss import FormerName
from trl_jagg.config.reporting import fail


def check_types_and_finiteness(config: TrainingArguments) -> None:
    """Every field given a value other than its default has its annotated type (the types the CLI flags
    convert to; YAML values reach the dataclass unconverted), and every float is finite (``nan < 0`` is
    false, so a NaN passes any range check)."""
    hints = typing.get_type_hints(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if not item.init or value is item.default or (type(value) is type(item.default) and value == item.default):
            continue
        if isinstance(getattr(type(config), item.name, None), FormerName):  # read, it is the renamed field
            continue
        problem = None if item.name in type(config)._types_checked_later else type_problem(value, hints[item.name])
        if problem is not None:
            raise TypeError(f"GRPOJaggConfig.{item.name} is {value!r} ({type(value).__name__}); expected {problem}.")
        values = value if isinstance(value, (list, tuple)) else [value]
        for number in values:
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"GRPOJaggConfig.{item.name} is {value!r}. Use a finite number.")
    fsdp = config.fsdp
    if not (
        fsdp is None
        or isinstance(fsdp, (bool, str))
        or (isinstance(fsdp, list) and all(isinstance(o, str) for o in fsdp))
    ):
        # transformers takes any truthy value as "FSDP on".
        raise TypeError(
            f"GRPOJaggConfig.fsdp is {fsdp!r} ({type(fsdp).__name__}); expected true or false, or a string of "
            "FSDP options ('full_shard auto_wrap')."
        )
    # Before `_resolve_generation_batch` divides by them, and before the multiple-of-G check, which 0 passes.
    # per_device_eval_batch_size too: 0 would stop the first evaluation, which runs before that step's save.
    names = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    for name in (*names, "steps_per_generation"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ValueError(f"GRPOJaggConfig.{name} is {value}. Use 1 or more.")


def check_training_arguments(config: TrainingArguments) -> None:
    """The inherited ``TrainingArguments`` fields this library relies on: the output directory, the length of the
    run, the seeds, the save interval and the optimizer's settings (transformers would accept them and fail later,
    or never)."""
    check_trackers_installed(config)
    if config.output_dir is not None and os.path.isfile(config.output_dir):
        fail(
            "output_dir",
            f"{config.output_dir} is a file",
            "Checkpoints and weights need a directory: use another path.",
        )
    if config.max_steps <= 0 and config.num_train_epochs <= 0:
        fail(
            "max_steps",
            f"is {config.max_steps} with num_train_epochs={config.num_train_epochs}: the run would train 0 steps",
            "Set max_steps > 0 or num_train_epochs > 0.",
        )
    _check_optimizer(config)
    for name in ("seed", "data_seed", "eval_seed"):
        value = getattr(config, name)
        if value is not None and not 0 <= value < 2**32:
            fail(name, f"is {value}", "Use a seed in [0, 2**32) (numpy's seeds are 32-bit).")
    if config.save_strategy == "steps" and not config.save_steps > 0:
        fail(
            "save_steps",
            f"is {config.save_steps} with save_strategy='steps': no checkpoint would ever be saved",
            "Use a positive interval, or save_strategy='no'.",
        )


def _check_optimizer(config: TrainingArguments) -> None:
    if config.learning_rate < 0:
        fail("learning_rate", f"is {config.learning_rate}", "Use a value >= 0 (1e-4 for LoRA is typical).")
    for name in ("weight_decay", "max_grad_norm"):
        if getattr(config, name) < 0:
            fail(name, f"is {getattr(config, name)}", "Use a value >= 0.")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(config, name) < 1:
            fail(name, f"is {getattr(config, name)}", "Use a value in [0, 1).")
    if not config.adam_epsilon > 0:
        # Adam divides by sqrt(v) + epsilon: a parameter whose gradient is 0 would become 0 / 0.
        fail("adam_epsilon", f"is {config.adam_epsilon}", "Use a positive value (1e-8, the default).")


def check_activation_checkpointing(config: TrainingArguments) -> None:
    """``activation_checkpointing_kwargs`` (transformers' field; ``gradient_checkpointing_kwargs`` is its alias) as
    diffusers backbones take it: ``every_n_layers``, a positive integer, checkpoints every n-th transformer block
    (``use_reentrant=False`` is accepted: it is what diffusers runs). Checked once transformers has parsed the field
    and resolved the alias."""
    kwargs = config.activation_checkpointing_kwargs or {}
    name = "activation_checkpointing_kwargs"
    if not isinstance(kwargs, dict):
        raise ValueError(f'GRPOJaggConfig.{name} is {kwargs!r}. Use a dict such as {{"every_n_layers": 2}}.')
    unknown = sorted(set(kwargs) - {"every_n_layers", "use_reentrant"})
    if unknown or kwargs.get("use_reentrant", False):
        raise ValueError(
            f"GRPOJaggConfig.{name} is {kwargs!r}: diffusers backbones take only `every_n_layers` (and "
            "`use_reentrant=False`, which they always run). Remove the other keys."
        )
    every = kwargs.get("every_n_layers", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"GRPOJaggConfig.{name}['every_n_layers'] is {every!r}. Use a positive integer: 1 checkpoints every "
            "transformer block, k every k-th."
        )
    if every > 1 and not config.activation_checkpointing:
        raise ValueError(
            f"GRPOJaggConfig.{name}['every_n_layers'] is {every} without activation checkpointing. Set "
            "activation_checkpointing=True (or gradient_checkpointing=True), or remove it."
        )


TRACKER_MODULES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
    "mlflow": (("mlflow",), "mlflow"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "clearml": (("clearml",), "clearml"),
    "neptune": (("neptune",), "neptune"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "codecarbon": (("codecarbon",), "codecarbon"),
}
"""``report_to`` name -> (the modules transformers' callback imports, any one will do; the package to install). The
trackers are optional dependencies: ``pip install trl-jagg`` installs none of them."""


def module_installed(name: str) -> bool:
    """``name`` can be imported (a module set to ``None`` in ``sys.modules`` is one whose import fails)."""
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def check_trackers_installed(config: TrainingArguments) -> None:
    """Every tracker named in ``report_to`` is installed; otherwise the error names the package to install (the
    Trainer would stop later, with a message about the PyTorch version for TensorBoard)."""
    names = [config.report_to] if isinstance(config.report_to, str) else list(config.report_to or [])
    for name in names:
        modules, package = TRACKER_MODULES.get(name, ((), ""))
        if modules and not any(module_installed(module) for module in modules):
            raise ValueError(
                f"GRPOJaggConfig.report_to names {name!r}, which is not installed. Install it (`pip install "
                f"{package}`), or leave it out of report_to (report_to='none' logs to the console only)."
            )


def resolve_generation_batch(config: TrainingArguments) -> None:
    """``steps_per_generation`` and ``generation_batch_size`` from whichever is set, as TRL's GRPOConfig."""
    per_step = config.per_device_train_batch_size * config.world_size
    if config.generation_batch_size is None:
        if config.steps_per_generation is None:
            config.steps_per_generation = config.gradient_accumulation_steps
        config.generation_batch_size = per_step * config.steps_per_generation
    elif config.generation_batch_size < 1 or config.generation_batch_size % per_step:
        raise ValueError(
            f"GRPOJaggConfig.generation_batch_size ({config.generation_batch_size}) is not a positive multiple of "
            f"per_device_train_batch_size ({config.per_device_train_batch_size}) x processes ({config.world_size}) "
            f"= {per_step}. Use a multiple, or set steps_per_generation instead."
        )
    steps = config.generation_batch_size // per_step
    if config.steps_per_generation is not None and config.steps_per_generation != steps:
        raise ValueError(
            f"GRPOJaggConfig.generation_batch_size ({config.generation_batch_size}) and steps_per_generation "
            f"({config.steps_per_generation}) disagree: {config.generation_batch_size} images are {steps} "
            f"micro-batches of {per_step}. Set only one of them."
        )
    config.steps_per_generation = steps
    if config.generation_batch_size % config.num_generations:
        raise ValueError(
            f"GRPOJaggConfig.per_device_train_batch_size ({config.per_device_train_batch_size}) x processes "
            f"({config.world_size}) x steps_per_generation ({config.steps_per_generation}) = generation_batch_size "
            f"{config.generation_batch_size} is not a multiple of num_generations ({config.num_generations}). "
            "Choose sizes that make whole prompt groups."
        )
