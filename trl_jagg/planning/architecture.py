"""A pipeline's architecture without its weights: each component's class and config, built on the ``meta`` device.

The configs of the families the planner supports ship as small JSON files in ``architectures/`` (one per Hub id,
each naming where its numbers come from), so a plan needs neither the Hub nor a download. A local folder in the
diffusers layout (``model_index.json`` and each component's ``config.json``) is read the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES_DIR = Path(__file__).with_name("architectures")
"""The shipped architectures: ``<name>.json`` with ``hub_id``, ``pipeline``, ``source`` (where each number comes
from), ``not_verified`` (what was not checked against the Hub repository's own files) and ``components``, or
``components_of``: the Hub id of a shipped architecture whose components it shares, ``components`` then replacing
or adding some of them."""

BACKBONES = ("transformer", "transformer_2")
"""The denoisers: one, or Wan2.2 A14B's two experts (high noise, then low noise)."""
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
"""The components that encode prompts (frozen; on the GPU unless ``offload_frozen_modules``)."""


@contextlib.contextmanager
def skipped_initialisation() -> Iterator[None]:
    """``torch.nn.init``'s initialisers as no-ops while modules are built on ``meta`` (and LoRA adapters added): a
    meta tensor has no values to fill, and dispatching each fill costs milliseconds, seconds for a large backbone."""
    names = [name for name in dir(torch.nn.init) if name.endswith("_") and not name.startswith("_")]
    originals = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(torch.nn.init, name, function)


@dataclass(frozen=True)
class Component:
    """One module of a pipeline: ``library`` (``diffusers`` or ``transformers``), its class and its config."""

    name: str
    library: str
    class_name: str
    config: Mapping[str, Any]
    config_class: str | None = None
    """For ``transformers`` modules: the config class the keyword arguments build (``None``: ``config`` is a
    ``config.json`` read whole, loaded with ``AutoConfig``)."""

    def build_on_meta(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The module with every parameter on the ``meta`` device (shapes and dtypes, no storage)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in ``dtype``: a cast afterwards would warn about fp32-kept modules
        try:
            return self._build_on_meta()
        finally:
            torch.set_default_dtype(previous)

    def _build_on_meta(self) -> torch.nn.Module:
        with torch.device("meta"), skipped_initialisation():
            if self.library == "diffusers":
                import diffusers

                module = getattr(diffusers, self.class_name).from_config(dict(self.config))
            elif self.library == "transformers":
                import transformers

                if self.config_class is not None:
                    config = getattr(transformers, self.config_class)(**self.config)
                else:
                    config = transformers.AutoConfig.for_model(**self.config)
                module = getattr(transformers, self.class_name)._from_config(config)
            else:
                raise ValueError(f"{self.name}: library {self.library!r} is neither 'diffusers' nor 'transformers'.")
        return module


@dataclass(frozen=True)
class Architecture:
    """A pipeline's components, from a shipped JSON file or a local model folder."""

    model: str
    pipeline: str
    source: str
    components: Mapping[str, Component]
    not_verified: str | None = None
    """What of the shipped numbers was not checked against the Hub repository's own config files."""

    @property
    def backbone(self) -> Component:
        """The denoiser the run trains (``transformer``; Wan2.2 A14B: its high-noise expert)."""
        return self.components["transformer"]

    @property
    def backbones(self) -> dict[str, Component]:
        """Every denoiser by component name: ``transformer`` and, for Wan2.2 A14B, ``transformer_2``."""
        return {name: self.components[name] for name in BACKBONES if name in self.components}

    @property
    def frozen(self) -> list[Component]:
        """The frozen modules the run keeps beside the backbone: the text encoders and the VAE."""
        return [self.components[name] for name in (*TEXT_ENCODERS, "vae") if name in self.components]


@cache
def shipped_architectures() -> dict[str, Path]:
    """Hub id -> the shipped JSON file describing it."""
    found = {}
    for path in sorted(ARCHITECTURES_DIR.glob("*.json")):
        found[json.loads(path.read_text())["hub_id"]] = path
    return found


def _from_record(model: str, record: Mapping[str, Any]) -> Architecture:
    components = {
        name: Component(
            name=name,
            library=entry["library"],
            class_name=entry["class_name"],
            config=entry["config"],
            config_class=entry.get("config_class"),
        )
        for name, entry in record["components"].items()
    }
    return Architecture(
        model=model,
        pipeline=record["pipeline"],
        source=record["source"],
        components=components,
        not_verified=record.get("not_verified"),
    )


def _is_module_class(library: str | None, class_name: str | None) -> bool:
    if library not in ("diffusers", "transformers") or not class_name:
        return False
    import importlib

    found = getattr(importlib.import_module(library), class_name, None)
    return isinstance(found, type) and issubclass(found, torch.nn.Module)


def _from_folder(folder: str) -> Architecture:
    index = json.loads(Path(folder, "model_index.json").read_text())
    components = {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list) or not _is_module_class(*value):
            continue  # tokenizers, schedulers, processors: no weights
        config_path = Path(folder, name, "config.json")
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} is missing: the plan reads every component's config.json.")
        config = json.loads(config_path.read_text())
        if value[0] == "transformers":
            config = {
                key: item for key, item in config.items() if key not in ("architectures", "transformers_version")
            }
        components[name] = Component(name=name, library=value[0], class_name=value[1], config=config)
    if "transformer" not in components:
        raise ValueError(f"{folder}/model_index.json has no 'transformer': the plan sizes transformer backbones.")
    return Architecture(model=folder, pipeline=index["_class_name"], source=f"{folder} (local)", components=components)


def load_architecture(model: str) -> Architecture:
    """The architecture of ``model``: a local diffusers folder, or a Hub id the planner ships (offline).

    Raises:
        ValueError: for a Hub id with no shipped architecture (the message lists those shipped and says to pass a
            local folder holding the configs instead).
    """
    if os.path.isdir(model):
        return _from_folder(model)
    shipped = shipped_architectures()
    if model not in shipped:
        raise ValueError(
            f"model_name_or_path {model!r}: no architecture shipped for it (shipped: {', '.join(shipped)}). Pass a "
            "local folder in the diffusers layout instead (model_index.json and each component's config.json; "
            "no weights needed)."
        )
    return _from_record(model, _shipped_record(model))


def _shipped_record(hub_id: str) -> dict[str, Any]:
    """The shipped record of ``hub_id`` with the components it shares with another (``components_of``) merged in:
    the other's, then its own, which replace or add some (Wan2.1 14B: the 1.3B model's text encoder and VAE)."""
    record = json.loads(shipped_architectures()[hub_id].read_text())
    if "components_of" in record:
        shared = _shipped_record(record["components_of"])["components"]
        record = {**record, "components": {**shared, **record.get("components", {})}}
    return record
