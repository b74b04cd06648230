"""The evaluation stage: deterministic (ODE) images of held-out prompts with the current (or EMA) weights, scored
by the reward functions."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.models.rollout import generate_images
from trl_jagg.trainer.conditioning import negative_prompt
from trl_jagg.trainer.ema import EMAWeights, ema_swapped_in
from trl_jagg.trainer.placement import FrozenModules, eval_mode
from trl_jagg.trainer.scoring import scored_rewards
from trl_jagg.utils.prompts import (
    SOURCE_IMAGE_COLUMN,
    check_source_images,
    prompt_dataset,
    prompt_text,
    source_image,
    source_images_of,
)


def render_batches(layouts: Sequence[Hashable], size: int) -> list[list[int]]:
    """The rows (indices into ``layouts``) grouped by layout, in order of first appearance, and cut into batches of
    at most ``size``: an editing model's reference grids, which one backbone call shares (the other models give
    ``None`` for every row: consecutive batches)."""
    groups: dict[Hashable, list[int]] = {}
    for row, layout in enumerate(layouts):
        groups.setdefault(layout, []).append(row)
    return [rows[i : i + size] for rows in groups.values() for i in range(0, len(rows), size)]


class Evaluator:
    """Renders and scores prompts with ``transformer`` (the unwrapped backbone) and, when given, the EMA weights.

    Args:
        adapter: the model family's adapter.
        args: the run's configuration (``eval_num_inference_steps``, ``eval_seed``, ``per_device_eval_batch_size``).
        accelerator: the Trainer's accelerator (splits the prompts over processes, gathers the scores).
        frozen: where the text encoders and the VAE run.
        reward_funcs: the loaded reward functions.
        eval_dataset: the held-out prompts the trainer already checked (:func:`~trl_jagg.utils.prompts.prompt_dataset`),
            which :meth:`evaluate` then renders without checking every row again.
    """

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        frozen: FrozenModules,
        reward_funcs: Sequence[Callable[..., Any]],
        eval_dataset: Any = None,
    ):
        self.adapter = adapter
        self.checked_eval_dataset = eval_dataset
        self.args = args
        self.accelerator = accelerator
        self.frozen = frozen
        self.reward_funcs = reward_funcs

    def render(self, prompts: Sequence[str], seed: int, source_images: Sequence | None = None) -> list:
        """ODE images of ``prompts`` (editing ``source_images``, one per prompt) with the weights the backbone holds
        now."""
        args = self.args
        with self.frozen.on_accelerator(self.frozen.text_encoders + self.frozen.vae):
            return generate_images(
                self.adapter,
                list(prompts),
                num_steps=args.eval_num_inference_steps or args.num_inference_steps,
                height=args.height,
                width=args.width,
                guidance_scale=args.guidance_scale,
                true_cfg_scale=args.true_cfg_scale,
                negative_prompt=negative_prompt(self.adapter, args),
                max_sequence_length=args.max_sequence_length,
                seed=seed,
                source_images=source_images,
            )

    def sample_images(
        self,
        transformer: torch.nn.Module,
        ema: EMAWeights | None,
        prompts: Sequence[str] | None = None,
        seed: int | None = None,
        source_images: Sequence | None = None,
    ) -> list:
        """ODE images of ``prompts`` (default ``eval_prompts`` with ``eval_source_images``; seed default
        ``eval_seed``) with the EMA weights when there are some, else the trained ones. An editing model needs
        ``source_images``: PIL images, paths or bytes, one per prompt."""
        args = self.args
        if prompts is None:
            prompts = args.eval_prompts
            source_images = args.eval_source_images if source_images is None else source_images
        if prompts is None:
            raise ValueError("sample_images() needs prompts: pass them, or set GRPOJaggConfig.eval_prompts.")
        if self.adapter.edits_images and source_images is None:
            raise ValueError(
                f"{type(self.adapter).__name__} edits images: sample_images() needs the image each prompt edits. "
                "Pass source_images=[...] (one per prompt), or set GRPOJaggConfig.eval_source_images for eval_prompts."
            )
        if source_images is not None:
            source_images = [source_image(value, f"source_images[{i}]") for i, value in enumerate(source_images)]
        with eval_mode(transformer), ema_swapped_in(ema):
            return self.render(prompts, args.eval_seed if seed is None else seed, source_images)

    def evaluate(
        self, transformer: torch.nn.Module, ema: EMAWeights | None, dataset: Any, *, metric_key_prefix: str,
        trainer_state: Any,
    ) -> tuple[dict[str, float], list, list[str]]:  # fmt: skip
        """Render ``dataset``'s prompts (each process its share, a seed per batch from its first row) and score
        them; returns the metrics (``{prefix}_reward``, ``..._reward_std``, ``..._rewards/<name>/mean``), and this
        process's images and prompts."""
        if dataset is None:
            raise ValueError(
                "evaluate() needs held-out prompts: pass eval_dataset= to DDPOJaggTrainer or to evaluate()."
            )
        args = self.args
        start = time.perf_counter()
        adapter = self.adapter
        edits = adapter.edits_images
        if dataset is not self.checked_eval_dataset:
            # Checked as the training prompts are: a list is converted, a missing 'prompt' column (or an editing
            # model's 'source_image' column) or a bad row named.
            dataset = prompt_dataset(dataset, 1, name="eval_dataset")
            if edits:
                check_source_images(dataset, "eval_dataset", adapter.max_source_images)
        with self.accelerator.split_between_processes(list(range(len(dataset)))) as rows:
            records = [dataset[i] for i in rows]
        prompts = [prompt_text(record["prompt"], "eval_dataset 'prompt'") for record in records]
        columns = (
            {key: [record[key] for record in records] for key in records[0] if key != "prompt"} if records else {}
        )
        sources = None
        if edits:  # as in training: each edit is conditioned on its source and scored against it
            where = f"eval_dataset '{SOURCE_IMAGE_COLUMN}'"
            sources = [
                source_images_of(value, where, adapter.max_source_images)
                for value in columns.pop(SOURCE_IMAGE_COLUMN, [])
            ]
            columns["source_images"] = sources
        layouts = [adapter.reference_sizes(sample) for sample in sources] if edits else [None] * len(prompts)
        images: list = [None] * len(prompts)
        with eval_mode(transformer), ema_swapped_in(ema):
            for batch in render_batches(layouts, args.per_device_eval_batch_size):
                batch_sources = None if sources is None else [sources[i] for i in batch]
                # A seed per batch, from its first row: deterministic for a given process count and batch size.
                rendered = self.render([prompts[i] for i in batch], args.eval_seed + rows[batch[0]], batch_sources)
                for i, image in zip(batch, rendered, strict=True):
                    images[i] = image
        per_reward: dict[str, list[float]] = {}
        reward_metrics: dict[str, list[float]] = defaultdict(list)
        # As in training: retried, and a failure on any process raises RewardFailure on all (the trainer saves).
        total, parts = scored_rewards(
            self.reward_funcs, self.accelerator, prompts, images, weights=args.reward_weights,
            retries=args.reward_retries, timeout=args.reward_timeout, trainer_state=trainer_state,
            # TRL's reward keywords; evaluation has no completions table, so log_extra's columns are dropped.
            log_metric=lambda name, value: reward_metrics[name].append(float(value)),
            log_extra=lambda column, values: None,
            **columns,
        )  # fmt: skip
        if prompts:
            per_reward = {"reward": total.tolist(), **{name: value.tolist() for name, value in parts.items()}}
        gathered: dict[str, list[float]] = defaultdict(list)
        logged: dict[str, list[float]] = defaultdict(list)
        for part, part_metrics in gather_object([(per_reward, dict(reward_metrics))]):  # one pair per process
            for name, values in part.items():
                gathered[name].extend(values)
            for name, values in part_metrics.items():
                logged[name].extend(values)
        metrics = {f"{metric_key_prefix}_{name}": sum(values) / len(values) for name, values in logged.items()}
        for name, values in gathered.items():
            values = torch.tensor(values, dtype=torch.float64)
            values = values[~values.isnan()]  # a reward's None (not applicable) is NaN
            key = f"{metric_key_prefix}_reward" if name == "reward" else f"{metric_key_prefix}_rewards/{name}"
            metrics[key if name == "reward" else f"{key}/mean"] = values.mean().item()
            metrics[f"{key}_std" if name == "reward" else f"{key}/std"] = values.std().item()
        metrics[f"{metric_key_prefix}_samples"] = len(gathered["reward"])
        metrics[f"{metric_key_prefix}_runtime"] = time.perf_counter() - start
        return metrics, images, prompts


class SampleImagesCallback(TrainerCallback):
    """Calls ``log_samples(step)`` every ``image_log_steps`` optimizer steps and at the last one: the trainer
    renders ``eval_prompts``, saves a PNG grid and sends it to the trackers enabled in ``report_to``."""

    def __init__(self, log_samples: Callable[[int], None]):
        self.log_samples = log_samples

    def on_step_end(self, args: GRPOJaggConfig, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % args.image_log_steps == 0 or state.global_step == state.max_steps:
            self.log_samples(state.global_step)
