"""What every ``trl-jagg`` command shares: one argument parser (a :class:`trl.TrlParser` over dataclasses), the
``--config`` YAML file, and errors that name the field and the fix. The names, hints and the ``--config`` reader it
uses are in :mod:`trl_jagg.scripts.usage`, which imports nothing heavy; ``UsageError`` and ``flag_value`` are
re-exported here for the commands."""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trl import TrlParser

from trl_jagg.config.field_types import type_problem
from trl_jagg.scripts import PROG
from trl_jagg.scripts.example_snapshot import library_parent, option_names
from trl_jagg.scripts.usage import TRL_ALIASES, TRL_ONLY, UsageError, check_names, flag_value, read_config


def own_fields(cls: type) -> set[str]:
    """Fields a dataclass declares itself or through its field-group mixins, not those it inherits from
    ``TrainingArguments``: GRPOJaggConfig's own fields (``config_groups`` included) vs the Trainer's."""
    from transformers import TrainingArguments

    own = [klass for klass in cls.__mro__ if not issubclass(TrainingArguments, klass)]
    return {name for klass in own for name in klass.__dict__.get("__annotations__", {})}


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
        parent = library_parent(dtype)
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
        return option_names(self._actions)

    def field_names(self) -> set[str]:
        return {dest for option, dest in self.option_names().items() if option != "--config" and dest != "help"}

    def check_names(self, argv: Sequence[str], config: Mapping[str, Any], path: str | None) -> None:
        """Unknown field names in the YAML config or on the command line are errors that suggest the nearest one
        (:func:`~trl_jagg.scripts.usage.check_names` over this parser's options)."""
        check_names(self.option_names(), argv, config, path)

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

    @staticmethod
    def read_config(argv: Sequence[str]) -> tuple[list[str], dict[str, Any], str | None]:
        """See :func:`~trl_jagg.scripts.usage.read_config`."""
        return read_config(argv)

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


__all__ = ["CommandParser", "UsageError", "flag_value", "own_fields"]
