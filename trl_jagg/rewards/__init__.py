"""Reward functions for text-to-image GRPO: the rewards the papers report, usable in one line.

Every reward is a callable ``(prompts: list[str], images: list[PIL.Image.Image], **kwargs) -> list[float | None]``
with a ``__name__`` used as its metric name, called with keywords as in TRL (``prompts=``, ``images=`` and
``completions=``, ``trainer_state=``, the dataset columns); ``None`` marks a sample a reward does not apply to. Build them by factory (``pickscore(device="cuda")``) or by name
(``load_reward_funcs(["pickscore", "hpsv2.1"])``). Model weights load on the first call. See docs/rewards.md.
"""

from trl_jagg.rewards.aesthetic import aesthetic
from trl_jagg.rewards.base import (
    REWARD_REGISTRY,
    RewardFunc,
    RewardSpec,
    available_rewards,
    check_rewards,
    compute_rewards,
    load_reward_funcs,
    register_reward,
    reward_name,
)
from trl_jagg.rewards.calling import RewardInterrupted, RewardTimeout
from trl_jagg.rewards.clip_based import clip_score, hpsv2, pickscore
from trl_jagg.rewards.compression import jpeg_compressibility, jpeg_incompressibility
from trl_jagg.rewards.edit import clip_edit, clip_image_similarity
from trl_jagg.rewards.geneval import geneval
from trl_jagg.rewards.hpsv3 import hpsv3
from trl_jagg.rewards.image_reward import image_reward
from trl_jagg.rewards.lazy import LazyModelReward
from trl_jagg.rewards.ocr import ocr
from trl_jagg.rewards.programmatic import brightness, high_frequency, horizontal_detail, prompt_color
from trl_jagg.rewards.remote import remote
from trl_jagg.rewards.video import takes_videos
from trl_jagg.rewards.vlm_judge import vlm_judge

__all__ = [
    "REWARD_REGISTRY",
    "LazyModelReward",
    "RewardFunc",
    "RewardSpec",
    "RewardInterrupted",
    "RewardTimeout",
    "aesthetic",
    "available_rewards",
    "brightness",
    "high_frequency",
    "horizontal_detail",
    "check_rewards",
    "clip_edit",
    "clip_image_similarity",
    "clip_score",
    "compute_rewards",
    "geneval",
    "hpsv2",
    "hpsv3",
    "image_reward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "load_reward_funcs",
    "ocr",
    "pickscore",
    "prompt_color",
    "register_reward",
    "remote",
    "reward_name",
    "takes_videos",
    "vlm_judge",
]
