"""The :class:`Recipe` record: one named preset (the presets themselves are in :mod:`trl_jagg.recipes`).

Like the presets, it imports nothing of trl_jagg: the config reads them, never the other way round.
"""

from __future__ import annotations

import textwrap
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from peft import LoraConfig


@dataclass(frozen=True)
class Recipe:
    """A named preset.

    Attributes:
        name: the preset's name (``GRPOJaggConfig.from_recipe(name, ...)``).
        model: Hub id of the base pipeline the recipe fine-tunes.
        description: one line: what the recipe is.
        source: where the numbers come from.
        config: :class:`~trl_jagg.GRPOJaggConfig` field values (read-only).
        lora: :class:`~peft.LoraConfig` keyword arguments, or ``None`` for full fine-tuning.
        scheduler: scheduler config overrides the recipe applies to the pipeline (``None``: the model's own).
            :meth:`apply_scheduler` applies them; a pipeline loaded from ``model`` does not have them.
        reward_funcs: the reward names the recipe was published with (see ``docs/rewards.md``).
        mixed_precision: the Trainer's mixed-precision flag the recipe trains with on GPUs, ``"fp16"`` or
            ``"bf16"`` (``None``: none). It is not in ``config`` because a CPU-only machine refuses it: pass
            ``**{recipe.mixed_precision: True}`` to :meth:`GRPOJaggConfig.from_recipe` (or ``--bf16 true`` /
            ``--fp16 true`` to the CLI). With ``config["dtype"] == "float32"`` this is the peer's precision: float32
            weights, the backbone's forward under autocast.
        notes: what the preset does not express, or chose where the source is silent.
        deprecated: why the preset is deprecated and what to use instead (``None``: it is not);
            :meth:`GRPOJaggConfig.from_recipe` warns with it. A deprecated preset is removed in a later release.
    """

    name: str
    model: str
    description: str
    source: str
    config: Mapping[str, Any]
    lora: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None
    reward_funcs: tuple[str, ...] = ()
    mixed_precision: str | None = None
    notes: tuple[str, ...] = ()
    deprecated: str | None = None

    def __post_init__(self) -> None:
        for name in ("config", "lora", "scheduler"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, MappingProxyType(dict(value)))
        if self.mixed_precision not in (None, "fp16", "bf16"):
            raise ValueError(f"Recipe.mixed_precision is {self.mixed_precision!r}. Use 'fp16', 'bf16' or None.")

    def warn_if_deprecated(self) -> None:
        """A ``FutureWarning`` naming the replacement when the preset is :attr:`deprecated`."""
        if self.deprecated:
            warnings.warn(f"The preset {self.name!r} is deprecated: {self.deprecated}", FutureWarning, stacklevel=3)

    def variant(self, name: str, description: str, config: Mapping[str, Any], **fields: Any) -> Recipe:
        """This recipe under another ``name``, with ``config`` values on top and other attributes replaced by
        ``fields`` (e.g. ``notes``, ``reward_funcs``)."""
        return replace(self, name=name, description=description, config={**self.config, **config}, **fields)

    @property
    def objective(self) -> str:
        """The objective the preset trains with (``GRPOJaggConfig.objective``: GRPO where the preset sets none)."""
        return self.config.get("objective", "grpo")

    def lora_config(self) -> LoraConfig | None:
        """The recipe's LoRA adapter as a :class:`~peft.LoraConfig` (``None`` for full fine-tuning)."""
        if self.lora is None:
            return None
        from peft import LoraConfig

        values = dict(self.lora)
        values["target_modules"] = list(values["target_modules"])
        return LoraConfig(**values)

    def apply_scheduler(self, pipeline: DiffusionPipeline) -> DiffusionPipeline:
        """Replace ``pipeline.scheduler`` by one with the recipe's overrides (a no-op without any); returns it."""
        if self.scheduler:
            scheduler = pipeline.scheduler
            pipeline.scheduler = type(scheduler).from_config(scheduler.config, **self.scheduler)
        return pipeline

    def cli_values(self) -> dict[str, Any]:
        """The recipe as ``trl-jagg train`` fields: model, rewards and LoRA (``ScriptArguments``) then config."""
        values: dict[str, Any] = {"model_name_or_path": self.model, "reward_funcs": list(self.reward_funcs)}
        if self.lora is not None:
            values |= {
                "use_peft": True,
                "lora_r": self.lora["r"],
                "lora_alpha": self.lora["lora_alpha"],
                "lora_target_modules": list(self.lora["target_modules"]),
            }
        return values | dict(self.config)

    def to_yaml(self) -> str:
        """The YAML config of ``trl-jagg train --config``, with the recipe's documentation as a header."""
        import yaml

        usage = (
            f"trl-jagg train --config examples/recipes/{self.name}.yaml --output_dir runs/{self.name} "
            "--dataset_name <prompts: Hub dataset or .txt/.json/.jsonl/.csv/.parquet file>"
        )
        lines = [
            f"{self.name}: {self.description}",
            f"Source: {self.source}",
            "Generated from trl_jagg/recipes/ by `python -m trl_jagg.recipes examples/recipes`: edit the preset "
            "there, not this file (tests/test_recipes.py fails on drift).",
            f"Usage: {usage}",
        ]
        if self.mixed_precision:
            lines.append(
                f"On GPUs add --{self.mixed_precision} true: the recipe's mixed precision (a CPU-only machine refuses "
                "it, so it is not among the values below)."
            )
        if self.scheduler:
            lines.append(
                f"The scheduler override {dict(self.scheduler)} is not a config field: the CLI applies it because "
                f"`recipe: {self.name}` names the preset. Keep that line."
            )
        lines += [f"Note: {note}" for note in self.notes]
        header = "".join(
            "\n".join(textwrap.wrap(line, 117, initial_indent="# ", subsequent_indent="#   ")) + "\n" for line in lines
        )
        # `recipe:` makes the CLI start from the preset (and apply its scheduler override); the explicit values
        # below repeat it so that the file documents, and can edit, every one of them.
        values = {"recipe": self.name} | self.cli_values()
        return header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False, width=119)
