"""File and folder names of what the trainer saves: a model folder (``save_model``), a checkpoint, a Hub upload."""

from __future__ import annotations

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.models.wan_experts import EXPERTS
from trl_jagg.utils.redaction import redacted_fields

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
"""LoRA weights in the diffusers format that ``pipe.load_lora_weights`` reads."""
FULL_WEIGHTS_PATTERN = "diffusion_pytorch_model*.safetensors"
"""Full fine-tuning: the backbone as ``save_pretrained`` writes it (one file or shards plus an index)."""
SCHEDULER_FOLDER = "scheduler"
EMA_DIR = "ema"
"""Subfolder of every saved model and checkpoint holding the EMA weights, in the format of the trained ones."""
EMA_STATE_NAME = "ema_state.json"
"""In ``ema/``: the optimizer step the average was saved at, which a resume compares with the checkpoint's."""
OLD_POLICY_FILE = "nft_old_policy.safetensors"
"""DiffusionNFT's old policy in a checkpoint: the whole weights, stamped (safetensors metadata) with the step it
last followed and the checkpoint step it was saved at."""
GRPO_STATE_NAME = "grpo_state.json"
"""The trainer's own run state in a checkpoint (the Trainer saves weights, optimizer, scheduler and RNG itself)."""
MODEL_FILES = (
    LORA_WEIGHTS_NAME,
    FULL_WEIGHTS_PATTERN,
    "diffusion_pytorch_model*.safetensors.index.json",
    "config.json",
    SCHEDULER_FOLDER,
    EMA_DIR,
    *EXPERTS,  # a two-expert backbone's folders (Wan2.2), one per trained expert
    "README.md",
)
"""What a model folder holds and a checkpoint push carries up to the Hub (the Trainer's own list knows
transformers' and peft's file names only)."""
HUB_IGNORE_PATTERNS = ["_*", f"{PREFIX_CHECKPOINT_DIR}-*", f"tmp-{PREFIX_CHECKPOINT_DIR}-*"]
"""Never uploaded from ``output_dir``: the Trainer's patterns plus the staging folders of atomic checkpoints."""


def without_secrets(args: GRPOJaggConfig) -> GRPOJaggConfig:
    """A copy of ``args`` for ``training_args.bin`` without secrets (:func:`~trl_jagg.utils.redaction.redacted_fields`:
    the Hub token, keys anywhere in ``reward_kwargs``, URL userinfo), which a Hub push would upload in clear."""
    return redacted_fields(args)
