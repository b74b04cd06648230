"""The trainer's inputs, checked before anything is loaded (datasets, the checkpoint to resume from, the rewards), and
what the model takes besides prompts (source images, video frames), checked once the model is known."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from datasets import Dataset

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.sde_window import default_max_start
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.rewards import LazyModelReward, load_reward_funcs
from trl_jagg.trainer.checkpoint_checks import RESUME_LATEST, check_checkpoint_dir
from trl_jagg.utils.distributed import train_experts_data_parallel
from trl_jagg.utils.prompts import SOURCE_IMAGE_COLUMN, check_source_images, prompt_dataset, source_image


def checked_inputs(
    args: GRPOJaggConfig,
    train_dataset: Dataset | None,
    eval_dataset: Dataset | None,
    reward_funcs: str | Callable[..., Any] | Sequence[str | Callable[..., Any]],
) -> tuple[Dataset, Dataset | None, list[Callable[..., Any]]]:
    """The validated train and eval datasets and the built reward functions, whose Hub weights are checked reachable
    (:meth:`~trl_jagg.rewards.LazyModelReward.check_weights`); errors name the input and the fix."""
    if train_dataset is None:
        raise ValueError("`train_dataset` is required: a datasets.Dataset with a 'prompt' column.")
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        raise ValueError(
            f"`reward_funcs` is {reward_funcs!r}: give a reward name (e.g. 'pickscore'), a callable, or a list of them "
            "(trl_jagg.rewards.available_rewards() lists the names)."
        )
    train_dataset = prompt_dataset(train_dataset, args.prompts_per_rollout)
    if eval_dataset is not None:
        eval_dataset = prompt_dataset(eval_dataset, 1, name="eval_dataset")
    resume = args.resume_from_checkpoint
    if isinstance(resume, str) and resume.lower() not in RESUME_LATEST:
        check_checkpoint_dir(resume, args.output_dir)
    funcs = load_reward_funcs(reward_funcs, args.reward_kwargs, device=args.device)
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise ValueError(
            f"GRPOJaggConfig.reward_weights has {len(args.reward_weights)} values for {len(funcs)} reward functions. "
            "Give one weight per reward function."
        )
    for func in funcs:  # gated, unknown or offline-uncached reward weights fail now, not after the first rollout
        if isinstance(func, LazyModelReward):
            func.check_weights()
    return train_dataset, eval_dataset, funcs


def checked_model_inputs(
    adapter: FlowMatchingAdapter,
    args: GRPOJaggConfig,
    train_dataset: Dataset,
    eval_dataset: Dataset | None,
    reward_funcs: Sequence[Callable[..., Any]] = (),
) -> list[Hashable] | None:
    """What the model takes besides prompts, checked before training (errors name the row or the field). For an
    editing model: ``source_image_area`` given to the adapter, then the images each prompt edits (the datasets'
    rows, ``eval_source_images`` for the sample images) checked row by row; returns each training row's bucket, the
    reference grids its images give (:func:`checked_buckets`). A text model refuses ``eval_source_images``, and a
    video model a ``source_image`` column (no image-to-video conditioning).
    For a video model: ``num_frames``, set on the adapter (refused by image models). For a two-expert model (Wan2.2
    A14B): ``train_experts`` and ``guidance_scale_2``, set on the adapter (refused by one-network models); both
    experts on several processes train under DDP only (:func:`~trl_jagg.utils.distributed.train_experts_data_parallel`). The
    guidance settings, which the adapter refuses where the pipeline has no such guidance (``true_cfg_scale`` for
    CFG-scale families and FLUX.2 dev). Each reward with a ``check_dataset(dataset, *, name, edits_images)`` method
    checks the datasets (columns it needs, prompts it can score, source images it compares with)."""
    name = type(adapter).__name__
    adapter.needs_negative_prompt(args.guidance_scale, args.true_cfg_scale)  # raises on guidance it cannot apply
    if args.source_image_area is not None:
        if not hasattr(adapter, "source_image_area"):
            raise ValueError(
                f"GRPOJaggConfig.source_image_area is set, but {name} does not resize source images by area (only "
                "Qwen-Image-Edit and Qwen-Image-Edit-Plus do). Leave it None."
            )
        adapter.source_image_area = args.source_image_area
    if args.precompute_prompt_embeds and adapter.prompts_see_images:
        raise ValueError(
            f"GRPOJaggConfig.precompute_prompt_embeds cannot be used with {name}: its prompts are encoded together "
            "with each sample's source images. Set precompute_prompt_embeds=False."
        )
    if args.num_frames is not None:
        if not adapter.makes_videos:
            raise ValueError(
                f"GRPOJaggConfig.num_frames is {args.num_frames}, but {type(adapter.pipeline).__name__} makes images. "
                "Leave num_frames unset (None) for image models."
            )
        adapter.num_frames = args.num_frames
    if getattr(adapter, "experts", None) is not None:
        adapter.choose_experts(args.train_experts)
        adapter.guidance_scale_2 = args.guidance_scale_2
        check_trained_expert_steps(adapter, args)
        if len(adapter.trained_experts) > 1 and args.world_size > 1:
            train_experts_data_parallel(args)
    elif args.train_experts != "both" or args.guidance_scale_2 is not None:
        raise ValueError(
            f"GRPOJaggConfig.train_experts={args.train_experts!r} / guidance_scale_2={args.guidance_scale_2!r}, but "
            f"{type(adapter.pipeline).__name__} has one transformer: they choose between the experts of a two-expert "
            'pipeline (Wan2.2 A14B). Leave train_experts="both" and guidance_scale_2=None.'
        )
    for func in reward_funcs:  # a reward that needs what the data or the model lack is refused before a rollout
        check = getattr(func, "check_dataset", None)
        for dataset, where in ((train_dataset, "train_dataset"), (eval_dataset, "eval_dataset")):
            if check is not None and dataset is not None:
                check(dataset, name=where, edits_images=adapter.edits_images)
    if not adapter.edits_images:
        if args.eval_source_images is not None:
            raise ValueError(
                f"GRPOJaggConfig.eval_source_images is set but {name} generates from text only: drop it, or train an "
                "editing model (FluxKontextPipeline, QwenImageEditPipeline)."
            )
        for dataset, where in ((train_dataset, "train_dataset"), (eval_dataset, "eval_dataset")):
            if dataset is not None and SOURCE_IMAGE_COLUMN in dataset.column_names:
                # A silently ignored image would mislead: the run would train text-to-image(-video) on it.
                task = "text-to-video only: image-to-video" if adapter.makes_videos else "from text only: image"
                raise ValueError(
                    f"{where} has a '{SOURCE_IMAGE_COLUMN}' column, but {name} trains {task} conditioning is not "
                    "supported, so the images would be ignored. Drop the column, or train an editing model "
                    "(FluxKontextPipeline, QwenImageEditPipeline)."
                )
        return None
    buckets = check_source_images(train_dataset, "train_dataset", adapter.max_source_images, adapter.reference_sizes)
    if eval_dataset is not None:  # the sizes too: an image that cannot be resized fails the evaluation otherwise
        check_source_images(eval_dataset, "eval_dataset", adapter.max_source_images, adapter.reference_sizes)
    if args.eval_prompts and args.image_log_steps and args.eval_source_images is None:
        raise ValueError(
            f"{name} edits images, so its sample images need the image each of GRPOJaggConfig.eval_prompts edits: set "
            "GRPOJaggConfig.eval_source_images (one file path per prompt), or image_log_steps=0."
        )
    for i, value in enumerate(args.eval_source_images or ()):
        where = f"GRPOJaggConfig.eval_source_images[{i}]"
        image = source_image(value, where)
        try:
            adapter.reference_sizes(image)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
    return checked_buckets(buckets, args.prompts_per_rollout)


def check_trained_expert_steps(adapter: FlowMatchingAdapter, args: GRPOJaggConfig) -> None:
    """A two-expert model training one expert (Wan2.2's ``train_experts``) denoises at least one step that can be
    trained with it: otherwise every update has a zero gradient and the run saves an untrained LoRA.

    Raises:
        ValueError: every step ``train_timesteps`` may train is the other expert's (the steps and timesteps named).
    """
    num_steps = args.num_inference_steps
    if args.train_timesteps == "sde_window":  # the union of the windows any rollout may draw
        last = args.sde_window_max_start
        last = default_max_start(args.sde_window_schedule, num_steps, args.sde_window_size) if last is None else last
        steps = range(min(num_steps, last + args.sde_window_size))
    else:
        steps = range(num_steps - (args.train_timesteps in ("all_but_last", "random_but_last")))
    _, timesteps = adapter.schedule(num_steps, args.height, args.width)
    if args.quantize_timesteps:  # as the rollout feeds the backbone
        timesteps = timesteps.floor()
    times = [float(timesteps[k]) for k in steps]
    if any(adapter.expert_of(t) in adapter.trained_experts for t in times):
        return
    shown = ", ".join(f"{k} (t={t:.0f})" for k, t in zip(steps, times))
    raise ValueError(
        f"GRPOJaggConfig.train_experts={args.train_experts!r} trains {list(adapter.trained_experts)}, but the steps "
        f"train_timesteps={args.train_timesteps!r} can train, {shown} of num_inference_steps={num_steps}, are all "
        "denoised by the other expert: every update would have a zero gradient and the saved LoRA would be "
        "untrained. Train the other expert (train_experts), or steps this one denoises (num_inference_steps, "
        "train_timesteps, sde_window_max_start)."
    )


def checked_buckets(buckets: list[Hashable], prompts_per_rollout: int) -> list[Hashable]:
    """``buckets`` (each training row's reference grids), once every bucket can fill a rollout: one rollout's
    ``prompts_per_rollout`` prompts all come from one bucket (the backbone takes one grid per batch), so a smaller
    bucket would never be drawn.

    Raises:
        ValueError: a bucket with fewer rows than one rollout's prompts (its rows and the fix are named).
    """
    sizes = Counter(buckets)
    small = {key: size for key, size in sizes.items() if size < prompts_per_rollout}
    if small:
        key, size = next(iter(small.items()))
        rows = [i for i, bucket in enumerate(buckets) if bucket == key]
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ValueError(
            f"train_dataset row{'s' if size != 1 else ''} {shown} ({size} of {len(buckets)}) resize 'source_image' "
            f"to {key} (width, height per image), but a rollout draws its {prompts_per_rollout} prompts "
            "(generation_batch_size / num_generations) from rows of one such layout (one backbone call takes one "
            "reference grid), so these rows would never be drawn. Rows per layout: "
            f"{dict(sizes)}. Give every layout at least {prompts_per_rollout} rows (or drop these), resize the "
            "images to another layout's aspect ratio, or lower per_device_train_batch_size or steps_per_generation."
        )
    return buckets
