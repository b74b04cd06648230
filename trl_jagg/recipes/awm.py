"""AWM's presets (``objective="awm"``): SD3.5-Medium with PickScore as the authors' ``config/dgx_awm.py`` sets it
(scxue/advantage_weighted_matching@be51372), and FLUX.1-dev as Flow-Factory's AWM example (X-GenGroup/Flow-Factory@
a0b2bc5, the authors publish no FLUX.1 config). docs/peers/awm.md holds the line-by-line sources."""

from __future__ import annotations

from trl_jagg.recipes._shared import _FLOW_GRPO_ADVANTAGES, _FLOW_GRPO_ATTENTION, _FLUX_FEED_FORWARD, _lora
from trl_jagg.recipes.recipe import Recipe

_AWM_SOURCE = (
    "AWM (Xue et al. 2025, arXiv 2509.25050): config/dgx_awm.py {config} and scripts/train_sd3_awm.py (loss "
    "L1215-1352, KL-EMA L1409-1418) at scxue/advantage_weighted_matching@be51372."
)

# dgx_awm.py pickscore_sd3_no_cfg_1node (L309-377): SD3.5-M at 512 px, 14 deterministic rollout steps (SA-Solver
# order 2 there, DPM-Solver++ 2 here), CFG off, 24 images per prompt, 576 images per rollout on 8 GPUs in micro-batches
# of 2, one optimizer step per rollout; 6 stratified timesteps over 90% of the indices, ghuber 0.25; advantages
# clipped to 5 and scaled to 1; KL 1e-4 to the base and 1 to the KL-EMA; lr 3e-4 constant; EMA 0.99 every step.
_AWM_SD35 = {
    "objective": "awm",
    "height": 512,
    "width": 512,
    "num_inference_steps": 14,
    "ode_solver_order": 2,
    "guidance_scale": 1.0,
    "num_generations": 24,
    "per_device_train_batch_size": 2,
    "steps_per_generation": 36,
    "gradient_accumulation_steps": 36,
    "awm_num_train_timesteps": 6,
    "awm_timestep_fraction": 0.9,
    "awm_timestep_strategy": "discrete",
    "awm_weighting": "ghuber",
    "awm_ghuber_power": 0.25,
    "epsilon": 1.0,
    "adv_clip_max": 5.0,
    "awm_advantage_max": 1.0,
    "beta": 1e-4,
    "awm_ema_kl_beta": 1.0,
    "awm_kl_ema_decay": 0.3,
    "awm_kl_ema_ramp_rate": 0.001,
    **_FLOW_GRPO_ADVANTAGES,
    "scale_rewards": "batch",  # sample.global_std = True
    "learning_rate": 3e-4,
    "weight_decay": 1e-4,
    "max_grad_norm": 1.0,
    "lr_scheduler_type": "constant",
    "max_sequence_length": 128,
    "eval_num_inference_steps": 40,
    "ema_decay": 0.99,
    "ema_update_interval": 1,
    "ema_warmup": True,
    "ema_schedule": "step",
    "use_jagg": False,
    "dtype": "float32",
}
_NOTES = (
    "On-policy, as every published AWM config: one optimizer step per rollout, the ratio 1 in value (the clip never "
    "acts); the config refuses more steps per rollout.",
    "The rollout is a deterministic DPM-Solver++ of order 2, not the authors' SA-Solver: the loss needs only the "
    "clean samples, but the trajectory is not the same.",
    "The timesteps are the authors' strata of rollout indices, the same for every image of a micro-batch. JAGG "
    "across them is an option (use_jagg=True, shared noise within a group): not measured against reward yet.",
    "The batch is the authors' on 8 processes (576 images per optimizer step); on n processes multiply "
    "steps_per_generation and gradient_accumulation_steps by 8/n to keep it.",
)

AWM_SD35_PICKSCORE = Recipe(
    name="awm-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="AWM on SD3.5-Medium with PickScore: LoRA, CFG-free ODE rollouts, advantage-weighted flow matching "
    "(ghuber 0.25) with a KL-EMA.",
    source=_AWM_SOURCE.format(config="pickscore_sd3_no_cfg_1node (L309-377)"),
    config=_AWM_SD35,
    lora=_lora(32, _FLOW_GRPO_ATTENTION),
    reward_funcs=("pickscore",),
    mixed_precision="fp16",
    notes=_NOTES,
)

# Flow-Factory examples/awm/lora/flux1/default.yaml: FLUX.1-dev at 512 px, 10 ODE steps, embedded guidance 3.5, 16
# images per prompt, 768 images per rollout on 8 processes in micro-batches of 2, one optimizer step per rollout;
# 4 timesteps over 70% of the schedule; advantages clipped to 1 and not rescaled; KL-EMA 0.1, no KL to the base.
AWM_FLUX = Recipe(
    name="awm-flux",
    model="black-forest-labs/FLUX.1-dev",
    description="AWM on FLUX.1-dev as Flow-Factory's example: LoRA r64 on attention and feed-forward, 10 ODE steps, "
    "4 stratified timesteps, KL-EMA 0.1.",
    source="Flow-Factory examples/awm/lora/flux1/default.yaml (L21-102) and src/flow_factory/trainers/awm.py at "
    "X-GenGroup/Flow-Factory@a0b2bc5; the loss as the AWM authors' (docs/peers/awm.md).",
    config={
        **_AWM_SD35,
        "num_inference_steps": 10,
        "ode_solver_order": 1,
        "guidance_scale": 3.5,
        "num_generations": 16,
        "steps_per_generation": 48,
        "gradient_accumulation_steps": 48,
        "awm_num_train_timesteps": 4,
        "awm_timestep_fraction": 0.7,
        "adv_clip_max": 1.0,
        "awm_advantage_max": None,
        "beta": 0.0,
        "awm_ema_kl_beta": 0.1,
        "per_prompt_stat_tracking": False,
        "max_sequence_length": 512,
        "eval_num_inference_steps": 20,
        "ema_decay": 0.0,
        "ema_warmup": False,
    },
    lora=_lora(64, (*_FLOW_GRPO_ATTENTION, *_FLUX_FEED_FORWARD)),
    reward_funcs=("pickscore",),
    mixed_precision="bf16",
    notes=(
        *_NOTES[:3],
        "Flow-Factory clips the advantages to 1 without the authors' rescaling (awm_advantage_max=None): its gradient "
        "is up to 5x the authors' for |A| < 1. Its one EMA serves both the KL and sampling; here the KL-EMA is its "
        "own copy and no evaluation EMA is kept.",
    ),
)

AWM_RECIPES = (AWM_SD35_PICKSCORE, AWM_FLUX)
