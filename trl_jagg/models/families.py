"""One record per model family: everything the package, its tests and its docs know about a family, in one place.

The registry (:data:`~trl_jagg.models.MODEL_ADAPTERS`), the tiny test pipelines
(:func:`~trl_jagg.testing.tiny_models.build_tiny_pipeline`), the tests' ``tiny_<family>_path`` fixtures and family
matrix, the docs test's Hub stand-ins and the family list of ``trl-jagg --help`` (:data:`trl_jagg.MODEL_FAMILIES`) are
all read from :data:`FAMILIES`. Adding a family is its adapter file and its record here (and, when no existing tiny
builder serves it, a tiny builder in :mod:`trl_jagg.testing`).

This module imports nothing heavy: the adapter and the tiny builder are named by import path and imported on use, so
the CLI's ``--help`` lists the families without importing torch or diffusers.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from trl_jagg.models.base import FlowMatchingAdapter

Task = Literal["text-to-image", "image editing", "text-to-video"]
TASKS: tuple[Task, ...] = ("text-to-image", "image editing", "text-to-video")
"""The tasks, in the order the family list names them."""

COMMON = "tests/test_family_contract.py"
"""The family test matrix every family passes unless it has a contract of its own (:attr:`ModelFamily.contract`)."""


def _frozen(values: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(values or {}))


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelFamily:
    """What the package knows about one model family (one checkpoint line of one diffusers pipeline class).

    Attributes:
        name: the family's key: the tiny builder's ``family`` argument, the ``tiny_<name>_path`` fixture, the tests'
            parameter id (``"flux"``).
        pipeline: the diffusers pipeline class name that ``model_index.json`` holds (``"FluxPipeline"``); several
            families may share one (Wan2.1 and both Wan2.2 lines are ``WanPipeline``).
        adapter: import path of the adapter class, ``"module:Class"``; families of one pipeline share their adapter.
        task: what the family generates: ``"text-to-image"``, ``"image editing"`` or ``"text-to-video"``.
        words: how the family list names it after the previous family of its task (``"FLUX.2 klein"``, then
            ``"dev"``), so the list reads "FLUX.2 klein and dev".
        hub_ids: the Hub checkpoints of the family (what the presets and docs load); the docs test serves a tiny
            pipeline under each id it needs.
        tiny_builder: import path of the builder of its tiny pipeline, ``"module:function"`` in
            :mod:`trl_jagg.testing` (referenced by name: the models never import the test helpers).
        tiny_options: keyword arguments of that builder that make this family's variant (Wan2.2's
            ``boundary_ratio``).
        tiny_config: ``GRPOJaggConfig`` values a tiny run of this family needs beyond the shared ones (a video's
            ``num_frames``, a longer ``max_sequence_length``).
        guided: a guidance setting with guidance on (``guidance_scale``, ``true_cfg_scale``): CFG where the family
            has it, else its embedded guidance.
        unguided: a setting with classifier-free guidance off (both empty where the family's own tests set guidance).
        negative_prompt: the negative prompt of :attr:`guided`'s unconditional branch (``""``: the pipeline's own
            empty one; ``None``: the family has no CFG branch).
        contract: the test file that checks the family: :data:`COMMON`, or a file of its own where its contract
            differs (source images, two experts).
    """

    name: str
    pipeline: str
    adapter: str
    task: Task
    words: str
    hub_ids: tuple[str, ...]
    tiny_builder: str
    tiny_options: Mapping[str, Any] = field(default_factory=_frozen)
    tiny_config: Mapping[str, Any] = field(default_factory=_frozen)
    guided: Mapping[str, float] = field(default_factory=_frozen)
    unguided: Mapping[str, float] = field(default_factory=_frozen)
    negative_prompt: str | None = "dark"
    contract: str = COMMON

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"ModelFamily {self.name!r}: task={self.task!r}; use one of {TASKS}.")
        for name in ("tiny_options", "tiny_config", "guided", "unguided"):  # read-only, as the record is
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def adapter_class(self) -> type[FlowMatchingAdapter]:
        """The adapter class (imports its module)."""
        return _import(self.adapter)

    def tiny_pipeline_builder(self) -> Callable[..., Any]:
        """The tiny builder (imports :mod:`trl_jagg.testing`, hence diffusers and transformers)."""
        return _import(self.tiny_builder)


_TINY = "trl_jagg.testing.tiny_models"
_NO_CFG = {"guidance_scale": 1.0, "true_cfg_scale": 1.0}

FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        "flux", "FluxPipeline", "trl_jagg.models.flux:FluxAdapter", "text-to-image", "Flux",
        ("black-forest-labs/FLUX.1-dev",), f"{_TINY}:build_tiny_flux_pipeline",
        # Flux's guidance is embedded; true CFG runs on top of it.
        guided={"guidance_scale": 3.5, "true_cfg_scale": 4.0}, unguided={"guidance_scale": 3.5, "true_cfg_scale": 1.0},
    ),
    ModelFamily(
        "sd3", "StableDiffusion3Pipeline", "trl_jagg.models.sd3:SD3Adapter", "text-to-image", "SD3 / SD3.5",
        ("stabilityai/stable-diffusion-3.5-medium", "stabilityai/stable-diffusion-3.5-large"),
        f"{_TINY}:build_tiny_sd3_pipeline", guided={"guidance_scale": 4.5, "true_cfg_scale": 1.0}, unguided=_NO_CFG,
    ),
    ModelFamily(
        "qwenimage", "QwenImagePipeline", "trl_jagg.models.qwenimage:QwenImageAdapter", "text-to-image", "Qwen-Image",
        ("Qwen/Qwen-Image",), f"{_TINY}:build_tiny_qwenimage_pipeline",
        guided={"guidance_scale": 1.0, "true_cfg_scale": 4.0}, unguided=_NO_CFG,
    ),
    ModelFamily(
        "zimage", "ZImagePipeline", "trl_jagg.models.zimage:ZImageAdapter", "text-to-image", "Z-Image",
        ("Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Turbo"), f"{_TINY}:build_tiny_zimage_pipeline",
        # Z-Image-Turbo samples without guidance (scale 0).
        guided={"guidance_scale": 3.0, "true_cfg_scale": 1.0}, unguided={"guidance_scale": 0.0, "true_cfg_scale": 1.0},
    ),
    ModelFamily(
        "flux2_klein", "Flux2KleinPipeline", "trl_jagg.models.flux2:Flux2KleinAdapter", "text-to-image",
        "FLUX.2 klein", ("black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B"),
        "trl_jagg.testing.tiny_flux2:build_tiny_flux2_klein_pipeline",
        guided={"guidance_scale": 4.0, "true_cfg_scale": 1.0}, unguided=_NO_CFG,
        negative_prompt="",  # the pipeline's own: "" whenever CFG is on
    ),
    ModelFamily(
        "flux2_dev", "Flux2Pipeline", "trl_jagg.models.flux2:Flux2Adapter", "text-to-image", "dev",
        ("black-forest-labs/FLUX.2-dev",), "trl_jagg.testing.tiny_flux2:build_tiny_flux2_dev_pipeline",
        tiny_config={"max_sequence_length": 48},  # its system message takes the first 31 tokens of the encoding
        # Embedded guidance only (Flow-Factory's 4); another embedded value as the "unguided" one.
        guided={"guidance_scale": 4.0, "true_cfg_scale": 1.0}, unguided=_NO_CFG, negative_prompt=None,
    ),
    ModelFamily(
        "flux_kontext", "FluxKontextPipeline", "trl_jagg.models.flux_kontext:FluxKontextAdapter", "image editing",
        "FLUX.1 Kontext", ("black-forest-labs/FLUX.1-Kontext-dev",), f"{_TINY}:build_tiny_flux_kontext_pipeline",
        guided={"guidance_scale": 3.5, "true_cfg_scale": 2.0}, unguided={"guidance_scale": 3.5, "true_cfg_scale": 1.0},
        contract="tests/test_families.py",
    ),
    ModelFamily(
        "qwenimage_edit", "QwenImageEditPipeline", "trl_jagg.models.qwenimage_edit:QwenImageEditAdapter",
        "image editing", "Qwen-Image-Edit", ("Qwen/Qwen-Image-Edit",), f"{_TINY}:build_tiny_qwenimage_edit_pipeline",
        tiny_config={"source_image_area": 32 * 32},  # sources at the output's 32 x 32 px, not 1024 x 1024
        contract="tests/test_qwen_edit.py",
    ),
    ModelFamily(
        "qwenimage_edit_plus", "QwenImageEditPlusPipeline",
        "trl_jagg.models.qwenimage_edit:QwenImageEditPlusAdapter", "image editing", "Edit-Plus",
        ("Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511"), f"{_TINY}:build_tiny_qwenimage_edit_pipeline",
        tiny_options={"plus": True}, tiny_config={"source_image_area": 32 * 32}, contract="tests/test_qwen_edit.py",
    ),
    ModelFamily(
        "wan", "WanPipeline", "trl_jagg.models.wan:WanAdapter", "text-to-video", "Wan2.1",
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
        "trl_jagg.testing.tiny_wan:build_tiny_wan_pipeline",
        tiny_config={"num_frames": 5},  # 5-frame videos: 2 latent frames
        guided={"guidance_scale": 4.5, "true_cfg_scale": 1.0}, unguided=_NO_CFG,  # Flow-GRPO's Wan2.1 guidance
    ),
    ModelFamily(
        "wan22", "WanPipeline", "trl_jagg.models.wan:WanAdapter", "text-to-video", "Wan2.2 A14B",
        ("Wan-AI/Wan2.2-T2V-A14B-Diffusers",), "trl_jagg.testing.tiny_wan:build_tiny_wan_pipeline",
        # A14B ships 0.875; at 0.8 the first 2 steps of 4 or 5 and 3 of 7 (t >= 800) are high-noise ones.
        tiny_options={"boundary_ratio": 0.8},
        # The 4 trained steps of a tiny run are 2 per expert: groups of W = 2, one on each side of the switch.
        tiny_config={"num_frames": 5, "jagg_group_size": 2}, contract="tests/test_wan22.py",
    ),
    ModelFamily(
        "wan22_ti2v", "WanPipeline", "trl_jagg.models.wan:WanAdapter", "text-to-video", "TI2V-5B",
        ("Wan-AI/Wan2.2-TI2V-5B-Diffusers",), "trl_jagg.testing.tiny_wan:build_tiny_wan_pipeline",
        tiny_options={"ti2v": True}, tiny_config={"num_frames": 5},  # TI2V-5B: per-token timesteps
        contract="tests/test_wan22_ti2v.py",
    ),
)  # fmt: skip
"""Every supported family, in the order the family list names them (by task)."""


def family(name: str) -> ModelFamily:
    """The record of family ``name``; an unknown name raises a ``ValueError`` listing the others."""
    for record in FAMILIES:
        if record.name == name:
            return record
    raise ValueError(f"Unknown family {name!r}; expected one of {tuple(r.name for r in FAMILIES)}.")


def adapter_paths() -> dict[str, str]:
    """The adapter import path serving each supported pipeline class name, in :data:`FAMILIES` order."""
    paths: dict[str, str] = {}
    for record in FAMILIES:
        if paths.setdefault(record.pipeline, record.adapter) != record.adapter:
            raise ValueError(f"{record.pipeline} is served by {paths[record.pipeline]} and by {record.adapter}.")
    return paths


def families_in_words() -> str:
    """The supported families in words, by task: "text-to-image (Flux, SD3 / SD3.5, ...), image editing (...) and
    text-to-video (...)"."""

    def listed(words: list[str]) -> str:
        return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else words[0]

    parts = [f"{task} ({listed([r.words for r in FAMILIES if r.task == task])})" for task in TASKS]
    return listed(parts)
