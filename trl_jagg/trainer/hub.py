"""The Hub side of a run: what a checkpoint push uploads, the upload itself and the model card written at every
save (the card's text is :mod:`trl_jagg.trainer.model_card`)."""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch
from transformers import trainer as transformers_trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import HubStrategy, SaveStrategy

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.trainer.files import HUB_IGNORE_PATTERNS, MODEL_FILES, SCHEDULER_FOLDER, without_secrets
from trl_jagg.trainer.model_card import write_model_card


def copy_model_files(checkpoint_folder: str, output_dir: str, args: GRPOJaggConfig) -> None:
    """Copy a checkpoint's model files (:data:`~trl_jagg.trainer.files.MODEL_FILES`) into ``output_dir``, the
    folder a checkpoint push uploads, with the training arguments."""
    for pattern in MODEL_FILES:
        for source in glob.glob(os.path.join(checkpoint_folder, pattern)):
            target = os.path.join(output_dir, os.path.basename(source))
            if os.path.isdir(source):
                shutil.copytree(source, target, dirs_exist_ok=True)
            else:
                shutil.copy(source, target)
    torch.save(without_secrets(args), os.path.join(output_dir, TRAINING_ARGS_NAME))


def upload_folder(
    repo_id: str, folder: str, message: str | None, *, args: GRPOJaggConfig, run_as_future: bool, **kwargs: Any
) -> Any:
    """``HfApi.upload_folder`` of ``folder`` (the Trainer's ``hf_api``), ignoring
    :data:`~trl_jagg.trainer.files.HUB_IGNORE_PATTERNS` when it is ``output_dir``."""
    token = kwargs.pop("token", None) or args.hub_token
    revision = kwargs.pop("revision", None) or args.hub_revision
    ignore = HUB_IGNORE_PATTERNS if os.path.samefile(folder, args.output_dir) else None
    return transformers_trainer.hf_api().upload_folder(
        repo_id=repo_id, folder_path=folder, commit_message=message, token=token, run_as_future=run_as_future,
        ignore_patterns=ignore, revision=revision, **kwargs,
    )  # fmt: skip


def push_checkpoint(repo_id: str, checkpoint_folder: str, args: GRPOJaggConfig, state: Any) -> list[Any]:
    """The Trainer's checkpoint push with this trainer's files: the checkpoint's model files are copied into
    ``output_dir``, which is uploaded without the checkpoint folders, and with ``hub_strategy="checkpoint"`` /
    ``"all_checkpoints"`` the checkpoint too; returns the upload futures."""
    copy_model_files(checkpoint_folder, args.output_dir, args)
    if args.save_strategy == SaveStrategy.STEPS:
        message = f"Training in progress, step {state.global_step}"
    else:
        message = f"Training in progress, epoch {int(state.epoch)}"
    jobs = [upload_folder(repo_id, args.output_dir, message, args=args, run_as_future=True)]
    if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
        path_in_repo = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else None
        jobs.append(
            upload_folder(
                repo_id, checkpoint_folder, message + ", checkpoint", args=args, run_as_future=True,
                path_in_repo=path_in_repo or os.path.basename(checkpoint_folder),
            )
        )  # fmt: skip
    return jobs


def scheduler_differs_from_base(scheduler: Any, base_model: str | None, revision: str | None) -> bool:
    """Whether ``scheduler``'s config differs from the base model's own (a recipe's override); ``True`` when the
    base model's cannot be read (the card then loads the saved one, which is right either way)."""
    if base_model is None:
        return True
    try:
        base = type(scheduler).load_config(base_model, subfolder=SCHEDULER_FOLDER, revision=revision)
    except Exception:  # offline without a cache, a pipeline built in memory: no reference to compare with
        return True
    return any(base.get(key) != value for key, value in scheduler.config.items() if not key.startswith("_"))


def write_trainer_card(
    output_dir: str,
    *,
    adapter: FlowMatchingAdapter,
    transformer: torch.nn.Module,
    args: GRPOJaggConfig,
    base_model: str | None,
    is_lora: bool,
    reward_names: Sequence[str],
    tags: Sequence[str],
    scheduler_overridden: bool,
    samples: Sequence[tuple[str, str]],
    hub_model_id: str | None,
    model_name: str | None = None,
    dataset_name: str | None = None,
) -> None:
    """The model card of a run's weights in ``output_dir`` (see :func:`~trl_jagg.trainer.model_card.write_model_card`);
    ``model_name`` defaults to the Hub repository's or ``output_dir``'s name."""
    if model_name is None:
        model_name = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
        model_name = model_name.split("/")[-1]
    write_model_card(
        output_dir,
        base_model=base_model,
        pipeline_class=adapter.pipeline_class.__name__,
        transformer_class=type(next(iter(adapter.trained_parts(transformer).values()))).__name__,
        is_lora=is_lora,
        args=args,
        reward_names=list(reward_names),
        tags=list(tags),
        guidance_is_cfg=adapter.guidance_is_cfg,
        embedded_guidance=bool(getattr(transformer.config, "guidance_embeds", False)),
        scheduler_class=type(adapter.pipeline.scheduler).__name__ if scheduler_overridden else None,
        samples=list(samples),
        model_name=model_name,
        dataset_name=dataset_name,
        hub_model_id=hub_model_id,
        experts=adapter.card_parts(transformer),
        task="text-to-video"
        if adapter.makes_videos
        else "image-to-image"
        if adapter.edits_images
        else "text-to-image",
        source_call_kwargs=adapter.source_call_kwargs(args.height, args.width) if adapter.edits_images else None,
    )
