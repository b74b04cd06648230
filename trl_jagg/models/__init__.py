"""Model registry: the diffusers pipeline class decides which adapter serves a model.

Each family's record in :mod:`trl_jagg.models.families` names its pipeline class and adapter; :data:`MODEL_ADAPTERS`
is read from the records. Adding a model family means its adapter file and its record (see CONTRIBUTING.md).

The adapters are imported on first use (this module imports neither torch nor diffusers), so reading the family
records, as ``trl-jagg --help`` does, costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trl_jagg.models.families import FAMILIES, adapter_paths

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from trl_jagg.models.base import Conditioning, FlowMatchingAdapter, classifier_free_guidance
    from trl_jagg.models.flux import FluxAdapter
    from trl_jagg.models.flux2 import Flux2Adapter, Flux2KleinAdapter
    from trl_jagg.models.flux_kontext import FluxKontextAdapter
    from trl_jagg.models.qwenimage import QwenImageAdapter
    from trl_jagg.models.qwenimage_edit import QwenImageEditAdapter, QwenImageEditPlusAdapter
    from trl_jagg.models.sd3 import SD3Adapter
    from trl_jagg.models.wan import WanAdapter
    from trl_jagg.models.zimage import ZImageAdapter

_BASE = dict.fromkeys(("Conditioning", "FlowMatchingAdapter", "classifier_free_guidance"), "trl_jagg.models.base")
_ADAPTERS = {path.partition(":")[2]: path.partition(":")[0] for path in adapter_paths().values()}


def _import(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    if name == "MODEL_ADAPTERS":
        adapters = {pipeline: _import(*path.split(":")) for pipeline, path in adapter_paths().items()}
        globals()[name] = adapters  # built once
        return adapters
    if name in _BASE or name in _ADAPTERS:
        return _import((_BASE | _ADAPTERS)[name], name)
    raise AttributeError(f"module 'trl_jagg.models' has no attribute {name!r}")


def adapter_class(pipeline_class_name: str) -> type[FlowMatchingAdapter]:
    """The adapter serving a pipeline class name; an unsupported one raises a ``ValueError`` listing the others."""
    paths = adapter_paths()
    if pipeline_class_name not in paths:
        raise ValueError(
            f"Unsupported pipeline class {pipeline_class_name!r}. trl_jagg supports {sorted(paths)}; "
            "see CONTRIBUTING.md to add a model family (its adapter file and its record in models/families.py)."
        )
    return _import(*paths[pipeline_class_name].split(":"))


def load_adapter(
    model: str | DiffusionPipeline, *, dtype: torch.dtype | None = None, revision: str | None = None
) -> FlowMatchingAdapter:
    """Wrap a pipeline, or load one from a Hub id / local directory, in its adapter.

    The pipeline class is read from ``model_index.json`` first, so an unsupported model fails before any
    weights are downloaded or loaded; before that, a gated, unknown or (offline) uncached id raises a
    :class:`~trl_jagg.utils.hub_access.HubAccessError` that says what to do. ``dtype`` defaults to float32.
    """
    import torch
    from diffusers import DiffusionPipeline

    from trl_jagg.utils.hub_access import check_hub_file

    if isinstance(model, DiffusionPipeline):
        return adapter_class(type(model).__name__)(model)
    check_hub_file(model, "model_index.json", what="model", revision=revision)
    class_name = DiffusionPipeline.load_config(model, revision=revision)["_class_name"]
    adapter_cls = adapter_class(class_name)
    pipeline = adapter_cls.pipeline_class.from_pretrained(
        model, dtype=torch.float32 if dtype is None else dtype, revision=revision
    )
    return adapter_cls(pipeline)


__all__ = [
    "FAMILIES",
    "MODEL_ADAPTERS",
    "Conditioning",
    "FlowMatchingAdapter",
    "Flux2Adapter",
    "Flux2KleinAdapter",
    "FluxKontextAdapter",
    "FluxAdapter",
    "QwenImageAdapter",
    "QwenImageEditAdapter",
    "QwenImageEditPlusAdapter",
    "SD3Adapter",
    "WanAdapter",
    "ZImageAdapter",
    "adapter_class",
    "classifier_free_guidance",
    "load_adapter",
]
