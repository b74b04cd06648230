"""The ``trl-jagg`` command line.

.. code-block:: bash

    trl-jagg train --config recipe.yaml [--any_config_field value ...]
    accelerate launch -m trl_jagg.cli train --config recipe.yaml     # DDP / FSDP, several processes
    trl-jagg demo --output_dir runs/demo [--compare]                   # the CPU demo that visibly learns
    trl-jagg bench --output_dir runs/bench [...]                       # JAGG vs exact update-stage timings
    trl-jagg calibrate --config recipe.yaml [--threshold 0.7]          # JAGG vs exact gradient cosine per group

``train`` works like TRL's scripts: every field of :class:`ScriptArguments` (model, data, rewards, LoRA) and of
:class:`~trl_jagg.GRPOJaggConfig` (GRPO, JAGG and all of ``transformers.TrainingArguments``) is a flag, a YAML file
given with ``--config`` sets any of them, and flags override the file. ``--recipe`` starts from a preset. A misspelt
field is an error that suggests the nearest valid name. Heavy libraries are imported only by the subcommand that
needs them, so ``trl-jagg --help`` is instant.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig

PROG = "trl-jagg"


class UsageError(ValueError):
    """A problem with the command line or the YAML config: reported as ``trl-jagg <command>: error: ...``."""


# ---------------------------------------------------------------------------------------------------------- train
@dataclass
class ScriptArguments:
    """What ``trl-jagg train`` needs besides :class:`~trl_jagg.GRPOJaggConfig`: the model, the prompts, the rewards
    and the LoRA adapter."""

    _argument_group_name = "Script: model, prompts, rewards, LoRA"

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Required (unless `recipe` gives it). The pipeline to fine-tune: a Hub id "
            "(black-forest-labs/FLUX.1-dev, stabilityai/stable-diffusion-3.5-medium, Qwen/Qwen-Image) or a local "
            "directory in the diffusers layout."
        },
    )
    recipe: str | None = field(
        default=None,
        metadata={
            "help": "Preset to start from (trl_jagg/recipes.py): flow-grpo-sd35, flow-grpo-flux, "
            "flow-grpo-qwenimage, flow-grpo-fast-flux or dancegrpo-flux. It sets the model, rewards, LoRA and config "
            "values and applies its scheduler override (DanceGRPO's shift 3); the YAML config and the flags override "
            "its values."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompt dataset: a Hub dataset id, a directory saved with `save_to_disk`, or a local file: "
            ".txt (one prompt per line), .json (a list of prompts or of records), .jsonl, .csv or .parquet."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of the Hub dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split of the dataset to train on."})
    dataset_prompt_column: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompts (renamed to `prompt`); other columns reach the rewards."},
    )
    prompts: list[str] | None = field(
        default=None,
        metadata={"help": "Prompts given inline, instead of `dataset_name` (a YAML list or several flag values)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Required (unless `recipe` gives them). Reward functions, summed with `reward_weights`: names "
            "such as pickscore, hpsv2.1, clipscore, imagereward, aesthetic, ocr, jpeg_compressibility, prompt_color "
            "(see docs/rewards.md), or "
            "http(s):// URLs of a reward server."
        },
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter (peft) instead of the full transformer backbone."}
    )
    lora_r: int = field(default=32, metadata={"help": "LoRA rank r."})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (the adapter is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Module names the LoRA adapts; defaults to the model family's attention projections "
            "(to_q, to_k, to_v, to_out.0)."
        },
    )

    def __post_init__(self) -> None:
        # A YAML scalar where a list is expected (``reward_funcs: pickscore``) means a list of one.
        for name in ("prompts", "reward_funcs", "lora_target_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])


def _own_fields(cls: type) -> set[str]:
    """Fields a dataclass declares itself (not inherited): GRPOJaggConfig's own fields vs TrainingArguments'."""
    return set(cls.__dict__.get("__annotations__", {}))


@dataclass
class CalibrationArguments:
    """The options of ``trl-jagg calibrate`` on top of the training ones."""

    _argument_group_name = "Calibration (trl-jagg calibrate)"

    threshold: float = field(
        default=0.7,
        metadata={
            "help": "Gradient cosine (JAGG vs exact) a group must reach: the suggested jagg_frac is the share of "
            "leading, high-noise groups at or above it."
        },
    )
    num_batches: int = field(default=1, metadata={"help": "Rollouts the per-group cosines are averaged over."})


def _make_train_parser(command: str = "train", extra: Sequence[type] = ()) -> Any:
    """The ``trl-jagg train`` parser: a :class:`trl.TrlParser` over ``ScriptArguments`` and ``GRPOJaggConfig``
    (and ``extra`` dataclasses, for ``calibrate``)."""
    from trl import TrlParser

    from trl_jagg.grpo_jagg_config import GRPOJaggConfig

    class TrainParser(TrlParser):
        """TrlParser whose errors raise :class:`UsageError`, and whose help shows GRPOJaggConfig's own fields in
        their own group, before the ~100 inherited ``TrainingArguments`` fields."""

        def error(self, message: str) -> typing.NoReturn:
            raise UsageError(message)

        def _add_dataclass_arguments(self, dtype: type) -> None:
            if dtype is GRPOJaggConfig:
                own = _own_fields(dtype)
                mine = self.add_argument_group("GRPO and JAGG (GRPOJaggConfig)")
                inherited = self.add_argument_group("Trainer (transformers.TrainingArguments, inherited)")
                group_of = {item.name: mine if item.name in own else inherited for item in dataclasses.fields(dtype)}
            else:
                group = (
                    self.add_argument_group(dtype._argument_group_name)
                    if hasattr(dtype, "_argument_group_name")
                    else self
                )
                group_of = {item.name: group for item in dataclasses.fields(dtype)}
            hints = typing.get_type_hints(dtype)
            for item in dataclasses.fields(dtype):
                if item.init:
                    # HfArgumentParser rewrites `field.type` in place; work on a copy so the dataclass is untouched.
                    item = copy.copy(item)
                    item.type = hints[item.name]
                    self._parse_dataclass_field(group_of[item.name], item)

    what = {
        "train": "GRPO fine-tuning of a text-to-image flow model with JAGG group gradients.",
        "calibrate": "Measure, on fresh rollouts of the model to train, the cosine between the JAGG and the exact "
        "gradient of every step group, and suggest jagg_frac (the paper's rule). Nothing is trained.",
    }[command]
    return TrainParser(
        (ScriptArguments, GRPOJaggConfig, *extra),
        prog=f"{PROG} {command}",
        usage=f"{PROG} {command} [--config recipe.yaml] [--field value ...]\n"
        f"       accelerate launch -m trl_jagg.cli {command} [--config recipe.yaml] [--field value ...]",
        description=f"{what} Every field below is a flag; `--config recipe.yaml` sets any of them from a YAML "
        "mapping (plus an optional `env:` mapping of environment variables), flags override the file, and "
        "`--recipe` starts from a preset.",
        epilog="Docs: docs/quickstart.md and docs/config.md. Example: "
        f"{PROG} {command} --config recipe.yaml --learning_rate 1e-4 --jagg_group_size 8",
        allow_abbrev=False,
    )


def _option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every accepted ``--flag`` spelling mapped to its canonical field name."""
    names = {"--config": "config"}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                names[option] = action.dest
    return names


def _suggest(name: str, valid: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest valid name (difflib), or an empty string."""
    valid = sorted(set(valid))
    close = difflib.get_close_matches(name.replace("-", "_"), valid, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _field_names(parser: argparse.ArgumentParser) -> set[str]:
    return {dest for option, dest in _option_names(parser).items() if option != "--config" and dest != "help"}


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    if not os.path.isfile(path):
        raise UsageError(f"--config {path}: no such file.")
    with open(path) as handle:
        config = yaml.safe_load(handle)
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UsageError(f"--config {path} must contain a YAML mapping of field names to values.")
    return config


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value given to ``flag`` on the command line (last one wins), ``None`` when absent."""
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


def _check_names(parser: argparse.ArgumentParser, argv: Sequence[str], config: dict[str, Any], path: str | None):
    """Unknown field names in the YAML config or on the command line are errors that suggest the nearest one.

    Checked before anything is parsed, so a typo is reported as such rather than as the missing or invalid value
    it causes.
    """
    fields_ = _field_names(parser)
    for key in config:
        if key != "env" and key not in fields_:
            raise UsageError(f"unknown field '{key}' in {path}.{_suggest(str(key), fields_)}")
    options = _option_names(parser)
    for token in argv:
        flag = token.split("=", 1)[0]
        if token.startswith("--") and flag not in options and flag != "--":
            raise UsageError(f"unknown field '{flag[2:]}' ({flag}).{_suggest(flag[2:], fields_)}")


def _recipe_defaults(name: str, known: set[str]) -> dict[str, Any]:
    """The ``trl-jagg train`` values of preset ``name``: model, rewards, LoRA and config fields."""
    try:
        from trl_jagg.recipes import get_recipe
    except ModuleNotFoundError:
        raise UsageError("recipe: this version of trl_jagg has no presets (trl_jagg.recipes).") from None
    try:
        values = get_recipe(name).cli_values()
    except ValueError as error:
        raise UsageError(f"recipe: {error}") from None
    return {key: value for key, value in values.items() if key in known}


def parse_train_args(argv: Sequence[str]) -> tuple[ScriptArguments, GRPOJaggConfig]:
    """Parse ``trl-jagg train`` arguments: defaults < ``--recipe`` < ``--config`` YAML < flags.

    Raises:
        UsageError: for an unknown field (with the nearest valid name), a missing required one, or an invalid value
            (the message names the field).
    """
    script_args, training_args = _parse(argv, "train", ())
    return script_args, training_args


def parse_calibrate_args(argv: Sequence[str]) -> tuple[ScriptArguments, GRPOJaggConfig, CalibrationArguments]:
    """Parse ``trl-jagg calibrate`` arguments: those of ``train`` plus :class:`CalibrationArguments`."""
    script_args, training_args, calibration_args = _parse(argv, "calibrate", (CalibrationArguments,))
    return script_args, training_args, calibration_args


def _parse(argv: Sequence[str], command: str, extra: Sequence[type]) -> tuple[Any, ...]:
    argv = list(argv)
    # TrlParser reads only the two-token form of --config.
    for i, token in enumerate(argv):
        if token.startswith("--config="):
            argv[i : i + 1] = ["--config", token.split("=", 1)[1]]
            break
    parser = _make_train_parser(command, extra)
    config_path = _flag_value(argv, "--config")
    if "--config" in argv and config_path is None:
        raise UsageError("--config needs the path of a YAML file.")
    config = _read_yaml(config_path) if config_path else {}
    _check_names(parser, argv, config, config_path)

    recipe = _flag_value(argv, "--recipe") or config.get("recipe")
    if recipe:
        parser.set_defaults(**_recipe_defaults(recipe, _field_names(parser)))
    try:
        *parsed, _, leftover = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except (ValueError, TypeError) as error:
        if isinstance(error, UsageError):
            raise
        raise UsageError(str(error)) from None
    if leftover:
        raise UsageError(f"unexpected arguments {leftover}: fields are given as `--name value`.")

    script_args = parsed[0]
    missing = [name for name in ("model_name_or_path", "reward_funcs") if not getattr(script_args, name)]
    if missing:
        raise UsageError(
            f"missing required field{'s' if len(missing) > 1 else ''} {', '.join(missing)}: set "
            f"{' and '.join(f'--{name}' for name in missing)} on the command line or in the --config YAML."
        )
    if not script_args.dataset_name and not script_args.prompts:
        raise UsageError(
            "missing prompts: set dataset_name (a Hub dataset or a local .txt/.json/.jsonl/.csv/.parquet file) or "
            "prompts (a list), on the command line or in the --config YAML."
        )
    if script_args.dataset_name and script_args.prompts:
        raise UsageError("dataset_name and prompts are both set: give the prompts one way.")
    return tuple(parsed)


def load_prompt_dataset(script_args: ScriptArguments) -> Dataset:
    """The training prompts as a :class:`datasets.Dataset` with a ``prompt`` column."""
    from datasets import Dataset, load_dataset, load_from_disk

    column = script_args.dataset_prompt_column
    if script_args.prompts:
        return Dataset.from_dict({"prompt": list(script_args.prompts)})
    name = script_args.dataset_name
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_info.json")):
        dataset = load_from_disk(name)
        dataset = dataset[script_args.dataset_split] if hasattr(dataset, "keys") else dataset
    elif os.path.isfile(name):
        extension = os.path.splitext(name)[1].lower()
        if extension == ".txt":
            with open(name) as handle:
                dataset = Dataset.from_dict({column: [line.strip() for line in handle if line.strip()]})
        elif extension == ".json":
            with open(name) as handle:
                records = json.load(handle)
            if isinstance(records, list) and all(isinstance(r, str) for r in records):
                records = [{column: r} for r in records]
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise UsageError(f"dataset_name {name}: a .json file must hold a list of prompts or of records.")
            dataset = Dataset.from_list(records)
        else:
            builder = {".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(extension)
            if builder is None:
                raise UsageError(f"dataset_name {name}: unsupported file type {extension!r}.")
            dataset = load_dataset(builder, data_files=name, split="train")
    else:
        dataset = load_dataset(name, script_args.dataset_config, split=script_args.dataset_split)
    if column not in dataset.column_names:
        raise UsageError(
            f"dataset_prompt_column: the dataset has no column {column!r} (columns: {dataset.column_names})."
        )
    if column != "prompt":
        if "prompt" in dataset.column_names:
            dataset = dataset.remove_columns("prompt")
        dataset = dataset.rename_column(column, "prompt")
    return dataset


def build_lora_config(script_args: ScriptArguments, revision: str | None = None) -> LoraConfig | None:
    """The LoRA adapter of ``use_peft`` runs (``None`` for full fine-tuning); default targets come from the model
    family's adapter, read from the pipeline's ``model_index.json``."""
    if not script_args.use_peft:
        return None
    from peft import LoraConfig

    targets = script_args.lora_target_modules
    if not targets:
        from diffusers import DiffusionPipeline

        from trl_jagg.models import adapter_class

        class_name = DiffusionPipeline.load_config(script_args.model_name_or_path, revision=revision)["_class_name"]
        targets = list(adapter_class(class_name).lora_target_modules)
    return LoraConfig(
        r=script_args.lora_r,
        lora_alpha=script_args.lora_alpha,
        lora_dropout=script_args.lora_dropout,
        target_modules=list(targets),
        init_lora_weights="gaussian",
    )


def build_trainer(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> DDPOJaggTrainer:
    """The :class:`~trl_jagg.DDPOJaggTrainer` the arguments describe (rewards, prompts, LoRA), not yet trained."""
    from transformers import set_seed

    from trl_jagg import DDPOJaggTrainer
    from trl_jagg.rewards import load_reward_funcs

    try:
        reward_funcs = load_reward_funcs(list(script_args.reward_funcs))
    except ValueError as error:
        raise UsageError(f"reward_funcs: {error}") from None
    dataset = load_prompt_dataset(script_args)
    model: Any = script_args.model_name_or_path
    scheduler = _recipe_scheduler(script_args.recipe)
    if scheduler:
        # A recipe that changes the schedule (DanceGRPO's fixed shift 3): load the pipeline and apply it.
        import torch
        from diffusers import DiffusionPipeline

        from trl_jagg.recipes import get_recipe

        model = DiffusionPipeline.from_pretrained(
            model, dtype=getattr(torch, training_args.dtype), revision=training_args.model_revision
        )
        get_recipe(script_args.recipe).apply_scheduler(model)
        if training_args.process_index == 0:
            print(f"Recipe {script_args.recipe}: scheduler overrides {scheduler} applied to the pipeline.")
    # The LoRA weights are drawn when the trainer adds the adapter, before Trainer seeds anything: seed here so that
    # a run is reproducible from its `seed`.
    set_seed(training_args.seed)
    return DDPOJaggTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        peft_config=build_lora_config(script_args, training_args.model_revision),
    )


def _recipe_scheduler(name: str | None) -> dict[str, Any]:
    """The scheduler overrides of preset ``name`` (empty without a preset or without overrides)."""
    if not name:
        return {}
    from trl_jagg.recipes import get_recipe

    return dict(get_recipe(name).scheduler or {})


def run_train(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> DDPOJaggTrainer:
    """Build the trainer, train (resuming when asked), save to ``output_dir`` and push when ``push_to_hub``."""
    trainer = build_trainer(script_args, training_args)
    resume: str | bool | None = training_args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() in ("true", "last"):
        resume = True  # the latest checkpoint-N in output_dir
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(f"Saved the trained weights to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    return trainer


def _train_command(argv: Sequence[str]) -> int:
    if "-h" in argv or "--help" in argv:
        _make_train_parser().print_help()
        return 0
    script_args, training_args = parse_train_args(argv)
    run_train(script_args, training_args)
    return 0


CALIBRATION_FILE = "jagg_calibration.json"


def run_calibration(
    script_args: ScriptArguments, training_args: GRPOJaggConfig, calibration_args: CalibrationArguments
) -> dict[str, Any]:
    """Per-group JAGG-vs-exact gradient cosines on fresh rollouts and the suggested ``jagg_frac``
    (:meth:`~trl_jagg.DDPOJaggTrainer.calibrate_jagg`); written to ``output_dir/jagg_calibration.json``."""
    trainer = build_trainer(script_args, training_args)
    report = trainer.calibrate_jagg(threshold=calibration_args.threshold, num_batches=calibration_args.num_batches)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        path = os.path.join(training_args.output_dir, CALIBRATION_FILE)
        with open(path, "w") as handle:
            json.dump(report, handle, indent=2)
        width = report["jagg_group_size"]
        print(f"JAGG vs exact gradient per group of W = {width} trained steps (high noise first):")
        for index, (cosine, ratio) in enumerate(zip(report["group_cosine"], report["group_norm_ratio"])):
            mark = "JAGG" if cosine >= report["threshold"] else "exact"
            print(f"  group {index}: cosine {cosine:+.3f}  norm ratio {ratio:.3f}  -> {mark}")
        print(
            f"Suggested jagg_frac: {report['jagg_frac']:.2f} (leading groups with cosine >= {report['threshold']}). "
            f"Written to {path}"
        )
    return report


def _calibrate_command(argv: Sequence[str]) -> int:
    if "-h" in argv or "--help" in argv:
        _make_train_parser("calibrate", (CalibrationArguments,)).print_help()
        return 0
    run_calibration(*parse_calibrate_args(argv))
    return 0


# -------------------------------------------------------------------------------------------- demo, bench
class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise UsageError(message)


def _docstring_args(doc: str | None) -> dict[str, str]:
    """``{name: description}`` from the ``Args:`` section of a Google-style docstring."""
    helps: dict[str, str] = {}
    in_args, current = False, None
    for line in inspect.cleandoc(doc or "").splitlines():
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            in_args = True
            continue
        if in_args and re.fullmatch(r"[A-Z][A-Za-z ]*:", stripped):
            break
        if not in_args or not stripped:
            continue
        match = re.match(r"(\**\w+)\s*(\([^)]*\))?:\s*(.*)", stripped)
        if match and line.startswith(" " * 4) and not line.startswith(" " * 8):
            current = match.group(1)
            helps[current] = match.group(3)
        elif current:
            helps[current] += " " + stripped
    return helps


def _argparse_kwargs(annotation: Any, default: Any) -> dict[str, Any]:
    """argparse keyword arguments for a function parameter of type ``annotation``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else str
        origin = typing.get_origin(annotation)
    if annotation is inspect.Parameter.empty and default is not inspect.Parameter.empty and default is not None:
        annotation = type(default)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin in (list, tuple) or (origin is not None and issubclass(origin, Sequence) and origin is not str):
        item = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return {"nargs": "+", "type": item[0] if item and item[0] in (int, float, str) else str}
    if annotation in (int, float, str):
        return {"type": annotation}
    return {"type": str}


def _function_parser(
    func: Callable[..., Any], prog: str, description: str, defaults: dict[str, Any]
) -> argparse.ArgumentParser:
    """A parser whose flags are ``func``'s parameters (types from the annotations, help from the docstring)."""
    parser = _ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False
    )
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable annotations: fall back to the defaults' types
        hints = {}
    helps = _docstring_args(func.__doc__)
    for name, parameter in inspect.signature(func).parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        default = defaults.get(name, parameter.default)
        kwargs = _argparse_kwargs(hints.get(name, parameter.annotation), default)
        if default is inspect.Parameter.empty:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument(f"--{name}", help=helps.get(name, " "), **kwargs)
    return parser


def _parse_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args`` whose unknown options are errors that suggest the nearest valid one."""
    namespace, unknown = parser.parse_known_args(list(argv))
    if unknown:
        flags = [option[2:] for action in parser._actions for option in action.option_strings if option[:2] == "--"]
        flag = next((token for token in unknown if token.startswith("--")), unknown[0]).split("=", 1)[0]
        raise UsageError(f"unknown option '{flag}'.{_suggest(flag.lstrip('-'), flags)}")
    return namespace


def _call_with_flags(
    command: str,
    module_name: str,
    function_name: str,
    argv: Sequence[str],
    description: str,
    defaults: dict[str, Any],
    print_result: bool = True,
) -> dict[str, Any] | None:
    """Import ``module_name``, expose ``function_name``'s parameters as flags, call it and print what it returns
    (unless ``print_result`` is false: the function reports itself); ``None`` after ``--help``."""
    func = getattr(importlib.import_module(module_name), function_name)
    parser = _function_parser(func, f"{PROG} {command}", description, defaults)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return None
    namespace = _parse_flags(parser, argv)
    parameters = inspect.signature(func).parameters
    kwargs = {
        key: tuple(value) if isinstance(value, list) and isinstance(parameters[key].default, tuple) else value
        for key, value in vars(namespace).items()
    }
    result = func(**kwargs)
    if print_result:
        print(json.dumps(result, indent=2, default=str) if isinstance(result, dict) else result)
    return result if isinstance(result, dict) else {"result": result}


DEMO_DESCRIPTION = (
    "Fine-tune a tiny Flux-architecture pipeline on CPU with GRPO + JAGG and a prompt-colour reward; writes the "
    "metrics, the reward curve (JAGG vs exact with --compare), a before/after grid and the trained weights to "
    "--output_dir, and prints where they are."
)
BENCH_DESCRIPTION = (
    "Time the update stage (forward + backward over the trained steps) with JAGG and with exact per-step backward "
    "on a small DiT, measure the per-group gradient cosine, and write engine_benchmark.json and .png to --output_dir."
)


TRAINER_BENCH_DESCRIPTION = (
    "Time the update stage of DDPOJaggTrainer itself (adapter, SDE log-prob, PPO loss, accelerator.backward) with "
    "JAGG and with exact backward on a small Flux pipeline built from config; write trainer_benchmark.json and .png."
)


def _demo_command(argv: Sequence[str]) -> int:
    # run_demo prints where its files are and the reward it reached.
    _call_with_flags(
        "demo", "trl_jagg.demo", "run_demo", argv, DEMO_DESCRIPTION, {"output_dir": "runs/demo"}, print_result=False
    )
    return 0


def _bench_command(argv: Sequence[str]) -> int:
    if argv and argv[0] == "trainer":
        _call_with_flags(
            "bench trainer",
            "trl_jagg.trainer_benchmark",
            "run_trainer_benchmark",
            argv[1:],
            TRAINER_BENCH_DESCRIPTION,
            {"output_dir": "runs/bench"},
            print_result=False,
        )
        return 0
    from . import benchmark

    parser = _ArgumentParser(
        prog=f"{PROG} bench",
        description=BENCH_DESCRIPTION,
        epilog=f"`{PROG} bench trainer --help`: the same comparison through DDPOJaggTrainer on a tiny Flux pipeline.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    benchmark.add_benchmark_arguments(parser)
    if "-h" in argv or "--help" in argv:
        parser.print_help()
        return 0
    benchmark.run_from_args(_parse_flags(parser, argv))
    return 0


# ---------------------------------------------------------------------------------------------------- main
COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (_train_command, "GRPO + JAGG fine-tuning from a YAML config and flags (accelerate launch-able)"),
    "demo": (_demo_command, "train a tiny model on CPU and plot its rising reward (a few minutes)"),
    "bench": (_bench_command, "time the update stage with JAGG vs exact backward"),
    "calibrate": (_calibrate_command, "measure JAGG-vs-exact gradient cosines per group and suggest jagg_frac"),
}


def _top_help() -> str:
    lines = [
        f"usage: {PROG} <command> [options]",
        "",
        "GRPO fine-tuning of text-to-image flow models (Flux, SD3/SD3.5, Qwen-Image) with JAGG group gradients.",
        "",
        "commands:",
        *(f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()),
        "",
        f"Run `{PROG} <command> --help` for the options of a command. Docs: docs/index.md",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trl-jagg`` console script; returns the exit status (2 for usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from trl_jagg import __version__

        print(f"{PROG} {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: error: unknown command '{command}'.{_suggest(command, COMMANDS)}", file=sys.stderr)
        print(_top_help(), file=sys.stderr)
        return 2
    try:
        return COMMANDS[command][0](rest)
    except UsageError as error:
        print(f"{PROG} {command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
