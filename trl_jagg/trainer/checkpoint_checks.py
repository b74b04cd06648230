"""Checks of a checkpoint folder before a run resumes from it: present, readable, and matching the model.

Each problem is a :class:`~trl_jagg.errors.CheckpointError` naming the file and the mismatch, raised before any
state is loaded (the loaders themselves fail later, without the path, or not at all for missing LoRA keys).
"""

from __future__ import annotations

import glob
import json
import os
import zipfile
from collections.abc import Mapping

from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

# Files `torch.save` writes (zip archives) that Trainer reads back when resuming.
TORCH_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth", "rng_state_*.pth")
TRAINER_STATE_FILE = "trainer_state.json"


def _listing(folder: str) -> str:
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return ", ".join(names[:12]) + (", ..." if len(names) > 12 else "") if names else "nothing"


def check_checkpoint_dir(path: str, output_dir: str) -> None:
    """``path`` is an existing folder; otherwise the error lists the checkpoints ``output_dir`` holds."""
    if os.path.isdir(path):
        return
    found = sorted(glob.glob(os.path.join(output_dir, "checkpoint-*")))
    where = f"Checkpoints in {output_dir}: {', '.join(found)}." if found else f"{output_dir} holds no checkpoint-N."
    raise CheckpointError(
        f"resume_from_checkpoint {path!r}: no such directory. {where} Give an existing checkpoint-N folder, or "
        "resume_from_checkpoint=True for the latest one in output_dir."
    )


def read_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the headers of safetensors ``files``; a truncated or corrupt file is named."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"{file} is truncated or corrupt ({error}). Resume from an earlier checkpoint."
            ) from error
    return shapes


def check_weights(files: list[str], expected: Mapping[str, tuple[int, ...]], prefix: str = "") -> None:
    """The tensors in ``files`` (names less ``prefix``) are exactly ``expected``, shape for shape."""
    found = {key.removeprefix(prefix): shape for key, shape in read_shapes(files).items()}
    where = files[0] if len(files) == 1 else f"{os.path.dirname(files[0])} ({len(files)} weight files)"
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} of the model's {len(expected)} tensors (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"has {len(unexpected)} the model lacks (e.g. {unexpected[:3]})")
        raise CheckpointError(
            f"{where} {' and '.join(parts)}: it was written by a run with another model or LoRA config "
            "(target_modules, rank). Resume with the configuration that wrote it."
        )
    wrong = [(key, found[key], shape) for key, shape in expected.items() if tuple(found[key]) != tuple(shape)]
    if wrong:
        key, got, want = wrong[0]
        raise CheckpointError(
            f"{where}: {len(wrong)} tensors have other shapes than the model's, e.g. {key} is {list(got)}, the "
            f"model's is {list(want)} (another LoRA rank?). Resume with the configuration that wrote it."
        )


def check_state_files(path: str, json_files: tuple[str, ...] = (TRAINER_STATE_FILE,)) -> None:
    """The optimizer, scheduler, scaler and RNG files present in ``path`` are complete archives, and each of
    ``json_files`` is present and parses."""
    for pattern in TORCH_STATE_FILES:
        for file in sorted(glob.glob(os.path.join(path, pattern))):
            if not zipfile.is_zipfile(file):
                raise CheckpointError(
                    f"{file} is truncated or corrupt (not a complete torch.save archive). Resume from an earlier "
                    "checkpoint."
                )
    for name in json_files:
        state = os.path.join(path, name)
        if not os.path.isfile(state):
            raise CheckpointError(
                f"{path} has no {name} (it holds {_listing(path)}): not a checkpoint of this trainer."
            )
        try:
            with open(state) as handle:
                json.load(handle)
        except (OSError, ValueError) as error:
            raise CheckpointError(
                f"{state} is truncated or corrupt ({error}). Resume from an earlier checkpoint."
            ) from error


def weight_files(path: str, pattern: str, kind: str) -> list[str]:
    """The files of ``path`` matching ``pattern``; an error saying what the folder holds if there are none."""
    files = sorted(glob.glob(os.path.join(path, pattern)))
    if not files:
        raise CheckpointError(f"{path} has no {pattern} (it holds {_listing(path)}): not a {kind} checkpoint.")
    return files


__all__ = ["check_checkpoint_dir", "check_state_files", "check_weights", "read_shapes", "weight_files"]
