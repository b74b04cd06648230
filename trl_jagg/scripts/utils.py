"""What every ``trl-jagg`` command shares: one argument parser (a :class:`trl.TrlParser` over dataclasses), the
``--config`` YAML file, and errors that name the field and the fix."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from trl import TrlParser

from trl_jagg.config.field_types import type_problem
from trl_jagg.scripts import PROG

TRL_NAMES: Mapping[str, str] = {
    "max_prompt_length": "max_sequence_length",
    "generation_kwargs": "guidance_scale, true_cfg_scale, negative_prompt, num_inference_steps",
    "temperature": "noise_level",
    "model_init_kwargs": "dtype, model_revision",
}
"""Fields of TRL's ``GRPOConfig`` / ``trl grpo`` that trl_jagg spells differently, with the name to use instead.
The names TRL and trl_jagg share (``epsilon``, ``epsilon_high``, ``beta``, ``num_generations``, ``scale_rewards``,
``generation_batch_size``, ``steps_per_generation``, ``log_completions``, ``reward_weights``, ...) are fields."""


OTHER_NAMES: Mapping[str, str] = {
    # diffusers' training scripts (train_dreambooth_lora_flux.py and its siblings)
    "mixed_precision": "use --bf16 true or --fp16 true (autocast over float32 trained weights); `dtype` sets the "
    "frozen modules' dtype",
    "checkpointing_steps": "use save_steps",
    "checkpoints_total_limit": "use save_total_limit",
    "rank": "use lora_r (with use_peft true)",
    "lora_rank": "use lora_r (with use_peft true)",
    "lora_layers": "use lora_target_modules",
    "resolution": "use height and width",
    "use_dora": "DoRA is not supported: trl-jagg train trains plain LoRA (lora_r, lora_alpha, lora_target_modules)",
    "train_batch_size": "use per_device_train_batch_size (images per process per micro-batch; with "
    "num_generations images per prompt)",
    "max_train_steps": "use max_steps",
    "pretrained_model_name_or_path": "use model_name_or_path",
    "revision": "use model_revision",
    "lr_scheduler": "use lr_scheduler_type",
    "lr_warmup_steps": "use warmup_steps",
    "adam_weight_decay": "use weight_decay",
    "use_8bit_adam": "use --optim adamw_bnb_8bit",
    "allow_tf32": "use tf32",
    "use_ema": "use ema_decay (a decay > 0 keeps an EMA of the trained weights)",
    "validation_prompt": "use eval_prompts (rendered every image_log_steps)",
    "instance_prompt": "use prompts (a list of training prompts) or dataset_name",
    # TRL's and peft's
    "dataset": "use dataset_name (a Hub dataset id or a local file of prompts)",
    "peft_config": "use use_peft true with lora_r, lora_alpha, lora_target_modules",
    "lora_rank_pattern": "not supported on the command line: build a peft LoraConfig in Python",
}
"""Names of diffusers' training-script flags and other TRL / peft spellings that are no field here, with what to use;
the "did you mean" hint of an unknown name (difflib's nearest name is often wrong for them: ``mixed_precision`` is
not ``model_revision``)."""


TRL_ALIASES: Mapping[str, str] = {"torch_dtype": "dtype", "dataset_split": "dataset_train_split"}
"""Other names of a field: transformers' former ``torch_dtype`` (in ``trl grpo`` configs) and trl_jagg's former
``dataset_split``; renamed to the field before parsing, in the YAML and on the command line."""


def _attention(value: Any) -> str | None:
    if value in (None, "sdpa"):
        return None
    return (
        f"is {value!r}, a transformers attention implementation; diffusers backbones run PyTorch's "
        "scaled_dot_product_attention ('sdpa', accepted) and choose other kernels with "
        "`transformer.set_attention_backend(...)`, not from this config. Remove the key or set it to sdpa."
    )


def _token_level(name: str, meaning: str) -> Callable[[Any], str]:
    return lambda value: (
        f"is {value!r}: {meaning} has no meaning for images, whose step log-prob is a mean over latent dimensions "
        f"and whose loss is the mean of the per-step PPO losses (Flow-GRPO's). Remove {name} from the config."
    )


TRL_ONLY: Mapping[str, Callable[[Any], str | None]] = {
    "attn_implementation": _attention,
    "loss_type": _token_level("loss_type", "a token-level loss aggregation (grpo, dr_grpo, dapo, bnpo, ...)"),
    "importance_sampling_level": _token_level(
        "importance_sampling_level", "choosing token- or sequence-level importance ratios"
    ),
}
"""Keys of ``trl grpo`` configs that are no field here: each maps a value to why it is refused, or to ``None``
when the value is what trl_jagg does anyway (then the key is dropped)."""

TRL_VALUES: Mapping[str, Callable[[Any], str | None]] = {
    "dtype": lambda value: (
        "is 'auto', which transformers resolves from the checkpoint; diffusers pipelines have no 'auto' dtype. "
        "Name it: bfloat16 (as the recipes), float16 or float32."
        if value == "auto"
        else None
    ),
}
"""Values ``trl grpo`` accepts that a field here refuses, with the reason (checked before parsing)."""


class UsageError(ValueError):
    """A problem with the command line or the YAML config: reported as ``trl-jagg <command>: error: ...``."""


def suggest(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest valid name (difflib), TRL's or a diffusers script's equivalent, or an
    empty string."""
    name = name.replace("-", "_")
    if name in TRL_NAMES:
        return f" TRL's GRPOConfig calls it '{name}'; here use {TRL_NAMES[name]}."
    if name in OTHER_NAMES:
        return f" '{name}' is a diffusers-script / TRL name: {OTHER_NAMES[name]}."
    close = difflib.get_close_matches(name, sorted(set(valid)), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def own_fields(cls: type) -> set[str]:
    """Fields a dataclass declares itself or through its field-group mixins, not those it inherits from
    ``TrainingArguments``: GRPOJaggConfig's own fields (``config_groups`` included) vs the Trainer's."""
    from transformers import TrainingArguments

    own = [klass for klass in cls.__mro__ if not issubclass(TrainingArguments, klass)]
    return {name for klass in own for name in klass.__dict__.get("__annotations__", {})}


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` on the command line (last one wins), ``None`` when absent."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (YAML and accelerate messages span several)."""
    return " ".join(str(error).split())


def read_yaml(path: str) -> dict[str, Any]:
    """The mapping of a ``--config`` file (empty for an empty file)."""
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file.")
    with open(path) as handle:
        try:
            config = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise UsageError(f"--config {path} is not valid YAML: {one_line(error)}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(f"--config {path} must contain a YAML mapping of field names to values.")
    return config


class CommandParser(TrlParser):
    """The parser of one ``trl-jagg`` command: every field of its dataclasses is a ``--flag``, ``--config x.yaml``
    sets any of them, flags override the file, and a misspelt name is an error suggesting the nearest one.

    Each dataclass's fields are shown in a help group named by its ``_argument_group_name``; a dataclass that
    extends another one (``GRPOJaggConfig`` over ``TrainingArguments``) shows its own fields before the inherited
    ones.
    """

    def __init__(self, dataclass_types: Sequence[type], command: str, description: str, **kwargs: Any):
        self.command = command
        kwargs.setdefault("prog", f"{PROG} {command}")  # an example script passes its own name
        kwargs.setdefault("usage", f"{kwargs['prog']} [--config config.yaml] [--field value ...]")
        super().__init__(dataclass_types, description=description, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)

    def _add_dataclass_arguments(self, dtype: type) -> None:
        group = self.add_argument_group(getattr(dtype, "_argument_group_name", dtype.__name__))
        inherited = None
        # The first dataclass base from another library (TrainingArguments); trl_jagg's field-group mixins are own.
        library = dtype.__module__.split(".")[0]
        parent = next(
            (b for b in dtype.__mro__[1:] if dataclasses.is_dataclass(b) and b.__module__.split(".")[0] != library),
            None,
        )
        if parent is not None:
            library = parent.__module__.split(".")[0]
            inherited = self.add_argument_group(f"{parent.__name__} ({library}, inherited)")
        own = own_fields(dtype)
        hints = typing.get_type_hints(dtype)
        for item in dataclasses.fields(dtype):
            if item.init:
                # HfArgumentParser rewrites `field.type` in place; work on a copy so the dataclass is untouched.
                item = copy.copy(item)
                item.type = hints[item.name]
                help_text = item.metadata.get("help")
                if help_text and "%" in help_text:  # argparse formats help with %: a literal one must be doubled
                    item.metadata = {**item.metadata, "help": help_text.replace("%", "%%")}
                self._parse_dataclass_field(group if inherited is None or item.name in own else inherited, item)

    def option_names(self) -> dict[str, str]:
        """Every accepted ``--flag`` spelling mapped to its field name."""
        names = {"--config": "config"}
        for action in self._actions:
            for option in action.option_strings:
                if option.startswith("--"):
                    names[option] = action.dest
        return names

    def field_names(self) -> set[str]:
        return {dest for option, dest in self.option_names().items() if option != "--config" and dest != "help"}

    def check_names(self, argv: Sequence[str], config: Mapping[str, Any], path: str | None) -> None:
        """Unknown field names in the YAML config or on the command line are errors that suggest the nearest one.

        Checked before anything is parsed, so a typo is reported as such rather than as the missing or invalid
        value it causes.
        """
        valid = self.field_names()
        for key, value in config.items():
            self._check_trl_value(str(key), value, f" in {path}")
            if key != "env" and TRL_ALIASES.get(key, key) not in valid and key not in TRL_ONLY:
                raise UsageError(f"unknown field '{key}' in {path}.{suggest(str(key), valid)}")
        options = self.option_names()
        for i, token in enumerate(argv):
            flag = token.split("=", 1)[0]
            if not token.startswith("--") or flag == "--":
                continue
            name = flag[2:]
            value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else None)
            self._check_trl_value(name, value, f" ({flag})")
            if f"--{TRL_ALIASES.get(name, name)}" not in options and name not in TRL_ONLY:
                raise UsageError(f"unknown field '{name}' ({flag}).{suggest(name, valid)}")

    @staticmethod
    def _check_trl_value(name: str, value: Any, where: str) -> None:
        check = TRL_ONLY.get(name) or TRL_VALUES.get(TRL_ALIASES.get(name, name))
        reason = check(value) if check is not None else None
        if reason is not None:
            raise UsageError(f"{name}{where} {reason}")

    @staticmethod
    def trl_argv(argv: Sequence[str]) -> list[str]:
        """``argv`` with the TRL aliases renamed to their fields and the accepted TRL-only flags dropped."""
        out: list[str] = []
        tokens = iter(argv)
        for token in tokens:
            name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
            if name in TRL_ONLY:
                if not eq:
                    next(tokens, None)
                continue
            out.append(f"--{TRL_ALIASES[name]}{eq}{value}" if name in TRL_ALIASES else token)
        return out

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        # TrlParser reads the --config YAML itself: rename its TRL aliases and drop the accepted TRL-only keys here.
        kwargs = {TRL_ALIASES.get(k, k): v for k, v in kwargs.items() if k not in TRL_ONLY}
        return super().set_defaults_with_config(**kwargs)

    def check_yaml_types(self, config: Mapping[str, Any], path: str | None) -> None:
        """YAML values have the types their flags convert to. TrlParser sets them as argparse defaults, which
        argparse converts only when they are strings (as it converts flag values): ``num_generations: 2.0`` would
        otherwise reach the trainer unchecked and fail after the model loaded."""
        for dtype in self.dataclass_types:
            hints = typing.get_type_hints(dtype)
            skip = getattr(dtype, "_types_checked_later", ())
            for item in dataclasses.fields(dtype):
                value = config.get(item.name)
                if item.name not in config or isinstance(value, str) or item.name in skip:
                    continue
                problem = type_problem(value, hints[item.name])
                if problem is not None:
                    raise UsageError(
                        f"{path}: {item.name} is {value!r} ({type(value).__name__}); --{item.name} takes {problem}."
                    )

    def read_config(self, argv: Sequence[str]) -> tuple[list[str], dict[str, Any], str | None]:
        """``(argv, yaml, path)``: ``argv`` with ``--config=x`` split in two tokens, the ``--config`` file's mapping
        (empty without one) and its path."""
        argv = list(argv)
        # TrlParser reads only the two-token form of --config.
        for i, token in enumerate(argv):
            if token.startswith("--config="):
                argv[i : i + 1] = ["--config", token.split("=", 1)[1]]
                break
        path = flag_value(argv, "--config")
        if "--config" in argv and path is None:
            raise UsageError("--config needs the path of a YAML file.")
        return argv, read_yaml(path) if path else {}, path

    def parse_command_line(
        self,
        argv: Sequence[str],
        defaults: Callable[[Sequence[str], Mapping[str, Any]], Mapping[str, Any]] | None = None,
    ) -> tuple[Any, ...] | None:
        """Parse ``argv``: dataclass defaults < ``defaults(argv, yaml)`` (e.g. a preset) < ``--config`` YAML < flags.

        Returns one instance per dataclass, or ``None`` after printing the help for ``-h`` / ``--help``.

        Raises:
            UsageError: for an unknown field (with the nearest valid name) or an invalid value (naming the field).
        """
        if "-h" in argv or "--help" in argv:
            self.print_help()
            return None
        argv, config, config_path = self.read_config(argv)
        self.check_names(argv, config, config_path)
        self.check_yaml_types(config, config_path)
        if defaults is not None:
            self.set_defaults(**defaults(argv, config))
        try:
            *parsed, _, leftover = self.parse_args_and_config(
                self.trl_argv(argv), return_remaining_strings=True, separate_remaining_strings=True
            )
        except (ValueError, TypeError) as error:
            if isinstance(error, UsageError):
                raise
            raise UsageError(str(error)) from None
        if leftover:
            raise UsageError(f"unexpected arguments {leftover}: fields are given as `--name value`.")
        return tuple(parsed)
