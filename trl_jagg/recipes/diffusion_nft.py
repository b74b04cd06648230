"""DiffusionNFT's presets: SD3.5-Medium with PickScore, OCR and GenEval, as ``config/nft.py`` and
``scripts/train_nft_sd3.py`` set them at NVlabs/DiffusionNFT@24af555 (``objective="nft"``)."""

from __future__ import annotations

from ..recipe import Recipe
from ._shared import _FLOW_GRPO_ADVANTAGES, _FLOW_GRPO_ATTENTION, _lora

_NFT_SOURCE = (
    "DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): config/nft.py {config} (L{lines}) and config/base.py, "
    "scripts/train_nft_sd3.py (LoRA L419-431, EMA L565-567, loss L910-970, old policy L1035-1039) at "
    "NVlabs/DiffusionNFT@24af555."
)

# config/nft.py _get_config (L11-67) with config/base.py: SD3.5-M at 512 px, 10 rollout steps with DPM-Solver 2
# (sample.solver="dpm2", deterministic), CFG off (guidance 1.0), 24 images per prompt, 99% of the timesteps trained,
# KL 1e-4 (train.beta), adv_clip_max 5, lr 3e-4, AdamW weight decay 1e-4, grad norm 1, constant rate; EMA 0.9 every
# optimizer step with the (1 + t) / (10 + t) warm-up; Flow-GRPO's per-prompt advantages with global std.
_NFT_SD35 = {
    "objective": "nft",
    "height": 512,
    "width": 512,
    "num_inference_steps": 10,
    "ode_solver_order": 2,
    "guidance_scale": 1.0,
    "num_generations": 24,
    # One whole group per process, 4 micro-batches of 6 (DiffusionNFT: 9 on each of 8 GPUs); one optimizer step per
    # rollout (gradient_step_per_epoch=1).
    "per_device_train_batch_size": 6,
    "steps_per_generation": 4,
    "gradient_accumulation_steps": 4,
    "train_timestep_fraction": 0.99,
    "nft_beta": 1.0,
    "nft_decay_type": 1,
    "beta": 1e-4,
    "adv_clip_max": 5.0,
    **_FLOW_GRPO_ADVANTAGES,
    "scale_rewards": "batch",  # config/base.py: sample.global_std = True
    "learning_rate": 3e-4,
    "weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "constant",
    "max_sequence_length": 128,
    "eval_num_inference_steps": 40,
    "ema_decay": 0.9,
    "ema_update_interval": 1,
    "ema_warmup": True,
    "ema_schedule": "step",
    # JAGG across timesteps is an option (use_jagg=True): on the CPU demo it cost reward per step (docs/benchmarks.md).
    "use_jagg": False,
    "dtype": "float32",
}
_NOTES = (
    "CFG-free: the rollout and the loss run the conditional branch only (guidance_scale 1.0), as DiffusionNFT.",
    "The timesteps trained are the same for every image of a micro-batch (DiffusionNFT permutes them per image); "
    "each image still trains 99% of the rollout's timesteps per rollout.",
    "On GPUs add fp16=True: DiffusionNFT's precision (mixed_precision='fp16').",
)

NFT_SD35_PICKSCORE = Recipe(
    name="nft-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="DiffusionNFT on SD3.5-Medium with PickScore: LoRA, CFG-free ODE rollouts (DPM-Solver 2), "
    "negative-aware flow matching, beta 1.",
    source=_NFT_SOURCE.format(config="sd3_pickscore", lines="97-109"),
    config=_NFT_SD35,
    lora=_lora(32, _FLOW_GRPO_ATTENTION),
    reward_funcs=("pickscore",),
    mixed_precision="fp16",
    notes=_NOTES,
)

NFT_SD35_OCR = Recipe(
    name="nft-sd35-ocr",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="DiffusionNFT on SD3.5-Medium with the OCR reward: beta 0.1, the slow old policy (decay type 2), two "
    "optimizer steps per rollout.",
    source=_NFT_SOURCE.format(config="sd3_ocr", lines="70-79"),
    config={
        **_NFT_SD35,
        "nft_beta": 0.1,
        "nft_decay_type": 2,
        "gradient_accumulation_steps": 2,  # gradient_step_per_epoch=2
    },
    lora=_lora(32, _FLOW_GRPO_ATTENTION),
    reward_funcs=("ocr",),
    mixed_precision="fp16",
    notes=_NOTES,
)

NFT_SD35_GENEVAL = Recipe(
    name="nft-sd35-geneval",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="DiffusionNFT on SD3.5-Medium with the GenEval reward: beta 1, decay type 1.",
    source=_NFT_SOURCE.format(config="sd3_geneval", lines="82-94"),
    config=_NFT_SD35,
    lora=_lora(32, _FLOW_GRPO_ATTENTION),
    reward_funcs=("geneval",),
    mixed_precision="fp16",
    notes=_NOTES,
)

DIFFUSION_NFT_RECIPES = (NFT_SD35_PICKSCORE, NFT_SD35_OCR, NFT_SD35_GENEVAL)
