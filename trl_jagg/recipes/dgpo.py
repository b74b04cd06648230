"""DGPO's preset (``objective="dgpo"``): SD3.5-Medium with PickScore as the authors' ``config/dgpo.py``
``pickscore_sd3_4gpu`` sets it (Luo-Yihong/DGPO@01ceb4b). Neither the authors nor Flow-Factory publish a FLUX.1
config, so none is shipped. docs/peers/dgpo.md holds the line-by-line sources."""

from __future__ import annotations

from trl_jagg.recipes._shared import _FLOW_GRPO_ADVANTAGES, _FLOW_GRPO_ATTENTION, _FLOW_GRPO_EMA, _lora
from trl_jagg.recipes.recipe import Recipe

# pickscore_sd3_4gpu (config/dgpo.py L140-180 with config/base.py): SD3.5-M at 512 px, 10 rollout steps of
# DPM-Solver++ 2 with CFG 4.5 (the loss runs without CFG), 24 images per prompt, 192 images per optimizer step on 4
# GPUs, one step per rollout; 4 distinct timesteps of 0..6; DPO beta 10, KL 1e-3, clip 5e-2; the old policy an EMA
# ramped to 0.3 that samples from step 200; lr 3e-4 constant; Flow-GRPO's EMA.
DGPO_SD35_PICKSCORE = Recipe(
    name="dgpo-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="DGPO on SD3.5-Medium with PickScore: LoRA r64, ODE rollouts (DPM-Solver++ 2, CFG 4.5), the "
    "group-level DPO loss against the base model, 4 timesteps.",
    source="DGPO (Luo, Hu and Tang 2025, arXiv 2510.08425): config/dgpo.py pickscore_sd3_4gpu (L140-180), "
    "config/base.py and scripts/train_sd3_dgpo.py (loss L162-193, loop L1097-1177) at Luo-Yihong/DGPO@01ceb4b.",
    config={
        "objective": "dgpo",
        "height": 512,
        "width": 512,
        "num_inference_steps": 10,
        "ode_solver_order": 2,
        "guidance_scale": 4.5,
        "num_generations": 24,
        # 192 images per optimizer step on 4 processes as the authors', in micro-batches of one whole group (24)
        # instead of their 12: DGPO's group logits then need no cross-process sum.
        "per_device_train_batch_size": 24,
        "steps_per_generation": 2,
        "gradient_accumulation_steps": 2,
        "dgpo_num_train_timesteps": 4,
        "dgpo_trunc_steps": 6,
        "dgpo_beta": 10.0,
        "beta": 1e-3,
        "epsilon": 5e-2,
        "adv_clip_max": 5.0,
        "dgpo_clip_dsm": True,
        "dgpo_clip_kl": False,
        "dgpo_shared_noise": True,
        "dgpo_old_policy_decay": 0.3,
        "dgpo_old_policy_ramp_rate": 0.001,
        "dgpo_sample_old_policy_after": 200,
        **_FLOW_GRPO_ADVANTAGES,
        "scale_rewards": "batch",
        "learning_rate": 3e-4,
        "weight_decay": 1e-4,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "constant",
        "max_sequence_length": 128,
        "eval_num_inference_steps": 14,
        **_FLOW_GRPO_EMA,
        "use_jagg": False,
        "dtype": "float32",
    },
    lora=_lora(64, _FLOW_GRPO_ATTENTION),
    reward_funcs=("pickscore",),
    mixed_precision="bf16",
    notes=(
        "Micro-batches hold one whole prompt group (24 images, the authors' 12): the same 192 images per optimizer "
        "step on 4 processes, twice the activation memory per micro-batch; the group logits need no all-reduce.",
        "The trained timesteps are drawn once per optimizer step (the authors': once per epoch, the same thing at one "
        "optimizer step per rollout).",
        "On n processes multiply steps_per_generation and gradient_accumulation_steps by 4/n to keep 192 images per "
        "step.",
    ),
)

DGPO_RECIPES = (DGPO_SD35_PICKSCORE,)
