"""``trl-jagg train``: GRPO + JAGG fine-tuning from a YAML config and flags, like TRL's ``trl grpo``.

.. code-block:: bash

    trl-jagg train --config recipe.yaml [--any_field value ...]
    trl-jagg train --recipe flow-grpo-flux --dataset_name prompts.txt --output_dir flux-grpo
    accelerate launch -m trl_jagg.scripts.cli train --config recipe.yaml      # DDP / FSDP, several processes

Every field of :class:`ScriptArguments` (model, data, rewards, LoRA) and of :class:`~trl_jagg.GRPOJaggConfig`
(GRPO, JAGG and all of ``transformers.TrainingArguments``) is a flag; ``--config`` sets any of them from a YAML
file and flags override it; ``--recipe`` starts from a preset.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# Only light modules at the top: `main` answers typos, unknown fields and `--help` before trl, transformers, diffusers
# and peft are imported (see train_snapshot).
from trl_jagg.scripts import DOCS_URL
from trl_jagg.scripts.launch import LAUNCHED_ENV, launch_with_accelerate, split_launch_options
from trl_jagg.scripts.train_snapshot import load_snapshot
from trl_jagg.scripts.usage import UsageError, check_names, flag_value, read_config
from trl_jagg.utils.errors import TrainingInterrupted
from trl_jagg.utils.redaction import redacted_argv

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.scripts.utils import CommandParser


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
            "help": "Preset to start from: a name of trl_jagg.recipes.list_recipes() (docs/models.md lists them: "
            "flow-grpo-*, dancegrpo-*, mixgrpo-flux, jagg-fast-flux, nft-sd35*, flow-factory-*). It sets the model, "
            "rewards, LoRA and config values and applies its scheduler override (DanceGRPO's shift 3); the YAML "
            "config and the flags override its values."
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
    dataset_train_split: str = field(
        default="train", metadata={"help": "Split of the dataset to train on (trl grpo's name; also dataset_split)."}
    )
    dataset_test_split: str = field(
        default="test",
        metadata={
            "help": "As in trl grpo: the split of the dataset (or of eval_dataset_name) that evaluate() scores when "
            "eval_strategy is not 'no'."
        },
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts from another source than dataset_name (the same kinds: a Hub dataset, a "
            "saved directory or a local file, whose rows are all evaluated), scored when eval_strategy is not 'no'."
        },
    )
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
            "(see docs/rewards.md), http(s):// URLs of a reward server, or dotted import paths of your own "
            "functions (my_module.my_reward, importable from the working directory)."
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

    log_format: str = field(
        default="dict",
        metadata={
            "help": "How the console shows each logging step: 'dict' (transformers' printed metrics dict) or 'line' "
            "(one short line per step: rewards, KL, clipping, latent std, rollout and update time). The trackers "
            "of report_to get every scalar either way."
        },
    )

    accelerate_config: str | None = field(
        default=None,
        metadata={
            "help": "Relaunch this command through `accelerate launch --config_file <file>`, as `trl` does: a path, "
            "or the name of a config shipped in the package, trl_jagg/configs/accelerate/ (single_gpu, multi_gpu, "
            "fsdp2, deepspeed_zero2, deepspeed_zero3; TRL's names zero2 and zero3 too)."
        },
    )

    def __post_init__(self) -> None:
        # A YAML scalar where a list is expected (``reward_funcs: pickscore``) means a list of one.
        for name in ("prompts", "reward_funcs", "lora_target_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
        # peft would refuse these only once the pipeline is loaded.
        if self.lora_r < 1:
            raise ValueError(f"lora_r is {self.lora_r}. Use a rank of 1 or more (16-64 are typical).")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha is {self.lora_alpha}. Use a positive value (often 2 x lora_r).")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout is {self.lora_dropout}. Use a value in [0, 1).")
        if self.log_format not in ("dict", "line"):
            raise ValueError(f"log_format is {self.log_format!r}. Use 'dict' or 'line'.")


DESCRIPTION = (
    "GRPO fine-tuning of a text-to-image flow model with JAGG group gradients. Every field below is a flag; "
    "`--config recipe.yaml` sets any of them from a YAML mapping (plus an optional `env:` mapping of environment "
    "variables), flags override the file, and `--recipe` starts from a preset."
)


def make_parser(command: str = "train", extra: Sequence[type] = (), description: str = DESCRIPTION) -> CommandParser:
    """The parser of ``trl-jagg train`` over ``ScriptArguments`` and ``GRPOJaggConfig`` (and ``extra``
    dataclasses: ``calibrate`` adds its own)."""
    from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
    from trl_jagg.scripts.utils import CommandParser

    return CommandParser(
        (ScriptArguments, GRPOJaggConfig, *extra),
        command,
        description,
        usage=f"trl-jagg {command} [--config recipe.yaml] [--field value ...]\n"
        f"       accelerate launch -m trl_jagg.scripts.cli {command} [--config recipe.yaml] [--field value ...]",
        epilog=f"Docs: {DOCS_URL} (quickstart.md, config.md). Example: "
        f"trl-jagg {command} --config recipe.yaml --learning_rate 1e-4 --jagg_group_size 8",
    )


def recipe_defaults(argv: Sequence[str], config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the preset named by ``--recipe`` (flag or YAML): model, rewards, LoRA and config fields."""
    name = flag_value(argv, "--recipe") or config.get("recipe")
    if not name:
        return {}
    from trl_jagg.recipes import get_recipe

    try:
        recipe = get_recipe(name)
        recipe.warn_if_deprecated()
        return recipe.cli_values()
    except ValueError as error:
        raise UsageError(f"recipe: {error}") from None


def check_script_args(script_args: ScriptArguments) -> None:
    """The fields ``train`` needs whatever the preset: a model, rewards and prompts given one way."""
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
    check_local_paths(script_args)


DATASET_FILE_TYPES = (".txt", ".json", ".jsonl", ".csv", ".parquet")
"""The local prompt files ``dataset_name`` reads (see :func:`load_prompt_dataset`)."""


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_local_paths(script_args: ScriptArguments) -> None:
    """A model or dataset named by a local path exists and is of the right kind, checked before anything loads
    (diffusers and datasets would first try the Hub and fail with a long network error)."""
    model = script_args.model_name_or_path
    if os.path.isfile(model) or (os.path.isdir(model) and not os.path.isfile(os.path.join(model, "model_index.json"))):
        raise UsageError(
            f"model_name_or_path {model} is not a diffusers pipeline directory (no model_index.json). Give a "
            "directory saved with `pipe.save_pretrained(...)`, or a Hub id."
        )
    if not os.path.exists(model) and not _is_hub_id(model):
        raise UsageError(f"model_name_or_path {model}: no such directory, and not a Hub id (owner/name).")
    name = script_args.dataset_name
    if name and not os.path.exists(name) and (name.lower().endswith(DATASET_FILE_TYPES) or not _is_hub_id(name)):
        raise UsageError(
            f"dataset_name {name}: no such file or directory. Give an existing {'/'.join(DATASET_FILE_TYPES)} file, a "
            "directory saved with `save_to_disk`, or a Hub dataset id."
        )


def parse_train_args(argv: Sequence[str]) -> tuple[ScriptArguments, GRPOJaggConfig]:
    """Parse ``trl-jagg train`` arguments: defaults < ``--recipe`` < ``--config`` YAML < flags.

    Raises:
        UsageError: for an unknown field (with the nearest valid name), a missing required one, or an invalid value
            (the message names the field).
    """
    script_args, training_args = make_parser().parse_command_line(argv, recipe_defaults)
    check_script_args(script_args)
    return script_args, training_args


def load_prompt_dataset(script_args: ScriptArguments) -> Dataset:
    """The training prompts as a :class:`datasets.Dataset` with a ``prompt`` column."""
    from datasets import Dataset

    if script_args.prompts:
        return Dataset.from_dict({"prompt": list(script_args.prompts)})
    return read_prompts(script_args, script_args.dataset_name, script_args.dataset_train_split, "dataset_name")


def load_eval_dataset(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> Dataset | None:
    """The held-out prompts ``evaluate()`` scores, as ``trl grpo`` picks them: ``eval_dataset_name`` when given,
    else the ``dataset_test_split`` of ``dataset_name``; ``None`` when ``eval_strategy`` is ``"no"``."""
    if training_args.eval_strategy == "no":
        return None
    if script_args.eval_dataset_name:
        return read_prompts(
            script_args, script_args.eval_dataset_name, script_args.dataset_test_split, "eval_dataset_name"
        )
    name = script_args.dataset_name
    # A Hub dataset or a saved DatasetDict has splits; inline prompts, a file or a saved Dataset have one.
    if name and (not os.path.exists(name) or os.path.isfile(os.path.join(name, "dataset_dict.json"))):
        return read_prompts(script_args, name, script_args.dataset_test_split, "dataset_name")
    source = "the inline prompts have" if script_args.prompts else f"dataset_name {name} has"
    raise UsageError(
        f"eval_strategy is {training_args.eval_strategy.value!r} but {source} no test split to evaluate. Set "
        "eval_dataset_name (a file or dataset of held-out prompts), or eval_strategy no."
    )


def read_prompts(script_args: ScriptArguments, name: str, split: str, field_name: str) -> Dataset:
    """Split ``split`` of dataset ``name`` (a Hub id, a ``save_to_disk`` directory or a local file, whose rows are
    all read) with its ``dataset_prompt_column`` renamed ``prompt``; errors name ``field_name``."""
    from datasets import Dataset, load_dataset, load_from_disk

    column = script_args.dataset_prompt_column
    if os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_info.json")):
        dataset = load_from_disk(name)
    elif os.path.isdir(name) and os.path.isfile(os.path.join(name, "dataset_dict.json")):
        dataset = load_from_disk(name)
        if split not in dataset:
            raise UsageError(f"{field_name} {name}: no split {split!r} (splits: {list(dataset)}).")
        dataset = dataset[split]
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
                raise UsageError(f"{field_name} {name}: a .json file must hold a list of prompts or of records.")
            dataset = Dataset.from_list(records)
        else:
            builder = {".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}.get(extension)
            if builder is None:
                raise UsageError(f"{field_name} {name}: unsupported file type {extension!r}.")
            dataset = load_dataset(builder, data_files=name, split="train")
    else:
        dataset = load_dataset(name, script_args.dataset_config, split=split)
    if len(dataset) == 0:  # an empty file has no columns either: say what is wrong, not which column is missing
        raise UsageError(f"{field_name} {name} holds no prompts. Give a dataset with at least one row.")
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
        from trl_jagg.utils.hub_access import check_hub_file

        check_hub_file(script_args.model_name_or_path, "model_index.json", what="model", revision=revision)
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
    reward_funcs = checked_reward_funcs(script_args.reward_funcs, training_args)
    dataset = load_prompt_dataset(script_args)
    eval_dataset = load_eval_dataset(script_args, training_args)
    return new_trainer(
        script_args.model_name_or_path,
        reward_funcs,
        training_args,
        dataset,
        eval_dataset,
        build_lora_config(script_args, training_args.model_revision),
        script_args.recipe,
    )


def checked_reward_funcs(reward_funcs: Sequence[Any], training_args: GRPOJaggConfig) -> list[Any]:
    """``reward_funcs`` as a list, once each loads with ``reward_kwargs``: a bad name or ``reward_kwargs`` entry is
    a usage error, before any model loads (the trainer builds them again)."""
    from trl_jagg.rewards import load_reward_funcs

    reward_funcs = list(reward_funcs)
    try:
        load_reward_funcs(reward_funcs, training_args.reward_kwargs)
    except ValueError as error:
        raise UsageError(f"reward_funcs: {error}") from None
    return reward_funcs


def new_trainer(
    model: str,
    reward_funcs: list[Any],
    training_args: GRPOJaggConfig,
    train_dataset: Dataset,
    eval_dataset: Dataset | None,
    peft_config: LoraConfig | None,
    recipe: str | None,
) -> DDPOJaggTrainer:
    """The trainer of pipeline ``model`` (a Hub id or a folder), seeded, with the scheduler override of preset
    ``recipe`` applied to the pipeline when it has one; shared by ``trl-jagg train`` and the examples."""
    from transformers import set_seed

    from trl_jagg import DDPOJaggTrainer

    pipeline: Any = model
    scheduler = recipe_scheduler(recipe)
    if scheduler:
        # A recipe that changes the schedule (DanceGRPO's fixed shift 3): load the pipeline and apply it.
        import torch
        from diffusers import DiffusionPipeline

        from trl_jagg.recipes import get_recipe

        pipeline = DiffusionPipeline.from_pretrained(
            model, dtype=getattr(torch, training_args.dtype), revision=training_args.model_revision
        )
        get_recipe(recipe).apply_scheduler(pipeline)
        if training_args.process_index == 0:
            print(f"Recipe {recipe}: scheduler overrides {scheduler} applied to the pipeline.")
    # The LoRA weights are drawn when the trainer adds the adapter, before Trainer seeds anything: seed here so that
    # a run is reproducible from its `seed`.
    set_seed(training_args.seed)
    return DDPOJaggTrainer(
        model=pipeline,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        peft_config=peft_config,
    )


def recipe_scheduler(name: str | None) -> dict[str, Any]:
    """The scheduler overrides of preset ``name`` (empty without a preset or without overrides)."""
    if not name:
        return {}
    from trl_jagg.recipes import get_recipe

    return dict(get_recipe(name).scheduler or {})


def run_train(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> DDPOJaggTrainer:
    """Build the trainer, train (resuming when asked), save to ``output_dir``, push when ``push_to_hub`` and end
    (the trackers finish: nothing that talks to the other processes may follow)."""
    trainer = build_trainer(script_args, training_args)
    if script_args.log_format == "line":
        from trl_jagg.trainer.console import use_step_summary

        use_step_summary(trainer)
    return train_and_save(trainer, training_args, script_args.dataset_name)


def train_and_save(
    trainer: DDPOJaggTrainer, training_args: GRPOJaggConfig, dataset_name: str | None = None
) -> DDPOJaggTrainer:
    """Train (resuming when asked), save to ``output_dir``, push when ``push_to_hub`` (the model card names
    ``dataset_name``) and end; shared by ``trl-jagg train`` and the examples."""
    # "true" / "last" / "latest" (a flag's text) mean the latest checkpoint-N: the trainer reads them.
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except TrainingInterrupted as stop:  # the checkpoint is saved: say where, end, exit with the signal's status
        if trainer.is_world_process_zero():
            print(stop, file=sys.stderr)
        if hasattr(trainer, "end"):
            trainer.end()
        raise SystemExit(stop.exit_code) from None
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(f"Saved the trained weights to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    # As TRL's grpo script: finish the trackers and destroy the process group (Trainer.end, transformers >= 5.x).
    if hasattr(trainer, "end"):
        trainer.end()
    return trainer


def check_model_access(model: str, revision: str | None = None) -> None:
    """The pipeline a Hub id names can be had: cached, or downloadable with access (not gated, not offline),
    checked without loading anything or importing diffusers. Local paths are checked by :func:`check_local_paths`.

    Raises:
        HubAccessError: naming the model and the fix (accept the license, log in, download it once while online).
    """
    if os.path.exists(model) or not _is_hub_id(model):
        return
    from trl_jagg.utils.hub_access import check_hub_file

    check_hub_file(model, "model_index.json", what="model", revision=revision)


def main(argv: Sequence[str]) -> int:
    """``trl-jagg train ARGV``: parse, train, save (and push); returns the exit status.

    With ``accelerate_config`` (flag or YAML) the command relaunches itself through ``accelerate launch``; the
    names are checked here, the values in the launched processes, which know the number of processes. Where the
    parser's snapshot is current (:mod:`~trl_jagg.scripts.train_snapshot`), ``--help`` and unknown names are answered
    before the heavy imports; the model's access is checked once the values are, before diffusers loads.
    """
    if not os.environ.get(LAUNCHED_ENV):
        snapshot = load_snapshot()
        if snapshot is not None and {"-h", "--help"} & set(argv):
            print(snapshot["help"], end="")
            return 0
        if not {"-h", "--help"} & set(argv):
            argv, config, path = read_config(argv)
            accelerate_config = flag_value(argv, "--accelerate_config") or config.get("accelerate_config")
            launch, rest = split_launch_options(argv)
            if launch and not accelerate_config:
                raise UsageError(
                    f"{launch[0]} is an accelerate launch option: give it with --accelerate_config NAME (e.g. "
                    "multi_gpu), or run `accelerate launch ... -m trl_jagg.scripts.cli train` yourself."
                )
            if snapshot is not None:
                check_names(snapshot["options"], rest, config, path)
            if accelerate_config:
                if snapshot is None:
                    make_parser().check_names(rest, config, path)
                return launch_with_accelerate(argv, accelerate_config)
    parsed = make_parser().parse_command_line(argv, recipe_defaults)
    if parsed is None:
        return 0
    sys.argv[1:] = redacted_argv(sys.argv[1:])  # parsed: W&B records sys.argv, which may hold a key
    check_script_args(parsed[0])
    # After the values' checks (they come first whatever the machine's access to the Hub), before diffusers loads.
    check_model_access(parsed[0].model_name_or_path, parsed[1].model_revision)
    run_train(*parsed)
    return 0
