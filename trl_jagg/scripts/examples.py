"""What every ``examples/train_*.py`` shares: the command line, ``--tiny``, the dataset, the trainer, train and save.

An example script's command line is an :class:`ExampleParser`: the preset it starts from, the values it sets over the
preset and the tiny model ``--tiny`` swaps in. It parses as ``trl-jagg train`` does
(:class:`~trl_jagg.scripts.utils.CommandParser`, a ``TrlParser``) over its own dataclass (:class:`ScriptArguments`)
and :class:`~trl_jagg.GRPOJaggConfig`, so every config field is a flag, ``--config x.yaml`` sets any of them, and an
unknown name is an error that suggests the nearest one:

.. code-block:: bash

    python examples/train_flux_pickscore.py --tiny --output_dir /tmp/flux-tiny --learning_rate 3e-5
    accelerate launch --num_processes 8 examples/train_flux_pickscore.py --jagg_group_size 8 --push_to_hub true

Defaults, lowest first: the preset < the example's values < ``--tiny``'s (tiny model, CPU) < ``--config`` < flags.
``--help`` and unknown names are answered from the parser's snapshot (:mod:`~trl_jagg.scripts.example_snapshot`)
before trl, transformers, diffusers and peft are imported.

The plain scripts (``train_flux_pickscore.py``, ``train_sd35_{nft,awm,dgpo}.py``) write the dataset, the reward,
the trainer, train, save and push out; the others are an :class:`Example`, which adds the model, the rewards and
the prompts to the parser and does the rest itself: :meth:`Example.main` trains.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, NoReturn

# Only light modules at the top: the parser answers --help and typos before the heavy imports (example_snapshot).
from trl_jagg.scripts import DOCS_URL
from trl_jagg.scripts.example_snapshot import option_names, saved_parser
from trl_jagg.scripts.train import check_local_paths, checked_reward_funcs, new_trainer, read_prompts, train_and_save
from trl_jagg.scripts.usage import UsageError, check_names, read_config
from trl_jagg.utils.redaction import redacted_argv

if TYPE_CHECKING:
    from datasets import Dataset

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.recipes.recipe import Recipe
    from trl_jagg.scripts.utils import CommandParser
    from trl_jagg.testing.tiny_models import TinyRun


TINY_REPLACES = ("--model_name_or_path", "--reward_funcs", "--dataset_name")
"""The flags whose values ``--tiny`` replaces (so it refuses them rather than ignore them)."""


@dataclass
class ScriptArguments:
    """A plain example script's own flags, besides :class:`~trl_jagg.GRPOJaggConfig`'s: ``--tiny``, the model and
    the prompts (named as in ``trl-jagg train``; the script's values set their defaults). A script with more flags
    subclasses it."""

    _argument_group_name = "Script: tiny run, model, prompts"

    tiny: bool = field(
        default=False,
        metadata={
            "help": "Run on a CPU in seconds: a pipeline of the same architecture built small from config (in a "
            "temporary folder, removed at exit), the weight-free prompt_color reward (the GenEval and HPSv3 examples "
            "keep theirs, on tiny random reward models) and a few prompts, in place of the model, rewards and dataset."
        },
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The pipeline to fine-tune: a Hub id or a diffusers folder."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "Prompts: a Hub dataset id."})
    dataset_prompt_column: str = field(
        default="prompt", metadata={"help": "Column holding the prompts (renamed to `prompt`)."}
    )


@dataclass
class ExampleArguments(ScriptArguments):
    """An :class:`Example`'s own flags: a plain script's, the rewards, and the prompts read from more places (named
    as in ``trl-jagg train``). An example with more flags subclasses it."""

    _argument_group_name = "Example: tiny run, model, rewards, prompts"

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompts: a Hub dataset id, a folder saved with `save_to_disk`, or a .txt/.json/.jsonl/.csv/"
            ".parquet file."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: names, http(s):// reward-server URLs or dotted paths."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of the Hub dataset."})
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Held-out prompts (the same kinds as dataset_name, every row read) that evaluate() scores; "
            "giving them sets eval_strategy steps."
        },
    )


COUNTING_EDIT: Mapping[str, Any] = {
    "dataset": "dataset/counting_edit/train_metadata.jsonl",
    "prompt_column": "prompt",
    "source_image_column": "image",
}
"""The editing examples' prompts, Flow-GRPO's dataset/counting_edit: JSON lines of an instruction (``prompt``), the
image it edits (``image``, a path relative to the file) and GenEval's metadata (``tag``, ``include``, ``exclude``).
``Example(..., **COUNTING_EDIT)``."""

EXAMPLE_VALUES: Mapping[str, Any] = {"max_steps": 1000, "save_steps": 100, "report_to": "tensorboard"}
"""What every example sets over its preset (an example's ``values`` replace them)."""


@dataclass
class ExampleParser:
    """The command line of one ``examples/train_*.py``: its preset, the values it sets over the preset and its
    ``--tiny`` run; :meth:`parse_args` parses.

    Attributes:
        script: the example's file (``__file__``): its name is the command's.
        recipe: the preset it starts from (``trl_jagg.recipes``).
        tiny: the tiny-model family ``--tiny`` builds (``trl_jagg/testing/tiny_models.py``).
        values: the defaults it sets over the preset and :data:`EXAMPLE_VALUES`: config fields and its own flags
            (``model_name_or_path``, ``dataset_name``, ...).
        tiny_steps: ``num_inference_steps`` of the ``--tiny`` run.
        arguments: the dataclass of the example's own flags.
    """

    script: str
    recipe: str
    tiny: str
    values: Mapping[str, Any] = field(default_factory=dict)
    tiny_steps: int = 5
    arguments: type[ScriptArguments] = ScriptArguments

    @property
    def preset(self) -> Recipe:
        """The :class:`~trl_jagg.recipes.recipe.Recipe` named by :attr:`recipe`."""
        from trl_jagg.recipes import get_recipe

        return get_recipe(self.recipe)

    @property
    def command(self) -> str:
        """``examples/<script>.py``, as the help and errors show it."""
        return f"examples/{os.path.basename(self.script)}"

    def tiny_run(self) -> TinyRun:
        """What ``--tiny`` swaps in: the tiny pipeline (saved to a temporary folder, removed at exit), the weight-free
        ``prompt_color`` reward and a few prompts (its config values are set when parsing)."""
        from trl_jagg.testing.tiny_models import tiny_run

        return tiny_run(self.tiny, num_inference_steps=self.tiny_steps)

    # What an example can override.

    def extra_values(self, args: ScriptArguments) -> dict[str, Any]:
        """Config values that depend on the example's own flags (none here)."""
        return {}

    def own_defaults(self, args: ScriptArguments) -> dict[str, Any]:
        """Defaults the example sets besides the preset and :attr:`values` (none here; :class:`Example`'s model,
        rewards and prompts)."""
        return {}

    # The machinery.

    def defaults(self, args: ScriptArguments) -> dict[str, Any]:
        """Every default the example sets, the own flags' and the config's: the preset < :data:`EXAMPLE_VALUES`
        and its mixed precision < :meth:`own_defaults` < :attr:`values` < :meth:`extra_values` < the ``--tiny``
        values."""
        preset = self.preset
        values: dict[str, Any] = {**preset.config, **EXAMPLE_VALUES}
        if preset.mixed_precision:  # the peer's mixed precision (fp16 or bf16 autocast, GPUs)
            values[preset.mixed_precision] = True
        values |= {**self.own_defaults(args), **self.values, **self.extra_values(args)}
        if args.tiny:  # one weight-free reward: no reward's kwargs
            from trl_jagg.testing.tiny_models import tiny_config

            values |= tiny_config(self.tiny, num_inference_steps=self.tiny_steps) | {"reward_kwargs": None}
        return values

    def parser_options(self) -> dict[str, str]:
        """The full parser's and the snapshot's ``prog``, ``usage``, ``description`` and ``epilog``."""
        script = self.command
        model = {**self.own_defaults(self.arguments()), **self.values}.get("model_name_or_path")
        return {
            "prog": f"python {script}",
            "usage": f"python {script} [--tiny] [--config x.yaml] [--field value ...]\n"
            f"       accelerate launch {script} [--field value ...]",
            "description": f"The {self.recipe} preset on {model}: every field below is a flag (`--use_jagg false`, "
            "`--learning_rate 1e-4`), `--config x.yaml` sets any of them and flags override it.",
            "epilog": f"Docs: {DOCS_URL} (quickstart.md#8-examples, config.md). Example: python {script} --tiny "
            "--output_dir /tmp/tiny --learning_rate 3e-5.",
        }

    def parser(self) -> CommandParser:
        """``trl-jagg train``'s parser over :attr:`arguments` and :class:`~trl_jagg.GRPOJaggConfig`."""
        from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
        from trl_jagg.scripts.utils import CommandParser

        options = self.parser_options()
        return CommandParser((self.arguments, GRPOJaggConfig), self.command, options.pop("description"), **options)

    def own_arguments(self, argv: Sequence[str], config: Mapping[str, Any]) -> ScriptArguments:
        """The example's own flags alone (the YAML's values, then the command line's), which its defaults depend on."""
        from trl_jagg.scripts.utils import CommandParser

        parser = CommandParser((self.arguments,), self.command, "")
        names = {item.name for item in fields(self.arguments) if item.init}
        parser.set_defaults(**{key: value for key, value in config.items() if key in names})
        namespace, _ = parser.parse_known_args(CommandParser.trl_argv(argv))  # the config's flags are not its
        return self.arguments(**{name: getattr(namespace, name) for name in names})

    def answer_from_snapshot(self, argv: Sequence[str]) -> bool:
        """``--help`` and unknown names answered from the parser's snapshot, before the heavy imports: ``True``
        after printing the help, ``False`` when the full parser must answer (a stale snapshot, ``--help`` with
        flags the defaults depend on, or names that are all known).

        Raises:
            UsageError: for an unknown field, as the full parser would.
        """
        defaults = None
        if "-h" in argv or "--help" in argv:  # the help shows the example's defaults (the own flags' dataclass's)
            defaults = self.defaults(self.arguments())
        parser = saved_parser(self.arguments, defaults, **self.parser_options())
        if parser is None:
            return False
        options = option_names(parser._actions)
        if defaults is not None:
            own = {item.name for item in fields(self.arguments)} | {"config"}
            if any(options.get(token.split("=", 1)[0]) in own for token in argv):
                return False  # e.g. `--help --tiny`: the full parser shows the defaults these flags give
            parser.print_help()
            return True
        argv, config, path = read_config(argv)
        check_names(options, argv, config, path)
        return False

    def parse(self, argv: Sequence[str]) -> tuple[ScriptArguments, GRPOJaggConfig] | None:
        """The example's arguments and config from ``argv``, nothing loaded; ``None`` after printing ``--help``.

        Raises:
            UsageError: for an unknown field (with the nearest name) or an invalid value (naming the field).
        """
        if self.answer_from_snapshot(argv):
            return None
        parser = self.parser()
        if "-h" in argv or "--help" in argv:  # the help shows the example's defaults (--tiny's with --tiny)
            rest = [token for token in argv if token not in ("-h", "--help")]
            parser.set_defaults(**self.defaults(self.own_arguments(rest, {})))
        parsed = parser.parse_command_line(argv, lambda argv, config: self.defaults(self.own_arguments(argv, config)))
        if parsed is not None and parsed[0].tiny:
            replaced = [flag for flag in TINY_REPLACES if any(t == flag or t.startswith(f"{flag}=") for t in argv)]
            if replaced:
                them = "them" if len(replaced) > 1 else "it"
                raise UsageError(
                    f"--tiny replaces {', '.join(replaced)} with its tiny model, reward and prompts, so "
                    f"{'they' if len(replaced) > 1 else 'it'} would be ignored: drop --tiny to use {them}, or drop "
                    f"{them} to run tiny."
                )
        return None if parsed is None else (parsed[0], parsed[1])

    def exit_with(self, error: UsageError) -> NoReturn:
        """A usage error as one line on stderr, and exit status 2 (argparse's)."""
        print(f"python {self.command}: error: {error} (all flags: --help)", file=sys.stderr)
        raise SystemExit(2) from None

    def parse_args(self, argv: Sequence[str] | None = None) -> tuple[ScriptArguments, GRPOJaggConfig]:
        """:meth:`parse` of ``argv`` (default: the command line), as ``argparse`` parses: exit status 0 after
        ``--help``, 2 after a usage error (one line on stderr)."""
        try:
            parsed = self.parse(list(sys.argv[1:] if argv is None else argv))
        except UsageError as error:
            self.exit_with(error)
        if parsed is None:
            raise SystemExit(0)
        sys.argv[1:] = redacted_argv(sys.argv[1:])  # parsed: W&B records sys.argv, which may hold a key
        return parsed


@dataclass(kw_only=True)
class Example(ExampleParser):
    """One declared ``examples/train_*.py``: what differs from the other examples; :meth:`main` runs it.

    Attributes (besides :class:`ExampleParser`'s; all but ``script`` by keyword):
        model: Hub id of the pipeline.
        output_dir: the default ``--output_dir``.
        reward_funcs: the rewards (names, URLs or dotted paths); ``None``: the preset's.
        dataset: the default prompts (``None``: ``--dataset_name`` is required without ``--tiny``).
        prompt_column: the dataset's prompt column.
        fsdp_blocks: the backbone's block classes, each an FSDP2 unit when launched on several processes (the
            Trainer refuses FSDP in one).
        source_image_column: editing: the dataset's column of source-image paths, relative to the dataset file,
            loaded into ``source_image``.
    """

    model: str
    output_dir: str
    reward_funcs: Sequence[str] | None = None
    dataset: str | None = "nateraw/parti-prompts"
    prompt_column: str = "Prompt"
    fsdp_blocks: Sequence[str] = ()
    source_image_column: str | None = None
    arguments: type[ExampleArguments] = ExampleArguments

    def tiny_setup(self, args: ExampleArguments, config: GRPOJaggConfig) -> TinyRun:
        """Build what ``--tiny`` swaps in (:meth:`tiny_run`). An example that keeps its reward on tiny reward models
        builds them here and points ``config.reward_kwargs`` at their folders (checked with the rewards before the
        trainer is built)."""
        return self.tiny_run()

    def own_defaults(self, args: ExampleArguments) -> dict[str, Any]:
        """The model, rewards, prompts and output folder; FSDP when launched on several processes; evaluation when
        held-out prompts are given."""
        values: dict[str, Any] = {
            "output_dir": self.output_dir,
            "model_name_or_path": self.model,
            "reward_funcs": list(self.preset.reward_funcs if self.reward_funcs is None else self.reward_funcs),
            "dataset_name": self.dataset,
            "dataset_prompt_column": self.prompt_column,
        }
        if self.fsdp_blocks and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            values |= {
                "fsdp": True,
                "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": list(self.fsdp_blocks)},
            }
        if args.eval_dataset_name:
            values["eval_strategy"] = "steps"
        return values

    def load_dataset(self, args: ExampleArguments) -> Dataset:
        """The training prompts of ``dataset_name`` (editing: with their ``source_image``)."""
        if not args.dataset_name:
            raise UsageError("dataset_name is required without --tiny: set --dataset_name to a Hub dataset or a file.")
        dataset = read_prompts(args, args.dataset_name, "train", "dataset_name")
        if self.source_image_column:
            from datasets import Image

            column, root = self.source_image_column, os.path.dirname(os.path.abspath(args.dataset_name))
            dataset = dataset.map(lambda row: {"source_image": os.path.join(root, row[column])})
            dataset = dataset.cast_column("source_image", Image(mode="RGB"))
        return dataset

    def build_trainer(self, args: ExampleArguments, config: GRPOJaggConfig) -> DDPOJaggTrainer:
        """The trainer the arguments describe, not yet trained (``--tiny`` builds its tiny models here)."""
        eval_dataset = None
        if args.tiny:
            tiny = self.tiny_setup(args, config)
            model, reward_funcs, dataset = tiny.model, [tiny.reward], tiny.dataset
        else:
            check_local_paths(args)
            model, reward_funcs, dataset = args.model_name_or_path, args.reward_funcs or [], self.load_dataset(args)
            if args.eval_dataset_name and config.eval_strategy != "no":
                eval_dataset = read_prompts(args, args.eval_dataset_name, "test", "eval_dataset_name")
        reward_funcs = checked_reward_funcs(reward_funcs, config)
        return new_trainer(model, reward_funcs, config, dataset, eval_dataset, self.preset.lora_config(), self.recipe)

    def main(self, argv: Sequence[str] | None = None) -> None:
        """Parse (:meth:`parse_args`), build, train, save (and push with ``--push_to_hub true``); a usage error is
        one line on stderr and exit status 2."""
        args, config = self.parse_args(argv)
        try:
            trainer = self.build_trainer(args, config)
        except UsageError as error:
            self.exit_with(error)
        train_and_save(trainer, config, None if args.tiny else args.dataset_name)
