"""Model registry: the diffusers pipeline class decides which adapter serves a model.

Adding a model family means one adapter file and one line in ``MODEL_ADAPTERS``.
"""

from __future__ import annotations

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
from trl_jagg.utils.hub_access import check_hub_file

MODEL_ADAPTERS: dict[str, type[FlowMatchingAdapter]] = {
    "FluxPipeline": FluxAdapter,
    "FluxKontextPipeline": FluxKontextAdapter,  # FLUX.1 Kontext: image editing
    "Flux2Pipeline": Flux2Adapter,  # FLUX.2 dev: embedded guidance
    "Flux2KleinPipeline": Flux2KleinAdapter,  # FLUX.2 klein, base and step-distilled
    "StableDiffusion3Pipeline": SD3Adapter,  # SD3 and SD3.5
    "QwenImagePipeline": QwenImageAdapter,
    "QwenImageEditPipeline": QwenImageEditAdapter,  # Qwen-Image-Edit: image editing, one source image
    "QwenImageEditPlusPipeline": QwenImageEditPlusAdapter,  # Qwen-Image-Edit-2509/2511: one or several
    "ZImagePipeline": ZImageAdapter,
    "WanPipeline": WanAdapter,  # Wan2.1 text-to-video
}


def adapter_class(pipeline_class_name: str) -> type[FlowMatchingAdapter]:
    """The adapter serving a pipeline class name; an unsupported one raises a ``ValueError`` listing the others."""
    try:
        return MODEL_ADAPTERS[pipeline_class_name]
    except KeyError:
        raise ValueError(
            f"Unsupported pipeline class {pipeline_class_name!r}. trl_jagg supports {sorted(MODEL_ADAPTERS)}; "
            "see CONTRIBUTING.md to add a model family (one adapter file and one registry line)."
        ) from None


def load_adapter(
    model: str | DiffusionPipeline, *, dtype: torch.dtype = torch.float32, revision: str | None = None
) -> FlowMatchingAdapter:
    """Wrap a pipeline, or load one from a Hub id / local directory, in its adapter.

    The pipeline class is read from ``model_index.json`` first, so an unsupported model fails before any
    weights are downloaded or loaded; before that, a gated, unknown or (offline) uncached id raises a
    :class:`~trl_jagg.utils.hub_access.HubAccessError` that says what to do.
    """
    if isinstance(model, DiffusionPipeline):
        return adapter_class(type(model).__name__)(model)
    check_hub_file(model, "model_index.json", what="model", revision=revision)
    class_name = DiffusionPipeline.load_config(model, revision=revision)["_class_name"]
    adapter_cls = adapter_class(class_name)
    pipeline = adapter_cls.pipeline_class.from_pretrained(model, dtype=dtype, revision=revision)
    return adapter_cls(pipeline)


__all__ = [
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
