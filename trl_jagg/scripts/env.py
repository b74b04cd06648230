"""``trl-jagg env``: the versions and the machine a bug report needs, like ``trl env``."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from trl_jagg.scripts.utils import CommandParser

DESCRIPTION = "Print the platform, the accelerators and the versions of the libraries trl_jagg runs on."

PACKAGES = (
    "torch", "diffusers", "transformers", "trl", "accelerate", "peft", "datasets", "huggingface_hub",
    "safetensors", "deepspeed", "open_clip_torch", "rapidocr-onnxruntime", "tensorboard", "wandb", "trackio",
)  # fmt: skip


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """``{what: value}``: platform, Python, trl_jagg, accelerators, library versions and the accelerate config."""
    import torch
    from accelerate.commands.config import default_config_file, load_config_from_file

    from trl_jagg import __version__

    if torch.cuda.is_available():
        devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    elif torch.backends.mps.is_available():
        devices = "MPS"
    else:
        devices = "cpu"
    accelerate_config = "not found"
    if os.path.isfile(default_config_file):
        values = load_config_from_file(default_config_file).to_dict()
        accelerate_config = "".join(f"\n  - {key}: {value}" for key, value in values.items())
    return {
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "trl_jagg version": __version__,
        "Accelerator(s)": devices,
        "CUDA / cuDNN": f"{torch.version.cuda} / {torch.backends.cudnn.version()}"
        if torch.cuda.is_available()
        else "-",
        **{f"{package} version": _version(package) for package in PACKAGES},
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "unset"),
        "Accelerate config": accelerate_config,
    }


def main(argv: Sequence[str]) -> int:
    """``trl-jagg env``: print :func:`environment` as a Markdown list to paste into an issue."""
    if CommandParser((), "env", DESCRIPTION, usage="trl-jagg env").parse_command_line(argv) is None:
        return 0
    lines = "\n".join(f"- {key}: {value}" for key, value in environment().items())
    print(f"\nCopy-paste the following information when reporting an issue:\n\n{lines}\n")
    return 0
