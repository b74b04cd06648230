"""Checks of a checkpoint folder before a run resumes from it: present, readable, and matching the model.

Each problem is a :class:`~trl_jagg.utils.errors.CheckpointError` naming the file and the mismatch, raised before any
state is loaded (the loaders themselves fail later, without the path, or not at all for missing LoRA keys).
"""

from __future__ import annotations

import glob
import json
import math
import os
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trl_jagg.config.objective_registry import OBJECTIVES, get_objective
from trl_jagg.trainer.ema import ema_weight_files
from trl_jagg.trainer.files import EMA_DIR, EMA_STATE_NAME, GRPO_STATE_NAME, OLD_POLICY_FILE
from trl_jagg.utils.errors import CheckpointError

# Files `torch.save` writes (zip archives) that Trainer reads back when resuming.
RESUME_LATEST = ("true", "last", "latest")
"""``resume_from_checkpoint`` values that mean the latest ``checkpoint-N`` of ``output_dir`` (``latest`` as diffusers'
training scripts take it); ``True`` means the same."""

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


def damaged_file(path: str, cause: object, state: str = "truncated or corrupt") -> CheckpointError:
    """The error for a checkpoint file that cannot be read: it names the file, the cause and what to do."""
    return CheckpointError(f"{path} is {state} ({cause}). Resume from an earlier checkpoint.")


def read_shapes(files: list[str]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the headers of safetensors ``files``; a truncated or corrupt file is named."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except (SafetensorError, OSError) as error:
            raise damaged_file(file, error) from error
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
                raise damaged_file(file, "not a complete torch.save archive")
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
            raise damaged_file(state, error) from error


def check_resume_files(path: str, *, save_only_model: bool) -> None:
    """``optimizer.pt`` and ``scheduler.pt`` are present (transformers resumes silently without them: Adam's moments
    and the learning-rate schedule would restart, and the run drift from the one that wrote the checkpoint)."""
    if save_only_model:
        return
    missing = [name for name in ("optimizer.pt", "scheduler.pt") if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise CheckpointError(
            f"{path} has no {' and no '.join(missing)} (it holds {_listing(path)}): resuming would restart the "
            "optimizer state and the learning-rate schedule. Resume from a checkpoint saved with them (not with "
            "save_only_model=True), or start a new run from its weights."
        )


def read_grpo_state(path: str) -> dict[str, Any]:
    """``path/grpo_state.json``: an object whose ``step`` (micro-batches consumed) is an integer >= 0, whose
    ``stat_tracker`` is None or maps each prompt to a list of rewards, and whose optional ``run`` records the
    settings a resume must keep (:func:`check_run_settings`)."""
    file = os.path.join(path, GRPO_STATE_NAME)
    state = _read_json(file)
    problem = None
    if not isinstance(state, dict):
        problem = f"is a JSON {type(state).__name__}, not an object"
    elif not isinstance(state.get("step"), int) or isinstance(state["step"], bool) or state["step"] < 0:
        problem = f"has step {state.get('step')!r}, not an integer >= 0"
    else:
        tracker = state.get("stat_tracker")
        if tracker is not None and not (
            isinstance(tracker, dict)
            and all(
                isinstance(values, list)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
                for values in tracker.values()
            )
        ):
            problem = "has a stat_tracker that is not None nor an object of reward lists"
        if not isinstance(state.get("run") or {}, dict):
            problem = "has a run record that is not an object"
    if problem:
        raise CheckpointError(f"{file} {problem}: not written by this trainer. Resume from an earlier checkpoint.")
    return state


def check_step_agreement(path: str, gradient_accumulation_steps: int) -> None:
    """``trainer_state.json``'s optimizer step and ``grpo_state.json``'s micro-batch count belong to one save: each
    optimizer step took 1 to ``gradient_accumulation_steps`` micro-batches (fewer only at an epoch's end)."""
    trainer_file = os.path.join(path, TRAINER_STATE_FILE)
    step = _global_step(path)
    micro = read_grpo_state(path)["step"]
    if not step <= micro <= step * gradient_accumulation_steps:
        raise CheckpointError(
            f"{trainer_file} (global_step {step}) and {os.path.join(path, GRPO_STATE_NAME)} (step {micro} "
            f"micro-batches) disagree: {step} optimizer steps take {step} to {step * gradient_accumulation_steps} "
            f"micro-batches at gradient_accumulation_steps={gradient_accumulation_steps}. The files come from "
            "different saves: resume from an earlier checkpoint, or with the gradient_accumulation_steps that "
            "wrote it."
        )


def check_optimizer_file(path: str, parameter_shapes: Sequence[tuple[int, ...]]) -> None:
    """The per-parameter tensors of ``path/optimizer.pt`` (Adam's moments, ...) have the shapes of the parameters
    the optimizer will hold, in order (``torch.optim.Optimizer.state_dict``'s layout; a fused optimizer would run
    with the wrong shapes unchecked), and are finite (a NaN moment turns the weights NaN at the first step after the
    resume). A missing file is :func:`check_resume_files`'s concern."""
    file = os.path.join(path, "optimizer.pt")
    if not os.path.isfile(file):
        return
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # noqa: BLE001 (torch raises many types for a damaged archive)
        raise damaged_file(file, error) from error
    check_optimizer_hyperparameters(file, saved.get("param_groups", []))
    indices = [index for group in saved.get("param_groups", []) for index in group.get("params", [])]
    if len(indices) != len(parameter_shapes):
        raise CheckpointError(
            f"{file} holds the state of {len(indices)} parameters, the model trains {len(parameter_shapes)}: it was "
            "written by a run with another model or LoRA config. Resume with the configuration that wrote it."
        )
    for position, (index, shape) in enumerate(zip(indices, parameter_shapes)):
        for name, value in saved.get("state", {}).get(index, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.ndim > 0 and tuple(value.shape) != tuple(shape):
                raise CheckpointError(
                    f"{file}: the {name} of parameter {position} is {list(value.shape)}, the parameter is "
                    f"{list(shape)} (another LoRA rank?). Resume with the configuration that wrote it."
                )
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise CheckpointError(
                    f"{file}: the {name} of parameter {position} holds NaN or infinite values (the weights would "
                    "turn NaN at the first step). Resume from an earlier checkpoint."
                )


def check_optimizer_hyperparameters(file: str, param_groups: Sequence[Mapping[str, Any]]) -> None:
    """Every number of every parameter group of ``file`` (the learning rate, Adam's betas and eps, the weight decay,
    ...) is finite: the optimizer and its schedule resume them as saved, so a NaN learning rate would turn the
    weights NaN at the first step."""
    for position, group in enumerate(param_groups):
        for name, value in group.items():
            if name == "params":
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            finite = [
                bool(torch.isfinite(v).all()) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else not isinstance(v, float) or math.isfinite(v)
                for v in values
            ]  # fmt: skip
            if not all(finite):
                raise CheckpointError(
                    f"{file}: parameter group {position} has {name}={value!r}, not finite (the weights would turn NaN "
                    "at the first step). Resume from an earlier checkpoint, or start a new run in another output_dir."
                )


def old_policy_stamp(file: str) -> dict[str, str]:
    """The stamp (safetensors metadata) of an old-policy file, which must be readable and carry the step it last
    followed; a damaged or unstamped file is a named :class:`~trl_jagg.utils.errors.CheckpointError`."""
    try:
        with safe_open(file, framework="pt") as reader:
            stamp = reader.metadata() or {}
    except (SafetensorError, OSError) as error:
        raise damaged_file(file, error) from error
    if not str(stamp.get("step", "")).isdigit():
        raise damaged_file(file, "no step stamp", state="not written by this trainer")
    return stamp


def _stamped_objective(file: str) -> str:
    """The objective an old-policy file was written for (files from before the stamp held it: DiffusionNFT's)."""
    objective = old_policy_stamp(file).get("objective", "nft")
    return objective if objective in OBJECTIVES else "nft"


def check_old_policy(path: str, *, objective: str, keeps_old_policy: bool) -> None:
    """DiffusionNFT's old policy belongs to the run resuming ``path``: an NFT checkpoint is not resumed by another
    objective (its old policy would be ignored in silence), and with ``keeps_old_policy`` the file is readable and
    stamped (safetensors metadata) with this checkpoint's step (a file copied from another save would resume another
    old policy). A file saved before the checkpoint stamp existed cannot be checked: a warning says so."""
    file = os.path.join(path, OLD_POLICY_FILE)
    if not keeps_old_policy:
        if os.path.isfile(file):
            saved_by = _stamped_objective(file)
            raise CheckpointError(
                f"{path} was saved by a {get_objective(saved_by).title} run ({OLD_POLICY_FILE}): resuming it with "
                f"another objective would drop its old policy. Resume with objective={saved_by!r}, or start a new "
                "run in another output_dir."
            )
        return
    if not os.path.isfile(file):
        raise CheckpointError(
            f"objective={objective!r} but {path} has no {OLD_POLICY_FILE}: it was not saved by a "
            f"{get_objective(objective).title} run. Resume it with its own objective, or start a new run in another "
            "output_dir."
        )
    stamp = old_policy_stamp(file)
    if stamp.get("objective", objective) != objective:
        raise CheckpointError(
            f"{file} is the old-policy state of objective={stamp['objective']!r}; this run is objective="
            f"{objective!r}. Resume with objective={stamp['objective']!r}, or start a new run in another output_dir."
        )
    if "checkpoint_step" not in stamp:
        warnings.warn(
            f"{file} has no checkpoint_step stamp (saved by an older version): whether the old policy belongs to "
            "this checkpoint's step cannot be checked.",
            stacklevel=2,
        )
        return
    step = _global_step(path)
    if stamp["checkpoint_step"] != str(step):
        raise CheckpointError(
            f"{file} was saved with the checkpoint of step {stamp['checkpoint_step']}, {path} at step {step} "
            f"({TRAINER_STATE_FILE}): an old policy from another save. Resume from a checkpoint saved whole."
        )


def check_ema_step(path: str, *, objective: str | None = None) -> None:
    """``path/ema/`` belongs to the checkpoint: each EMA weights file is readable and stamped (safetensors metadata,
    :func:`~trl_jagg.trainer.ema.ema_stamp`) with ``trainer_state.json``'s step and the resuming run's ``objective``
    (an EMA file copied from another save or run would resume another average), and ``ema/ema_state.json``, where
    present, agrees. Files saved before the stamp existed are checked by ``ema_state.json`` alone, with a warning;
    a folder with neither stamp is refused."""
    folder = os.path.join(path, EMA_DIR)
    step = _global_step(path)
    fresh = "Resume from a checkpoint saved whole, or start a new run in another output_dir (or with ema_decay=0)."
    record = os.path.join(folder, EMA_STATE_NAME)
    if os.path.isfile(record):
        saved = _read_json(record)
        ema_step = saved.get("step") if isinstance(saved, dict) else None
        if not isinstance(ema_step, int) or isinstance(ema_step, bool):
            raise CheckpointError(
                f"{record} has step {ema_step!r}, not an integer: not written by this trainer. {fresh}"
            )
        if ema_step != step:
            raise CheckpointError(
                f"{record}: the EMA in {folder} was saved at step {ema_step}, the checkpoint at step {step} "
                f"({TRAINER_STATE_FILE}): a stale average from another save, which would make the final EMA differ "
                f"from an uninterrupted run's. {fresh}"
            )
    unstamped = []
    for file in ema_weight_files(folder):
        try:
            with safe_open(file, framework="pt") as reader:
                stamp = reader.metadata() or {}
        except (SafetensorError, OSError) as error:
            raise damaged_file(file, error) from error
        if "ema_step" not in stamp:
            unstamped.append(file)
            continue
        if stamp["ema_step"] != str(step) or (objective is not None and stamp.get("ema_objective") != objective):
            raise CheckpointError(
                f"{file} holds the EMA of step {stamp['ema_step']} of the run {stamp.get('ema_run')!r} "
                f"(objective {stamp.get('ema_objective')!r}); {path} is at step {step} ({TRAINER_STATE_FILE})"
                f"{'' if objective is None else f', resumed with objective {objective!r}'}: an EMA from another "
                f"save or run, which would make the final EMA differ from an uninterrupted run's. {fresh}"
            )
    if unstamped and not os.path.isfile(record):
        raise damaged_file(
            unstamped[0], "no EMA stamp in its metadata, no ema_state.json", "not written by this trainer"
        )
    if unstamped:
        warnings.warn(
            f"{', '.join(unstamped)} carry no EMA stamp (saved by an older version): only {record} vouches for the "
            "step of the average.",
            stacklevel=2,
        )


RESUMED_AS_SAVED = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio")
"""Settings a resume cannot change: transformers loads ``optimizer.pt`` and ``scheduler.pt`` as saved, so a new
``learning_rate`` would be silently ignored and a new schedule would be applied from the checkpoint's step."""


def check_run_settings(path: str, current: Mapping[str, Any]) -> None:
    """The settings of the run resuming from ``path`` (``current``, see :data:`RESUMED_AS_SAVED` and
    ``train_experts``) are those ``grpo_state.json`` recorded when it was saved (a checkpoint without a record is
    not checked; without ``scheduler.pt``, under ``save_only_model``, the new schedule applies and is not
    compared)."""
    recorded = read_grpo_state(path).get("run")
    if not recorded:
        return
    compared = [key for key in current if key in recorded]
    if not os.path.isfile(os.path.join(path, "scheduler.pt")):
        compared = [key for key in compared if key not in RESUMED_AS_SAVED]
    changed = [key for key in compared if recorded[key] != current[key]]
    if not changed:
        return
    was = ", ".join(f"{key}={recorded[key]!r}" for key in changed)
    now = ", ".join(f"{key}={current[key]!r}" for key in changed)
    why = []
    if any(key in RESUMED_AS_SAVED for key in changed):
        why.append(
            "a resume loads its optimizer.pt and scheduler.pt as saved (as transformers does), so a new "
            "learning_rate would be silently ignored and a new schedule would change the run midway"
        )
    if "train_experts" in changed:
        why.append("it holds the weights of the experts it trained")
    raise CheckpointError(
        f"{path} was saved by a run with {was}; this run has {now}: {'; '.join(why)}. Resume with the checkpoint's "
        "values, or start a fresh run (a new output_dir, without resume_from_checkpoint)."
    )


def check_finite_weights(files: Sequence[str]) -> None:
    """Every floating tensor of the safetensors ``files`` is finite (read one tensor at a time)."""
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise CheckpointError(
                        f"{file}: {key} holds NaN or infinite values. Resume from an earlier checkpoint."
                    )


def _global_step(path: str) -> int:
    """``path/trainer_state.json``'s ``global_step``, an integer >= 0."""
    trainer_file = os.path.join(path, TRAINER_STATE_FILE)
    trainer_state = _read_json(trainer_file)
    step = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{trainer_file} has global_step {step!r}, not an integer >= 0. Resume from an earlier "
                              "checkpoint.")  # fmt: skip
    return step


def _read_json(file: str) -> Any:
    try:
        with open(file) as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        raise damaged_file(file, error, "missing, truncated or corrupt") from error


def weight_files(path: str, pattern: str, kind: str) -> list[str]:
    """The files of ``path`` matching ``pattern``; an error saying what the folder holds if there are none."""
    files = sorted(glob.glob(os.path.join(path, pattern)))
    if not files:
        raise CheckpointError(f"{path} has no {pattern} (it holds {_listing(path)}): not a {kind} checkpoint.")
    return files


__all__ = [
    "check_checkpoint_dir",
    "check_ema_step",
    "check_finite_weights",
    "check_optimizer_file",
    "check_optimizer_hyperparameters",
    "check_resume_files",
    "check_run_settings",
    "check_state_files",
    "check_step_agreement",
    "check_weights",
    "read_grpo_state",
    "read_shapes",
    "weight_files",
]
