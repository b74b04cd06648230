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

from trl_jagg.field_types import type_problem
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


class UsageError(ValueError):
    """A problem with the command line or the YAML config: reported as ``trl-jagg <command>: error: ...``."""


def suggest(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest valid name (difflib), TRL's equivalent, or an empty string."""
    name = name.replace("-", "_")
    if name in TRL_NAMES:
        return f" TRL's GRPOConfig calls it '{name}'; here use {TRL_NAMES[name]}."
    close = difflib.get_close_matches(name, sorted(set(valid)), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def own_fields(cls: type) -> set[str]:
    """Fields a dataclass declares itself (not inherited): GRPOJaggConfig's own fields vs TrainingArguments'."""
    return set(cls.__dict__.get("__annotations__", {}))


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
        kwargs.setdefault("usage", f"{PROG} {command} [--config config.yaml] [--field value ...]")
        super().__init__(
            dataclass_types, prog=f"{PROG} {command}", description=description, allow_abbrev=False, **kwargs
        )

    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)

    def _add_dataclass_arguments(self, dtype: type) -> None:
        group = self.add_argument_group(getattr(dtype, "_argument_group_name", dtype.__name__))
        inherited = None
        parent = next((base for base in dtype.__mro__[1:] if dataclasses.is_dataclass(base)), None)
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
        for key in config:
            if key != "env" and key not in valid:
                raise UsageError(f"unknown field '{key}' in {path}.{suggest(str(key), valid)}")
        options = self.option_names()
        for token in argv:
            flag = token.split("=", 1)[0]
            if token.startswith("--") and flag not in options and flag != "--":
                raise UsageError(f"unknown field '{flag[2:]}' ({flag}).{suggest(flag[2:], valid)}")

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
                argv, return_remaining_strings=True, separate_remaining_strings=True
            )
        except (ValueError, TypeError) as error:
            if isinstance(error, UsageError):
                raise
            raise UsageError(str(error)) from None
        if leftover:
            raise UsageError(f"unexpected arguments {leftover}: fields are given as `--name value`.")
        return tuple(parsed)
