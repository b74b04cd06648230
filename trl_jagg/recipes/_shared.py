"""What the presets share: the paper's JAGG settings, the attention projections, Flow-GRPO's optimiser, loss,
advantage and EMA settings (its successors reuse them) and the LoRA builder."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

PAPER_JAGG: Mapping[str, Any] = MappingProxyType({"use_jagg": True, "jagg_group_size": 4, "jagg_frac": 0.6})
"""The JAGG settings of the paper (arXiv 2607.17572): W = 4, the high-noise 60% of the groups routed to JAGG."""

ATTENTION_PROJECTIONS: tuple[str, ...] = (
    "to_q", "to_k", "to_v", "to_out.0",  # image stream
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",  # text stream of the joint (MM-DiT) blocks
)  # fmt: skip
"""The attention projections of both streams, named alike in the SD3, Flux and Qwen-Image transformers."""

# Flow-GRPO's LoRA targets (scripts/train_*.py at zhtmike/flow_grpo@9745241). peft matches a listed name against a
# module's full name or any suffix after a dot, so `attn.to_q` adapts `transformer_blocks.0.attn.to_q` but not
# SD3.5's second attention `transformer_blocks.0.attn2.to_q`, which a bare `to_q` would also adapt.
_FLOW_GRPO_ATTENTION = tuple(f"attn.{name}" for name in ATTENTION_PROJECTIONS)
_FLUX_FEED_FORWARD = ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
_QWENIMAGE_FEED_FORWARD = ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

# Optimiser settings of Flow-GRPO's base config shared by its recipes (AdamW betas/eps are the defaults). Flow-GRPO
# builds no learning-rate scheduler: the rate is constant.
_FLOW_GRPO_OPTIM = {
    "learning_rate": 3e-4,
    "weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "constant",
}
_FLOW_GRPO_LOSS = {"epsilon": 1e-4, "adv_clip_max": 5.0}
# Flow-GRPO's advantages (flow_grpo/stat_tracking.py): the prompt's mean over a tracker cleared every epoch, numpy's
# population std + 1e-4. The forward-process presets (DiffusionNFT, AWM, DGPO) take them from it too.
_FLOW_GRPO_ADVANTAGES = {
    "per_prompt_stat_tracking": True,
    "advantage_std_ddof": 0,
    "advantage_eps": 1e-4,
}
# The GRPO presets' advantages with Flow-GRPO's KL, which divides by the sampler's std_dev_t (scripts/train_*.py).
_FLOW_GRPO_ADVANTAGES_AND_KL = {**_FLOW_GRPO_ADVANTAGES, "kl_std": "flow_grpo"}
# Flow-GRPO's EMAModuleWrapper(decay=0.9, update_step_interval=8) with its (1 + t) / (10 + t) warm-up, called after
# every micro-batch (so gradient_accumulation_steps updates when (t + 1) % 8 == 0).
_FLOW_GRPO_EMA = {"ema_decay": 0.9, "ema_update_interval": 8, "ema_warmup": True, "ema_schedule": "flow_grpo"}


def _two_updates_per_rollout(per_device: int, images_per_process: int) -> dict[str, int]:
    """Flow-GRPO's split: gradient_accumulation_steps = num_batches_per_epoch // 2, i.e. two optimizer steps per
    rollout, each sample used once. ``images_per_process`` images are sampled per rollout in micro-batches of
    ``per_device``."""
    micro_batches = images_per_process // per_device
    return {
        "per_device_train_batch_size": per_device,
        "steps_per_generation": micro_batches,
        "gradient_accumulation_steps": micro_batches // 2,
    }


def _lora(rank: int, targets: tuple[str, ...]) -> dict[str, Any]:
    """Flow-GRPO's LoRA: rank ``rank``, alpha ``2 * rank``, gaussian init, on ``targets``."""
    return {"r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "init_lora_weights": "gaussian"}
