"""Presets: the public Flow-GRPO(-Fast), DanceGRPO, MixGRPO, Flow-Factory and DiffusionNFT recipes as named GRPOJaggConfig values.

.. code-block:: python

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.recipes import get_recipe

    args = GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir="runs/sd35", max_steps=500)
    recipe = get_recipe("flow-grpo-sd35")
    trainer = DDPOJaggTrainer(
        recipe.model, reward_funcs=list(recipe.reward_funcs), args=args, train_dataset=dataset,
        peft_config=recipe.lora_config(),
    )

This module holds data only and imports nothing of trl_jagg: the config reads it
(:meth:`GRPOJaggConfig.from_recipe <trl_jagg.GRPOJaggConfig.from_recipe>`), never the other way round.

A :class:`Recipe` holds the base model's Hub id, the :class:`~trl_jagg.GRPOJaggConfig` values, the LoRA settings
(``None`` for full fine-tuning), a scheduler override where the recipe changes the model's schedule (DanceGRPO's
fixed shift 3), the reward it was published with, and where the numbers come from. Every preset uses the JAGG
settings of the paper: groups of ``W = 4`` trained steps, the high-noise 60% of the groups routed to JAGG, except
where fewer steps are trained (Flow-GRPO-Fast trains 3, so its ``W`` is 3; Flow-GRPO's Qwen-Image 2, so ``W = 2``:
a group longer than the trained steps would always run exact).

The CLI's YAML files are generated from these presets, never edited by hand; they ship in the package
(``trl_jagg/configs/recipes/<name>.yaml``, :func:`trl_jagg.configs.config_dir`), which a checkout links as
``examples/recipes/``::

    python -m trl_jagg.recipes examples/recipes
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from trl_jagg.recipes._shared import ATTENTION_PROJECTIONS, PAPER_JAGG
from trl_jagg.recipes.awm import AWM_RECIPES
from trl_jagg.recipes.dancegrpo import DANCEGRPO_RECIPES
from trl_jagg.recipes.dgpo import DGPO_RECIPES
from trl_jagg.recipes.diffusion_nft import DIFFUSION_NFT_RECIPES
from trl_jagg.recipes.flow_factory import FLOW_FACTORY_RECIPES
from trl_jagg.recipes.flow_grpo import FLOW_GRPO_RECIPES
from trl_jagg.recipes.recipe import Recipe

__all__ = [
    "ATTENTION_PROJECTIONS", "PAPER_JAGG", "RECIPES", "Recipe", "get_recipe", "list_recipes", "write_recipe_yamls",
]  # fmt: skip

RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        recipe.name: recipe
        for recipe in (
            *FLOW_GRPO_RECIPES,
            *DANCEGRPO_RECIPES,
            *FLOW_FACTORY_RECIPES,
            *DIFFUSION_NFT_RECIPES,
            *AWM_RECIPES,
            *DGPO_RECIPES,
        )
    }
)
"""Every preset by name, in the order of ``docs/models.md``."""


def list_recipes() -> list[str]:
    """The preset names, in the order of ``docs/models.md``."""
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    """The preset ``name``; an unknown name raises a ``ValueError`` listing the presets."""
    try:
        return RECIPES[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown recipe {name!r}.{hint} Presets: {list_recipes()}.") from None


def write_recipe_yamls(directory: str | os.PathLike[str]) -> list[str]:
    """Write ``<directory>/<name>.yaml`` for every preset; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for recipe in RECIPES.values():
        path = os.path.join(directory, f"{recipe.name}.yaml")
        with open(path, "w") as handle:
            handle.write(recipe.to_yaml())
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trl_jagg.recipes [DIRECTORY]``: regenerate the YAML files (default ``examples/recipes``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for path in write_recipe_yamls(argv[0] if argv else os.path.join("examples", "recipes")):
        print(path)
