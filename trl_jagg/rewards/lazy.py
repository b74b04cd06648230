"""Shared machinery for rewards backed by a model: lazy one-time loading, batching, device and dtype handling."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from trl_jagg.utils.hub_access import HubAccessError, check_hub_file

# The image statistics of OpenAI's CLIP, which CLIP-derived reward models (HPSv2, ImageReward) normalise with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` means CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``dtype`` as a ``torch.dtype`` (``"bf16"``, ``"float16"``... accepted, for configs); ``None`` means float32."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB mode: reward models are trained on 3-channel images; RGBA/L/P inputs are converted."""
    if not isinstance(image, Image.Image):
        raise TypeError(f"Rewards take PIL images, got {type(image).__name__}.")
    return image if image.mode == "RGB" else image.convert("RGB")


def check_pairs(prompts: Sequence[str], images: Sequence[Image.Image]) -> None:
    """Raise if prompts and images do not pair up one to one."""
    if len(prompts) != len(images):
        raise ValueError(f"Got {len(prompts)} prompts for {len(images)} images; a reward needs one prompt per image.")


class LazyModelReward:
    """Base class of model-backed rewards: the model loads on the first call (once, thread-safe) and
    images are scored in batches of ``batch_size`` under ``torch.inference_mode``.

    Subclasses implement :meth:`_load` (build the model in eval mode on ``self.device`` in ``self.dtype``) and
    :meth:`_score_batch` (scores for one batch of RGB images). Loading lazily keeps ``load_reward_funcs``
    cheap, so a config error elsewhere surfaces before gigabytes are downloaded or moved to the GPU.
    """

    def __init__(
        self,
        name: str,
        batch_size: int = 16,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.__name__ = name
        self.batch_size = batch_size
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self._loaded = False
        # A reward server scores requests from several threads; only one of them may load the model.
        self._load_lock = threading.Lock()

    def load(self) -> None:
        """Load the model now (otherwise it loads on the first call). Calling it again does nothing."""
        if self._loaded:
            return
        with self._load_lock:
            if not self._loaded:
                self._load()
                self._loaded = True

    def hub_files(self) -> list[tuple[str, str]]:
        """``(repo id or local directory, a file it must hold)`` for each Hub repository :meth:`_load` reads; a
        ``from_pretrained`` source is named by its ``config.json``. Subclasses loading from the Hub override it."""
        return []

    def check_weights(self) -> None:
        """Raise :class:`~trl_jagg.utils.hub_access.HubAccessError`, naming this reward and the repo, unless every file of
        :meth:`hub_files` is cached, local or downloadable (gated, unknown and offline-uncached repos fail).
        Cheap: nothing is downloaded; the trainer calls it before loading the pipeline."""
        if self._loaded:
            return
        for repo_id, filename in self.hub_files():
            try:
                check_hub_file(repo_id, filename, what=f"reward {self.__name__!r}: model")
            except HubAccessError as error:
                error.add_note(self._local_copy_hint(repo_id, filename))
                raise

    def _local_copy_hint(self, repo_id: str, filename: str) -> str:
        """Where a local copy of ``repo_id`` goes: the ``reward_kwargs`` entry of the parameter that names it."""
        names = [name for name, value in vars(self).items() if value == repo_id and not name.startswith("_")]
        if filename == "config.json" and names:  # a from_pretrained source: a local directory stands for the id
            entry = f'{{"{self.__name__}": {{"{names[0]}": "/path/to/{repo_id.split("/")[-1]}"}}}}'
            return f"A local copy goes in reward_kwargs: {entry} (in the YAML, or --reward_kwargs '{entry}')."
        return (
            f"A local copy goes in reward_kwargs, under {self.__name__!r}: the reward's parameters are in "
            "docs/rewards.md."
        )

    def _load(self) -> None:
        raise NotImplementedError

    def _score_batch(self, prompts: list[str], images: list[Image.Image]) -> torch.Tensor | Sequence[float]:
        raise NotImplementedError

    def __call__(self, prompts: Sequence[str], images: Sequence[Image.Image], **kwargs: Any) -> list[float]:
        """Score each (prompt, image) pair; extra dataset columns in ``kwargs`` are ignored."""
        check_pairs(prompts, images)
        self.load()
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                stop = start + self.batch_size
                batch = self._score_batch(list(prompts[start:stop]), [to_rgb(im) for im in images[start:stop]])
                if isinstance(batch, torch.Tensor):
                    batch = batch.detach().float().cpu().flatten().tolist()
                scores.extend(float(value) for value in batch)
        return scores

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.__name__!r}, loaded={self._loaded})"


def download(repo_id: str, filename: str) -> str:
    """Path of ``filename`` from the Hugging Face Hub repo ``repo_id`` (cached; honours ``HF_HUB_OFFLINE``)."""
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo_id, filename)
