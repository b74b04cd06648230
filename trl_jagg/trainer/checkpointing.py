"""Saving and loading what a run trains: the weights in the diffusers formats, the EMA, the trainer's run state,
full optimizer states of a sharded backbone, and atomic ``checkpoint-N`` folders. Checks of a checkpoint before a
resume are in :mod:`trl_jagg.trainer.checkpoint_checks`."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, sort_checkpoints

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.config.objective_registry import get_objective
from trl_jagg.core.grpo import PerPromptStatTracker
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.trainer.checkpoint_checks import (
    RESUME_LATEST,
    RESUMED_AS_SAVED,
    check_checkpoint_dir,
    check_ema_step,
    check_finite_weights,
    check_old_policy,
    check_optimizer_file,
    check_resume_files,
    check_run_settings,
    check_state_files,
    check_step_agreement,
    check_weights,
    damaged_file,
    weight_files,
)
from trl_jagg.trainer.ema import EMAWeights, stamp_ema_files
from trl_jagg.trainer.files import (
    EMA_DIR,
    EMA_STATE_NAME,
    FULL_WEIGHTS_PATTERN,
    GRPO_STATE_NAME,
    LORA_WEIGHTS_NAME,
    SCHEDULER_FOLDER,
    without_secrets,
)
from trl_jagg.trainer.guards import all_finite, any_process, non_finite_advice
from trl_jagg.trainer.sharding import local_parts, sharding_of
from trl_jagg.utils.distributed import is_fully_sharded
from trl_jagg.utils.errors import CheckpointError, NonFiniteError, TrainingError


class WeightsIO:
    """Saves and loads the trained backbone's weights: LoRA in the diffusers format ``pipe.load_lora_weights``
    reads, full fine-tuning as ``save_pretrained`` writes it; into FSDP2 shards when the backbone is sharded. A
    backbone of several pipeline components writes each trained part where its adapter says (:meth:`parts`)."""

    def __init__(self, adapter: FlowMatchingAdapter, peft_config: LoraConfig | None):
        self.adapter = adapter
        self.peft_config = peft_config

    @property
    def is_lora(self) -> bool:
        return self.peft_config is not None

    @property
    def lora_prefix(self) -> str:
        """The prefix of the backbone's keys in a diffusers LoRA file (``transformer.``)."""
        return f"{self.adapter.pipeline_class.transformer_name}."

    def parts(self, transformer: torch.nn.Module, folder: str) -> list[tuple[str, torch.nn.Module, str]]:
        """``(name, module, folder)`` of each saved part of ``transformer`` (the adapter's
        :meth:`~trl_jagg.models.base.FlowMatchingAdapter.saved_parts`: the backbone in ``folder``, unless the family's
        backbone holds several pipeline components)."""
        return self.adapter.saved_parts(transformer, folder)

    def part_state(self, transformer: torch.nn.Module, name: str, state_dict: dict | None) -> dict | None:
        """The part ``name``'s entries of a gathered state dict of the whole backbone (the adapter's
        :meth:`~trl_jagg.models.base.FlowMatchingAdapter.part_state`)."""
        return self.adapter.part_state(transformer, name, state_dict)

    def check(
        self, path: str, transformer: torch.nn.Module, args: GRPOJaggConfig, *, ema: EMAWeights | None,
        optimizer_files: bool,
    ) -> None:  # fmt: skip
        """Refuse a checkpoint whose files are missing, unreadable, non-finite, of another model, or whose run
        state disagrees (names the file); with ``ema``, its ``ema/`` folder too. ``optimizer_files``: the Trainer
        resumes from ``optimizer.pt`` / ``scheduler.pt`` (not a DeepSpeed or FSDP-plugin folder)."""
        check_checkpoint_dir(path, args.output_dir)
        self.adapter.check_saved_parts(path, transformer, args)
        check_state_files(path, json_files=(TRAINER_STATE_NAME, GRPO_STATE_NAME))
        check_run_settings(path, run_settings(args))
        pattern, kind = (LORA_WEIGHTS_NAME, "LoRA") if self.is_lora else (FULL_WEIGHTS_PATTERN, "full fine-tuning")
        prefix = self.lora_prefix if self.is_lora else ""
        folders = [path]
        if ema is not None:
            folders.append(os.path.join(path, EMA_DIR))
            if not os.path.isdir(folders[-1]):
                raise CheckpointError(
                    f"ema_decay={args.ema_decay} but {path} has no {EMA_DIR}/ folder (it was saved without EMA). "
                    "Resume with ema_decay=0, or start a new run."
                )
        for folder in folders:
            for _, part, part_folder in self.parts(transformer, folder):
                expected = get_peft_model_state_dict(part) if self.is_lora else part.state_dict()
                files = weight_files(part_folder, pattern, kind)
                check_weights(files, {key: tuple(value.shape) for key, value in expected.items()}, prefix)
                check_finite_weights(files)
        if ema is not None:
            check_ema_step(path, objective=args.objective)
        check_old_policy(
            path, objective=args.objective, keeps_old_policy=get_objective(args.objective).keeps_old_policy
        )
        check_step_agreement(path, args.gradient_accumulation_steps)
        if optimizer_files:
            check_resume_files(path, save_only_model=args.save_only_model)

    def gathered_state_dicts(
        self, transformer: torch.nn.Module, state_dict: dict | None, ema: EMAWeights | None
    ) -> tuple[dict | None, dict | None]:
        """The full state dicts of the weights and of the EMA weights of a sharded backbone (FSDP2, by the trainer or
        accelerate's plugin; DeepSpeed ZeRO-3): collectives every rank joins, the main process gets the tensors
        (only the trainable ones for LoRA under FSDP2). ``state_dict``: the weights' one the Trainer gathered
        (accelerate's FSDP2 plugin; DeepSpeed, ``None`` on the other processes under ZeRO-3), else gathered here
        under FSDP2. ``(state_dict, None)`` for trained weights every process holds whole, whose EMA is saved swapped
        in."""
        if is_fully_sharded(transformer) and state_dict is None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.is_lora)
            state_dict = get_model_state_dict(transformer, options=options)
        if ema is None or all(sharding_of(p) is None for p in ema.parameters()):
            return state_dict, None
        names = [name for name, p in transformer.named_parameters() if p.requires_grad]  # ema.parameters()' order
        ema_weights = dict(zip(names, ema.full_weights()))
        return state_dict, None if state_dict is None else {**state_dict, **ema_weights}

    def save(self, output_dir: str, transformer: torch.nn.Module, state_dict: dict | None) -> None:
        """Write the weights (``state_dict``: the gathered full one under FSDP / DeepSpeed) into ``output_dir``."""
        for name, part, folder in self.parts(transformer, output_dir):
            self._save(folder, part, self.part_state(transformer, name, state_dict))

    def _save(self, output_dir: str, transformer: torch.nn.Module, state_dict: dict | None) -> None:
        with failed_write_named(output_dir):
            os.makedirs(output_dir, exist_ok=True)
        if self.is_lora:
            with failed_write_named(os.path.join(output_dir, LORA_WEIGHTS_NAME)):
                self.adapter.pipeline_class.save_lora_weights(
                    output_dir,
                    transformer_lora_layers=get_peft_model_state_dict(transformer, state_dict=state_dict),
                    # Without the metadata a lora_alpha != r adapter reloads with the wrong scale.
                    transformer_lora_adapter_metadata=self.peft_config.to_dict(),
                )
        elif state_dict is None:
            with failed_write_named(os.path.join(output_dir, FULL_WEIGHTS_PATTERN)):
                transformer.save_pretrained(output_dir)
        else:
            with failed_write_named(os.path.join(output_dir, FULL_WEIGHTS_PATTERN)):
                transformer.save_config(output_dir)
                save_torch_state_dict(
                    state_dict, output_dir, filename_pattern="diffusion_pytorch_model{suffix}.safetensors"
                )

    def load(self, transformer: torch.nn.Module, folder: str) -> None:
        """Load the weights saved in ``folder`` into ``transformer`` (checked by :meth:`check` first); under
        DeepSpeed ZeRO-3 inside a gather every rank joins, whose exit partitions the loaded values again."""
        params = [p for p in transformer.parameters() if hasattr(p, "ds_id")]
        if params:
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                self._load(transformer, folder)
        else:
            self._load(transformer, folder)

    def _load(self, transformer: torch.nn.Module, folder: str) -> None:
        for _, part, part_folder in self.parts(transformer, folder):
            self._load_part(part, part_folder)

    def _load_part(self, transformer: torch.nn.Module, folder: str) -> None:
        if self.is_lora:
            (path,) = weight_files(folder, LORA_WEIGHTS_NAME, "LoRA")
            state = {k.removeprefix(self.lora_prefix): v for k, v in _load_safetensors(path).items()}
            # `set_peft_model_state_dict` ignores missing keys: `check` compared the keys and shapes first.
            if is_fully_sharded(transformer):
                _load_full_state_dict(transformer, _lora_state_in_model_keys(transformer, state, path), strict=False)
            else:
                result = set_peft_model_state_dict(transformer, state)
                if getattr(result, "unexpected_keys", None):
                    raise CheckpointError(f"{path} has keys the adapter lacks: {result.unexpected_keys[:5]}")
        else:
            state = {}
            for file in weight_files(folder, FULL_WEIGHTS_PATTERN, "full fine-tuning"):
                state.update(_load_safetensors(file))
            if is_fully_sharded(transformer):
                _load_full_state_dict(transformer, state, strict=True)
            else:
                transformer.load_state_dict(state, strict=True)

    def save_model_folder(
        self, output_dir: str, transformer: torch.nn.Module, state_dicts: tuple[dict | None, dict | None],
        ema: EMAWeights | None, args: GRPOJaggConfig, step: int,
    ) -> None:  # fmt: skip
        """A model folder: the weights, the EMA weights beside them in their format (``ema/``: loadable with
        ``load_lora_weights(f"{output_dir}/ema")``, stamped with the optimizer step ``step``, the run and the
        objective in each file's safetensors metadata and in ``ema_state.json``, which a resume compares with the
        checkpoint's), the schedule sampled in training (``scheduler/``: a recipe may
        override the base model's, DanceGRPO's shift 3) and the training arguments without secrets.
        ``state_dicts``: the gathered weights and EMA weights (:meth:`gathered_state_dicts`), ``None`` where the
        model holds them whole."""
        state_dict, ema_state_dict = state_dicts
        self.save(output_dir, transformer, state_dict)
        if ema_state_dict is not None:
            self.save(os.path.join(output_dir, EMA_DIR), transformer, ema_state_dict)
        elif ema is not None:
            with ema.swapped_in():
                self.save(os.path.join(output_dir, EMA_DIR), transformer, None)
        if ema is not None:
            stamp_ema_files(os.path.join(output_dir, EMA_DIR), step, args)  # the stamp a resume checks, in each file
            stamp = os.path.join(output_dir, EMA_DIR, EMA_STATE_NAME)
            with failed_write_named(stamp), open(stamp, "w") as handle:
                json.dump({"step": step}, handle)
        with failed_write_named(os.path.join(output_dir, SCHEDULER_FOLDER)):
            self.adapter.pipeline.scheduler.save_pretrained(os.path.join(output_dir, SCHEDULER_FOLDER))
        with failed_write_named(os.path.join(output_dir, TRAINING_ARGS_NAME), torch_save=True):
            torch.save(without_secrets(args), os.path.join(output_dir, TRAINING_ARGS_NAME))

    def load_resumed(
        self, transformer: torch.nn.Module, checkpoint: str, ema: EMAWeights | None, *, trained: bool = True
    ) -> None:
        """Load a checkpoint's weights and, with EMA, its ``ema/`` average (through the model, taken as the
        average, then the trained weights are loaded). ``trained=False``: the trained weights are in place already
        (DeepSpeed loads them from its own folder), only the EMA is read, around them."""
        if ema is not None:  # `check` found the folder
            params = local_parts(ema.parameters())
            if not trained:
                ema.store(params)
            self.load(transformer, os.path.join(checkpoint, EMA_DIR))
            ema.take_current_weights()
            if not trained:
                ema.restore(params)
        if trained:
            self.load(transformer, checkpoint)


def check_optimizer_state(checkpoint: str, optimizer: torch.optim.Optimizer) -> None:
    """Before the Trainer loads ``checkpoint/optimizer.pt`` into ``optimizer``: its per-parameter state has the
    shapes of the parameters (the state of another LoRA rank would load without a complaint) and is finite."""
    params = [p for group in _torch_optimizer(optimizer).param_groups for p in group["params"]]
    check_optimizer_file(checkpoint, [tuple(p.shape) for p in params])


def run_settings(args: GRPOJaggConfig) -> dict[str, Any]:
    """The settings ``grpo_state.json`` records for :func:`~trl_jagg.trainer.checkpoint_checks.check_run_settings`,
    as JSON values (a resume compares them with the values read back)."""
    values = {key: getattr(args, key, None) for key in (*RESUMED_AS_SAVED, "train_experts")}
    return json.loads(json.dumps(values, default=str))


@contextlib.contextmanager
def failed_write_named(path: str, *, torch_save: bool = False) -> Iterator[None]:
    """A failure to write ``path`` as a :class:`CheckpointError` that names it and the likely cause, chained to the
    original (torch reports a full disk as "unexpected pos", safetensors as a bare I/O error, neither with the path).
    ``torch_save``: the block is a ``torch.save``, whose write failures are ``RuntimeError``."""
    caught = (OSError, SafetensorError, RuntimeError) if torch_save else (OSError, SafetensorError)
    try:
        yield
    except TrainingError:
        raise
    except caught as error:
        raise CheckpointError(
            f"Writing {path} failed ({type(error).__name__}: {error}). The disk is likely full, or the folder not "
            "writable: free space (or fix the permissions) and save again; a run resumes from its last complete "
            "checkpoint."
        ) from error


@contextlib.contextmanager
def optimizer_write_named(output_dir: str) -> Iterator[None]:
    """:func:`failed_write_named` for the block writing ``optimizer.pt`` then ``scheduler.pt`` into ``output_dir``
    with ``torch.save``: the error names the one being written (``torch.save`` creates its file first), or the folder
    (DeepSpeed's files)."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as error:
        if isinstance(error, TrainingError) or not _is_write_failure(error):
            raise
        written = [os.path.join(output_dir, name) for name in (SCHEDULER_NAME, OPTIMIZER_NAME)]
        with failed_write_named(next((f for f in written if os.path.exists(f)), output_dir), torch_save=True):
            raise error


def resume_path(value: str | bool | None, output_dir: str) -> str | bool | None:
    """``resume_from_checkpoint`` as the Trainer takes it: ``True`` and the words of :data:`RESUME_LATEST` (``"latest"``,
    as diffusers' scripts take it) become the latest ``checkpoint-N`` of ``output_dir``; anything else is kept."""
    if value is True or (isinstance(value, str) and value.lower() in RESUME_LATEST):
        return last_checkpoint(output_dir)
    return value


def last_checkpoint(output_dir: str) -> str:
    """The latest ``checkpoint-N`` in ``output_dir`` (``resume_from_checkpoint=True``); an error when there is none."""
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if last is None:
        raise CheckpointError(
            f"resume_from_checkpoint=True, but {output_dir} holds no checkpoint-N folder. Start without resuming, "
            "or give the path of a checkpoint."
        )
    return last


def check_saveable(
    accelerator: Any,
    params: list[torch.Tensor],
    output_dir: str,
    *,
    global_step: int,
    run_dir: str,
    ema: EMAWeights | None = None,
) -> None:
    """Refuse to save non-finite weights or EMA weights, and to save a model that has trained 0 steps over existing
    weights or beside a run's checkpoints (on every process alike)."""
    for name, tensors in (("weights", params), ("EMA weights", ema.shadow_params if ema is not None else [])):
        if any_process(accelerator, not all_finite(tensors)):
            raise NonFiniteError(
                f"The {name} hold NaN or infinite values at step {global_step}: not saved to {output_dir}. "
                f"{non_finite_advice(run_dir, name)}"
            )
    existing = [f for f in (LORA_WEIGHTS_NAME, FULL_WEIGHTS_PATTERN) if glob.glob(os.path.join(output_dir, f))]
    if any_process(accelerator, global_step == 0 and bool(existing)):
        raise TrainingError(
            f"Refusing to replace the weights in {output_dir} with a model that has trained 0 steps. Train first, "
            "or save to another directory."
        )
    checkpoints = sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []
    if any_process(accelerator, global_step == 0 and bool(checkpoints)):
        raise TrainingError(
            f"Refusing to save a model that has trained 0 steps into {output_dir}, which holds a run's checkpoints "
            f"(latest: {os.path.basename(checkpoints[-1]) if checkpoints else '?'}): its weights would sit beside "
            "them as the run's result. To save the trained weights, resume first (train(resume_from_checkpoint="
            "True) with max_steps reached saves them); otherwise save to another directory."
        )


def best_checkpoint(run_dir: str, state: Any, save_strategy: str) -> str | None:
    """The checkpoint of the best evaluation so far (``metric_for_best_model``, e.g. ``eval_reward``), which
    ``save_total_limit`` keeps and ``load_best_model_at_end`` loads: the one being written or an existing one; else
    ``state.best_model_checkpoint`` unchanged."""
    if save_strategy == "no" or not state.best_global_step:
        return state.best_model_checkpoint
    best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
    if state.best_global_step == state.global_step or os.path.isdir(best):
        return best
    return state.best_model_checkpoint


def save_run_state(
    output_dir: str, state: Any, stateful: list[Any], micro_step: int, stat_tracker: PerPromptStatTracker | None,
    args: GRPOJaggConfig,
) -> None:  # fmt: skip
    """The Trainer's ``trainer_state.json`` (with the state of the ``stateful`` callbacks and control, as the
    Trainer saves it) and the trainer's own ``grpo_state.json``."""
    for callback in stateful:
        if isinstance(callback, ExportableState):
            state.stateful_callbacks[callback.__class__.__name__] = callback.state()
    state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
    save_grpo_state(output_dir, micro_step, stat_tracker, run_settings(args))


def save_grpo_state(
    output_dir: str, micro_step: int, stat_tracker: PerPromptStatTracker | None, run: dict[str, Any] | None = None
) -> None:
    """The micro-batch counter (rollout buffer position, random trained steps), the per-prompt reward history
    (identical on every process: it is updated with gathered rewards; written once) and ``run``, the settings a
    resume must keep (:func:`run_settings`)."""
    state = {
        "step": micro_step,
        "stat_tracker": None
        if stat_tracker is None
        else {prompt: list(values) for prompt, values in stat_tracker.history.items()},
        "run": run,
    }
    with open(os.path.join(output_dir, GRPO_STATE_NAME), "w") as f:
        json.dump(state, f)  # floats round-trip exactly through JSON


def load_grpo_state(checkpoint: str, stat_tracker: PerPromptStatTracker | None) -> int:
    """Restore the per-prompt reward history from ``checkpoint``; returns its micro-batch counter."""
    path = os.path.join(checkpoint, GRPO_STATE_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"No {GRPO_STATE_NAME} in {checkpoint}: not a checkpoint of this trainer.")
    with open(path) as f:
        state = json.load(f)
    if stat_tracker is not None:
        stat_tracker.history.clear()
        for prompt, values in (state["stat_tracker"] or {}).items():
            stat_tracker.history[prompt].extend(values)
    return state["step"]


def save_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, output_dir: str, should_save: bool
) -> None:
    """The full (gathered, a collective) optimizer state of a sharded backbone, so the checkpoint loads on any
    number of processes (the Trainer saves the main process's, which holds only its shards)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(model, _torch_optimizer(optimizer), options=options)
    if should_save:
        with optimizer_write_named(output_dir):
            torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
            torch.save(lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any, checkpoint: str
) -> None:
    """Load a full optimizer state (see :func:`save_full_optimizer_state`) into the shards."""
    state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
    set_optimizer_state_dict(model, _torch_optimizer(optimizer), state, options=StateDictOptions(full_state_dict=True))
    lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


@contextlib.contextmanager
def atomic_checkpoint(
    run_dir: str, name: str, *, should_save: bool, wait_for_everyone: Callable[[], None]
) -> Iterator[str]:
    """Yield a staging folder (``tmp-<name>``) to write a checkpoint into; once the block completes on every
    process it is renamed to ``<name>``, so a ``checkpoint-N`` folder is always whole (a kill leaves the staging
    folder, which resumes ignore and the next save of the step replaces)."""
    final_dir, staging_dir = os.path.join(run_dir, name), os.path.join(run_dir, f"tmp-{name}")
    if should_save and os.path.isdir(staging_dir):
        shutil.rmtree(staging_dir)  # left by an interrupted save
    wait_for_everyone()
    try:
        yield staging_dir
    except (OSError, RuntimeError, SafetensorError) as error:
        # torch ("unexpected pos", "PytorchStreamWriter failed writing file") and safetensors report a full disk or
        # a too-large file without the path (the writes of this trainer's files name theirs: CheckpointError); other
        # errors (a bug) pass unchanged.
        if isinstance(error, TrainingError) or not _is_write_failure(error):
            raise
        raise CheckpointError(
            f"Writing {staging_dir} failed ({type(error).__name__}: {error}). The disk is likely full (or the file "
            f"too large, the folder not writable): free disk space and resume; the checkpoints already in {run_dir} "
            "are untouched."
        ) from error
    wait_for_everyone()
    if should_save:
        if os.path.isdir(final_dir):
            delete_whole(final_dir)
        os.replace(staging_dir, final_dir)
    wait_for_everyone()


def _is_write_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed write: an I/O error, or a ``RuntimeError`` of ``torch.save`` (raised from
    ``torch/serialization.py``, whatever its text)."""
    if isinstance(error, (OSError, SafetensorError)):
        return True
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(error.__traceback__)]
    return any(file.replace(os.sep, "/").endswith("torch/serialization.py") for file in files)


DELETING_SUFFIX = ".deleting"
"""A checkpoint being deleted is first renamed ``tmp-<name>.deleting`` (ignored by resumes and uploads)."""


def delete_whole(folder: str) -> None:
    """Delete ``folder`` so that it is never seen half-deleted: renamed out of the checkpoint names first."""
    doomed = os.path.join(os.path.dirname(folder), f"tmp-{os.path.basename(folder)}{DELETING_SUFFIX}")
    if os.path.isdir(doomed):
        shutil.rmtree(doomed)
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """transformers' rotation (the oldest ``checkpoint-N`` beyond ``save_total_limit``, never the best one),
    deleting each checkpoint whole (:func:`delete_whole`), and what a killed rotation left."""
    for leftover in glob.glob(os.path.join(run_dir, f"tmp-*{DELETING_SUFFIX}")):
        shutil.rmtree(leftover, ignore_errors=True)
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(run_dir, use_mtime=True)
    # As transformers.trainer_utils.rotate_checkpoints: the latest (to resume) and the best are protected.
    protected = {checkpoints[-1]} if checkpoints else set()
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    excess = len(checkpoints) - max(save_total_limit, len(protected))
    for folder in [folder for folder in checkpoints if folder not in protected][: max(excess, 0)]:
        delete_whole(folder)


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise damaged_file(path, error) from error


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _lora_state_in_model_keys(
    transformer: torch.nn.Module, state: dict[str, torch.Tensor], path: str
) -> dict[str, torch.Tensor]:
    """A saved diffusers LoRA (adapter name stripped, as ``get_peft_model_state_dict`` writes it) under the
    backbone's own parameter names, for loading into sharded parameters."""
    adapter = next(iter(transformer.peft_config))
    names = {name.replace(f".{adapter}.", "."): name for name, _ in transformer.named_parameters() if "lora_" in name}
    unexpected = sorted(set(state) - set(names))
    if unexpected:
        raise ValueError(f"Checkpoint {path} has keys the adapter lacks: {unexpected[:5]}")
    return {names[key]: value for key, value in state.items()}


def _load_full_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor], *, strict: bool) -> None:
    """Load full (unsharded) tensors, present on every rank, into an FSDP2-sharded backbone."""
    set_model_state_dict(transformer, state, options=StateDictOptions(full_state_dict=True, strict=strict))
