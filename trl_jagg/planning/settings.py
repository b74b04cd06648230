"""What a plan needs from a run's configuration: sizes, precision, the copies it keeps, its cadence.

:func:`settings_from_config` reads them from the same objects ``trl-jagg train`` parses (``ScriptArguments`` and
:class:`~trl_jagg.GRPOJaggConfig`), so a plan describes the run the same flags would launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from trl_jagg.models.wan import DEFAULT_NUM_FRAMES
from trl_jagg.models.wan_experts import TRAIN_EXPERTS
from trl_jagg.planning.memory import STRATEGIES, RunCopies

if TYPE_CHECKING:
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.scripts.train import ScriptArguments

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACCELERATE_STRATEGIES = {
    "fsdp2": "fsdp2", "deepspeed_zero2": "zero2", "zero2": "zero2", "deepspeed_zero3": "zero3", "zero3": "zero3",
}  # fmt: skip
"""Names of the shipped accelerate configs (``--accelerate_config``) that shard, and the strategy each means."""


@dataclass(frozen=True)
class RunSettings:
    """A training run as the planner prices it."""

    model: str
    height: int
    width: int
    text_tokens: int
    micro_batch: int
    """Images per backbone call of the update (``per_device_train_batch_size``)."""
    branches: int
    """Backbone rows per image and call: 2 with classifier-free guidance, else 1."""
    graph_branches: int
    """Those of the update's rows that run with a graph: 1 with ``cfg_gradient="conditional"``."""
    lora: dict[str, Any] | None
    """``peft.LoraConfig`` keyword arguments, or ``None`` for full fine-tuning."""
    checkpoint_every: int | None
    """Activation checkpointing of every k-th block (``None``: off)."""
    weights_dtype: torch.dtype
    compute_dtype: torch.dtype
    copies: RunCopies
    strategy: str
    inference_steps: int
    trained_steps: int
    steps_per_generation: int
    gradient_accumulation_steps: int
    num_iterations: int = 1
    references: int = 0
    """Source images in each sample's sequence (1 for an editing model, the same size as the output)."""
    num_frames: int | None = None
    """Pixel frames of each video (a video model's samples; ``None`` for images)."""
    trained_experts: tuple[str, ...] = ("transformer",)
    """The backbone components trained (Wan2.2 A14B's ``train_experts``: one expert or both; the others frozen)."""

    @property
    def rows(self) -> int:
        """Backbone rows of one update micro-batch that run with a graph (what its activations hold)."""
        return self.micro_batch * self.graph_branches


def _strategy(script_args: ScriptArguments, training_args: GRPOJaggConfig) -> str:
    name = script_args.accelerate_config
    if name:
        return ACCELERATE_STRATEGIES.get(str(name).removesuffix(".yaml").rsplit("/", 1)[-1], "ddp")
    return "fsdp2" if training_args.fully_shard_backbone else "ddp"


def _optimizer_state_bytes(optim: str, trainable_element_size: int) -> float:
    # AdamW keeps two moments per parameter in the parameter's dtype; bitsandbytes' 8-bit AdamW one byte each.
    return 2.0 if "8bit" in optim else 2.0 * trainable_element_size


def lora_arguments(script_args: ScriptArguments, default_targets: tuple[str, ...]) -> dict[str, Any] | None:
    """The LoRA adapter ``trl-jagg train`` would add (``None`` for full fine-tuning); ``default_targets`` stand in
    for the model family's when no targets are given."""
    if not script_args.use_peft:
        return None
    return {
        "r": script_args.lora_r,
        "lora_alpha": script_args.lora_alpha,
        "target_modules": list(script_args.lora_target_modules or default_targets),
        "init_lora_weights": "gaussian",
    }


def settings_from_config(
    script_args: ScriptArguments,
    training_args: GRPOJaggConfig,
    *,
    guidance_is_cfg: bool,
    default_lora_targets: tuple[str, ...],
    edits_images: bool = False,
    makes_videos: bool = False,
    mixed_precision: str | None = None,
    strategy: str | None = None,
) -> RunSettings:
    """The :class:`RunSettings` of the run ``trl-jagg train`` would launch with these arguments.

    ``guidance_is_cfg``, ``default_lora_targets``, ``edits_images`` and ``makes_videos`` are the model family's (its
    adapter's class attributes; an editing model's samples carry one source image the size of the output, a video
    model's are ``num_frames`` frames, the pipeline's 81 when unset);
    ``mixed_precision`` (``"bf16"``/``"fp16"``) stands for the flag a GPU run sets when the parsed config has none
    (a preset's :attr:`~trl_jagg.recipes.Recipe.mixed_precision`); ``strategy`` overrides the sharding the config
    implies (``--accelerate_config`` or ``fully_shard_backbone``).
    """
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy is {strategy!r}. Use one of {', '.join(STRATEGIES)}.")
    weights_dtype = DTYPES.get(str(training_args.dtype), torch.float32)
    if training_args.bf16 or mixed_precision == "bf16":
        compute_dtype = torch.bfloat16
    elif training_args.fp16 or mixed_precision == "fp16":
        compute_dtype = torch.float16
    else:
        compute_dtype = weights_dtype
    lora = lora_arguments(script_args, default_lora_targets)
    checkpointing = training_args.activation_checkpointing or training_args.gradient_checkpointing
    every = (training_args.activation_checkpointing_kwargs or {}).get("every_n_layers", 1) if checkpointing else None
    cfg_scale = training_args.guidance_scale if guidance_is_cfg else training_args.true_cfg_scale
    trainable_element_size = 4 if lora is not None else torch.empty(0, dtype=weights_dtype).element_size()
    copies = RunCopies(
        optimizer_state_bytes_per_param=_optimizer_state_bytes(str(training_args.optim), trainable_element_size),
        ema=training_args.ema_decay > 0,
        ema_offload=training_args.ema_offload,
        old_policy=training_args.objective == "nft",
        reference_copy=training_args.beta > 0 and lora is None,
        offload_frozen_modules=training_args.offload_frozen_modules,
    )
    return RunSettings(
        model=script_args.model_name_or_path,
        height=training_args.height,
        width=training_args.width,
        text_tokens=training_args.max_sequence_length or 512,
        micro_batch=training_args.per_device_train_batch_size,
        branches=2 if cfg_scale > 1 else 1,
        graph_branches=2 if cfg_scale > 1 and getattr(training_args, "cfg_gradient", "both") == "both" else 1,
        lora=lora,
        checkpoint_every=every,
        weights_dtype=weights_dtype,
        compute_dtype=compute_dtype,
        copies=copies,
        strategy=strategy or _strategy(script_args, training_args),
        inference_steps=training_args.num_inference_steps,
        trained_steps=training_args.num_trained_steps,
        steps_per_generation=training_args.steps_per_generation,
        gradient_accumulation_steps=training_args.gradient_accumulation_steps,
        num_iterations=training_args.num_iterations,
        references=1 if edits_images else 0,
        num_frames=(training_args.num_frames or DEFAULT_NUM_FRAMES) if makes_videos else None,
        trained_experts=TRAIN_EXPERTS[training_args.train_experts],
    )
