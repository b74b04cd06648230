"""The presets: each builds a valid GRPOJaggConfig with the published numbers, the CLI YAML files match them, the
Flow-GRPO-Fast preset trains only its SDE window and the DanceGRPO preset a random 60% of the steps."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline, FluxPipeline, UniPCMultistepScheduler
from testing_utils import DIFFUSION_NFT, FLOW_FACTORY, NAMES, noise_image

from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
from trl_jagg.models import load_adapter
from trl_jagg.objectives import grpo as update
from trl_jagg.recipes import RECIPES, get_recipe, list_recipes

YAML_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "recipes")
PEER_MODULES = ("_shared", "awm", "dancegrpo", "dgpo", "diffusion_nft", "flow_factory", "flow_grpo")

# The public numbers (JAGG spec section 5), written out independently of trl_jagg/recipes.py.
_SD35_PUBLISHED = dict(
    height=512, width=512, num_inference_steps=10, guidance_scale=4.5, sampler="sde", noise_level=0.7,
    num_generations=24, learning_rate=3e-4, train_timesteps="all_but_last",
)  # fmt: skip
_DANCE_PUBLISHED = dict(
    height=720, width=720, num_inference_steps=16, sampler="dance", noise_level=0.3, learning_rate=1e-5,
    train_timestep_fraction=0.6,
)  # fmt: skip
_NFT_PUBLISHED = dict(
    objective="nft", height=512, width=512, num_inference_steps=10, ode_solver_order=2, guidance_scale=1.0,
    num_generations=24, learning_rate=3e-4, train_timestep_fraction=0.99, beta=1e-4, adv_clip_max=5.0, nft_beta=1.0,
    nft_decay_type=1,
)  # fmt: skip
PUBLISHED = {
    "flow-grpo-sd35": _SD35_PUBLISHED,
    "flow-grpo-sd35-ocr": _SD35_PUBLISHED,
    "flow-grpo-sd35-geneval": _SD35_PUBLISHED,
    "flow-grpo-guard-sd35": {**_SD35_PUBLISHED, "learning_rate": 1e-4},
    "flow-grpo-flux": dict(num_inference_steps=6, guidance_scale=3.5, sampler="sde", noise_level=0.9),
    "flow-grpo-qwenimage": dict(true_cfg_scale=4.0, sampler="sde", noise_level=1.2),
    "flow-grpo-qwenimage-all-steps": dict(true_cfg_scale=4.0, sampler="sde", noise_level=1.2),
    # FG config/grpo.py:782-822 counting_qwenimage_edit
    "flow-grpo-qwenimage-edit": dict(
        height=512, width=512, num_inference_steps=10, true_cfg_scale=4.0, sampler="sde", noise_level=1.0,
        num_generations=16, beta=0.0, train_timesteps="all_but_last", source_image_area=None,
    ),
    "flow-grpo-fast-flux": dict(train_timesteps="sde_window", sde_window_size=3, sde_window_max_start=0),
    # Flow-GRPO config/grpo.py counting_flux_kontext (L654-690)
    "flow-grpo-kontext": dict(
        height=512, width=512, num_inference_steps=6, eval_num_inference_steps=28, guidance_scale=2.5, sampler="sde",
        noise_level=0.9, num_generations=21, learning_rate=3e-4, train_timesteps="all_but_last",
    ),
    # FG config/grpo.py:29-79 (general_ocr_wan2_1): 240x416, 33 frames, 20 steps, CFG 4.5, lr 1e-4, clip 1e-3.
    "flow-grpo-wan2.1": dict(
        height=240, width=416, num_frames=33, num_inference_steps=20, guidance_scale=4.5, num_generations=4,
        learning_rate=1e-4, beta=0.004, epsilon=1e-3, train_timesteps="all_but_last",
    ),
    "dancegrpo-flux": _DANCE_PUBLISHED,
    "dancegrpo-flux-8gpu": _DANCE_PUBLISHED,
    # DG scripts/finetune/finetune_wan_2_1_grpo.sh:37-41, 47, 51, 55: 512 x 512, one frame, 20 steps, eta 0.3, CFG 5.
    "dancegrpo-wan2.1": dict(
        height=512, width=512, num_frames=1, num_inference_steps=20, guidance_scale=5.0, sampler="dance",
        noise_level=0.3, num_generations=12, learning_rate=1e-5, train_timestep_fraction=0.6,
    ),
    # DG scripts/finetune/finetune_qwenimage_edit_grpo.sh:38-42, 48, 52: 512 x 512, 20 steps, eta 0.3, no CFG.
    "dancegrpo-qwenimage-edit": dict(
        height=512, width=512, num_inference_steps=20, true_cfg_scale=1.0, sampler="dance", noise_level=0.3,
        num_generations=8, learning_rate=1e-5, train_timestep_fraction=0.6, source_image_area=None,
    ),
    # MixGRPO-Flash (Tencent-Hunyuan/MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh).
    "mixgrpo-flux": dict(
        height=720, width=720, num_inference_steps=25, sampler="sde", noise_level=0.7, num_generations=12,
        learning_rate=1e-5, train_timesteps="sde_window", sde_window_size=4, sde_window_schedule="progressive",
        sde_window_stride=1, sde_window_shift_interval=20, ode_solver_order=2, ode_step_ratio=0.4,
    ),
    # Not a peer's: MixGRPO-Flash with its window held on steps 0-3 (issue 29; docs/models.md says why).
    "jagg-fast-flux": dict(
        height=720, width=720, num_inference_steps=25, sampler="sde", noise_level=0.7, num_generations=12,
        learning_rate=1e-5, train_timesteps="sde_window", sde_window_size=4, sde_window_schedule="fixed",
        sde_window_max_start=0, ode_solver_order=2, ode_step_ratio=0.4, jagg_cache_velocities=True,
    ),
    # Flow-Factory examples/grpo/lora/z_image{,_turbo}/default.yaml (L44-80)
    "flow-factory-z-image": dict(
        height=512, width=512, num_inference_steps=10, guidance_scale=4.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    "flow-factory-z-image-turbo": dict(
        height=512, width=512, num_inference_steps=6, guidance_scale=0.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    # Flow-Factory examples/grpo/lora/flux2_klein{_base,}/default.yaml (L43-90)
    "flow-factory-flux2-klein-base": dict(
        height=384, width=384, num_inference_steps=8, guidance_scale=4.0, sampler="sde", noise_level=0.7,
        num_generations=16, learning_rate=3e-4, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    "flow-factory-flux2-klein": dict(
        height=384, width=384, num_inference_steps=4, guidance_scale=1.0, sampler="sde", noise_level=0.5,
        num_generations=16, learning_rate=3e-4, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    # Flow-Factory examples/grpo/lora/flux2/t2i.yaml (L41-116): CLIP 1.0 + PickScore 0.5, GDPO
    "flow-factory-flux2-dev": dict(
        height=512, width=512, num_inference_steps=8, guidance_scale=4.0, sampler="sde", noise_level=1.0,
        num_generations=16, learning_rate=3e-4, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
        reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum",
    ),
    # Flow-Factory examples/grpo/lora/wan22/t2v.yaml (L27, L53-98): both experts, CFG 4 then 3, lr 1e-4.
    "flow-factory-wan2.2": dict(
        height=480, width=480, num_frames=5, num_inference_steps=10, guidance_scale=4.0, guidance_scale_2=3.0,
        train_experts="both", sampler="sde", noise_level=0.9, num_generations=16, learning_rate=1e-4, beta=0.0,
        epsilon=1e-4, adv_clip_max=5.0,
    ),
    # DiffusionNFT config/nft.py:11-67 (_get_config) at NVlabs/DiffusionNFT@24af555: SD3.5-M, 512 px, 10 steps,
    # DPM-Solver 2 deterministic, CFG off, 24 images per prompt, timestep_fraction 0.99 (base.py), KL 1e-4.
    "nft-sd35": _NFT_PUBLISHED,
    "nft-sd35-ocr": {**_NFT_PUBLISHED, "nft_beta": 0.1, "nft_decay_type": 2},  # config/nft.py:70-79 (sd3_ocr)
    "nft-sd35-geneval": _NFT_PUBLISHED,
    # AWM scxue/advantage_weighted_matching@be51372 config/dgx_awm.py:309-377 (pickscore_sd3_no_cfg_1node): 14 steps,
    # CFG off, 24 images per prompt, 6 strata over 90% of the indices, ghuber 0.25, clip 1, advantages clipped to 5
    # and scaled to 1, KL 1e-4, KL-EMA 1 ramped to 0.3 at 0.001 per step, lr 3e-4.
    "awm-sd35": dict(
        objective="awm", height=512, width=512, num_inference_steps=14, ode_solver_order=2, guidance_scale=1.0,
        num_generations=24, learning_rate=3e-4, awm_num_train_timesteps=6, awm_timestep_fraction=0.9,
        awm_timestep_strategy="discrete", awm_weighting="ghuber", awm_ghuber_power=0.25, epsilon=1.0,
        adv_clip_max=5.0, awm_advantage_max=1.0, beta=1e-4, awm_ema_kl_beta=1.0, awm_kl_ema_decay=0.3,
        awm_kl_ema_ramp_rate=0.001,
    ),
    # Flow-Factory@a0b2bc5 examples/awm/lora/flux1/default.yaml L41-70: 10 steps, guidance 3.5, 16 images, 4 strata
    # over 70%, advantages clipped to 1 and not rescaled, no KL to the base, KL-EMA 0.1.
    "awm-flux": dict(
        objective="awm", height=512, width=512, num_inference_steps=10, guidance_scale=3.5, num_generations=16,
        learning_rate=3e-4, awm_num_train_timesteps=4, awm_timestep_fraction=0.7, epsilon=1.0, adv_clip_max=1.0,
        awm_advantage_max=None, beta=0.0, awm_ema_kl_beta=0.1,
    ),
    # DGPO Luo-Yihong/DGPO@01ceb4b config/dgpo.py:140-180 (pickscore_sd3_4gpu): 10 steps of DPM-Solver++ 2, CFG 4.5,
    # 24 images per prompt, 4 of indices 0..6, DPO beta 10, KL 1e-3, clip 5e-2, the old policy samples from step 200.
    "dgpo-sd35": dict(
        objective="dgpo", height=512, width=512, num_inference_steps=10, ode_solver_order=2, guidance_scale=4.5,
        num_generations=24, learning_rate=3e-4, dgpo_num_train_timesteps=4, dgpo_trunc_steps=6, dgpo_beta=10.0,
        beta=1e-3, epsilon=5e-2, adv_clip_max=5.0, dgpo_clip_dsm=True, dgpo_clip_kl=False, dgpo_shared_noise=True,
        dgpo_old_policy_decay=0.3, dgpo_old_policy_ramp_rate=0.001, dgpo_sample_old_policy_after=200,
    ),
}  # fmt: skip
# The peers' conventions around the formulas, read from their code (docs/models.md lists file and line for each).
# Flow-GRPO: config/grpo.py (pickscore_sd3, pickscore_flux, pickscore_flux_fast, pickscore_qwenimage),
# flow_grpo/stat_tracking.py, flow_grpo/ema.py, scripts/train_sd3.py / train_flux.py; DanceGRPO:
# fastvideo/train_grpo_flux.py and scripts/finetune/finetune_flux_grpo.sh.
_FLOW_GRPO = dict(
    per_prompt_stat_tracking=True, stat_tracking_buffer_size=None, advantage_std_ddof=0, advantage_eps=1e-4,
    kl_std="flow_grpo", same_group_noise=False, quantize_timesteps=False,
)  # fmt: skip
_FLOW_GRPO_EMA = dict(ema_decay=0.9, ema_update_interval=8, ema_warmup=True, ema_schedule="flow_grpo")
_SD35_CONVENTIONS = dict(
    **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="batch", max_sequence_length=128, eval_num_inference_steps=40,
    drop_zero_advantages=True, cfg_gradient="both",
)  # fmt: skip
_QWENIMAGE_CONVENTIONS = dict(
    **_FLOW_GRPO, ema_decay=0.0, scale_rewards="batch", max_sequence_length=512, eval_num_inference_steps=50,
    cfg_gradient="both",
)  # fmt: skip
_DANCE_CONVENTIONS = dict(
    per_prompt_stat_tracking=False, scale_rewards="group", advantage_std_ddof=1, advantage_eps=1e-8,
    quantize_timesteps=True, same_group_noise=True, max_sequence_length=512, train_timesteps="random_but_last",
    beta=0.0,
)  # fmt: skip
PEER_CONVENTIONS = {
    "flow-grpo-sd35": _SD35_CONVENTIONS,
    "flow-grpo-sd35-ocr": _SD35_CONVENTIONS,
    "flow-grpo-sd35-geneval": _SD35_CONVENTIONS,
    "flow-grpo-guard-sd35": {**_SD35_CONVENTIONS, "scale_rewards": "group"},
    "flow-grpo-flux": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="batch", max_sequence_length=128, eval_num_inference_steps=28,
        drop_zero_advantages=False,
    ),
    "flow-grpo-qwenimage": _QWENIMAGE_CONVENTIONS,
    "flow-grpo-qwenimage-all-steps": _QWENIMAGE_CONVENTIONS,
    # QwenImageEditPipeline.encode_prompt ignores max_sequence_length; negative " " (FG train_qwenimage_edit.py:267)
    "flow-grpo-qwenimage-edit": {**_QWENIMAGE_CONVENTIONS, "max_sequence_length": None, "negative_prompt": " "},
    "flow-grpo-fast-flux": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="group", max_sequence_length=128, eval_num_inference_steps=28,
    ),
    "flow-grpo-kontext": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="batch", max_sequence_length=128, eval_num_inference_steps=28,
        drop_zero_advantages=True,
    ),
    "flow-grpo-wan2.1": dict(
        **_FLOW_GRPO, **_FLOW_GRPO_EMA, scale_rewards="group", max_sequence_length=512, eval_num_inference_steps=50,
        drop_zero_advantages=True, cfg_gradient="both", negative_prompt="",
    ),
    "dancegrpo-flux": dict(**_DANCE_CONVENTIONS, ema_decay=0.0),
    "dancegrpo-flux-8gpu": dict(**_DANCE_CONVENTIONS, ema_decay=0.995, ema_warmup=False, ema_offload=True),
    # DG fastvideo/train_grpo_wan_2_1.py:195-205 (CFG on both branches), preprocess_wan_2_1_embeddings.py:104-105
    # (encode_prompt's defaults: negative "", 226 tokens).
    "dancegrpo-wan2.1": dict(
        **{**_DANCE_CONVENTIONS, "max_sequence_length": 226}, ema_decay=0.0, negative_prompt="", cfg_gradient="both",
        reward_on_predicted_x0=True,
    ),
    # DG preprocess_qwenimage_edit_embeddings.py:74-78 (encode_prompt untruncated), no --use_ema.
    "dancegrpo-qwenimage-edit": dict(
        **{**_DANCE_CONVENTIONS, "max_sequence_length": None}, ema_decay=0.0, reward_on_predicted_x0=True,
    ),
    "mixgrpo-flux": dict(
        per_prompt_stat_tracking=False, scale_rewards="group", advantage_std_ddof=1, advantage_eps=1e-8,
        quantize_timesteps=True, same_group_noise=True, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    "jagg-fast-flux": dict(  # MixGRPO-Flash's
        per_prompt_stat_tracking=False, scale_rewards="group", advantage_std_ddof=1, advantage_eps=1e-8,
        quantize_timesteps=True, same_group_noise=True, beta=0.0, epsilon=1e-4, adv_clip_max=5.0,
    ),
    # Flow-Factory: global_std false (L59), numpy's std (src/flow_factory/advantage/advantage_processor.py:385, 463),
    # EMA 0.9 every 4 (L73-74), the pipeline's 512 prompt tokens.
    "flow-factory-z-image": dict(
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=40, negative_prompt="",
    ),
    "flow-factory-z-image-turbo": dict(
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=10,
    ),
    "flow-factory-flux2-klein-base": dict(
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=28, negative_prompt="",
    ),
    "flow-factory-flux2-klein": dict(
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=10,
    ),
    "flow-factory-flux2-dev": dict(
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=28,
    ),
    "flow-factory-wan2.2": dict(  # t2v.yaml L70, L84-85, eval 28 steps (L108)
        scale_rewards="group", advantage_std_ddof=0, ema_decay=0.9, ema_update_interval=4, max_sequence_length=512,
        eval_num_inference_steps=28, negative_prompt="",
    ),
    # DiffusionNFT: Flow-GRPO's stat tracker with global std (train_nft_sd3.py:508), EMA 0.9 every optimizer step with
    # the (1 + t) / (10 + t) warm-up (train_nft_sd3.py:565-567, flow_grpo/ema.py:25-26), prompts of 128 tokens, 40
    # evaluation steps (config/nft.py:20-21).
    **dict.fromkeys(DIFFUSION_NFT, dict(
        per_prompt_stat_tracking=True, advantage_std_ddof=0, advantage_eps=1e-4, scale_rewards="batch",
        ema_decay=0.9, ema_update_interval=1, ema_warmup=True, ema_schedule="step", max_sequence_length=128,
        eval_num_inference_steps=40,
    )),
    # AWM: Flow-GRPO's tracker with global std (dgx_awm.py:350), EMA 0.99 every step with warm-up (dgx_awm.py:370-371).
    "awm-sd35": dict(
        per_prompt_stat_tracking=True, advantage_std_ddof=0, advantage_eps=1e-4, scale_rewards="batch",
        ema_decay=0.99, ema_update_interval=1, ema_warmup=True, ema_schedule="step", eval_num_inference_steps=40,
    ),
    # Flow-Factory's AWM FLUX.1: batch-global std (L42, numpy std), no evaluation EMA, 20 evaluation steps (L102).
    "awm-flux": dict(scale_rewards="batch", advantage_std_ddof=0, ema_decay=0.0, eval_num_inference_steps=20),
    # DGPO: Flow-GRPO's tracker with global std (dgpo.py:166, 179) and Flow-GRPO's EMA (train_sd3_dgpo.py:627).
    "dgpo-sd35": dict(
        per_prompt_stat_tracking=True, advantage_std_ddof=0, advantage_eps=1e-4, scale_rewards="batch",
        ema_decay=0.9, ema_update_interval=8, ema_warmup=True, ema_schedule="flow_grpo", eval_num_inference_steps=14,
    ),
}  # fmt: skip

# The training around the formulas (issue 18): one row per convention, the peer's value and where it is written.
# FG = Flow-GRPO at zhtmike/flow_grpo@9745241, DG = DanceGRPO at XueZeyue/DanceGRPO@15cc71d.
_FG_CONSTANT_LR = ("lr_scheduler_type", "constant", "FG scripts/train_sd3.py:465-471: an AdamW, no scheduler")
PEER_TRAINING = {
    "flow-grpo-sd35": [
        _FG_CONSTANT_LR,
        ("beta", 0.01, "FG config/grpo.py:227 (pickscore_sd3)"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:224 (GA = num_batches_per_epoch // 2)"),
        ("num_iterations", 1, "FG config/grpo.py:225 (num_inner_epochs = 1)"),
        ("dtype", "float32", "FG scripts/train_sd3.py:377, 415 (the transformer loaded and kept in float32)"),
        ("mixed_precision", "fp16", "FG config/base.py:24 (mixed_precision = 'fp16'), not overridden"),
    ],
    "flow-grpo-sd35-ocr": [
        _FG_CONSTANT_LR,
        ("beta", 0.04, "FG config/grpo.py:106 (general_ocr_sd3)"),
        ("reward_funcs", ("ocr",), "FG config/grpo.py:116-118"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:102"),
    ],
    "flow-grpo-sd35-geneval": [
        _FG_CONSTANT_LR,
        ("beta", 0.04, "FG config/grpo.py:147 (geneval_sd3)"),
        ("reward_funcs", ("geneval",), "FG config/grpo.py:154-156"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:144"),
        ("scale_rewards", "batch", "FG config/grpo.py:148 (global_std = True)"),
        ("mixed_precision", "fp16", "FG config/base.py:24 (mixed_precision = 'fp16'), not overridden"),
    ],
    "flow-grpo-guard-sd35": [
        _FG_CONSTANT_LR,
        ("ratio_normalization", True, "FG config/grpo_guard.py:127, scripts/train_sd3_GRPO_Guard.py:915-919"),
        ("step_gradient_reweighting", True, "FG config/grpo_guard.py:127, scripts/train_sd3_GRPO_Guard.py:931-932"),
        ("epsilon", 4e-6, "FG config/grpo_guard.py:124 (and train_sd3_GRPO_Guard.py:925-926: both sides)"),
        ("learning_rate", 1e-4, "FG config/grpo_guard.py:126"),
        ("beta", 0.0, "FG config/grpo_guard.py:111"),
        ("scale_rewards", "group", "FG config/grpo_guard.py:112 (global_std = False)"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo_guard.py:108"),
        ("mixed_precision", "fp16", "FG config/grpo_guard.py:123"),
        ("reward_funcs", ("pickscore",), "FG config/grpo_guard.py:118-120"),
    ],
    "flow-grpo-flux": [
        _FG_CONSTANT_LR,
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:503"),
        ("per_device_train_batch_size", 3, "FG config/grpo.py:496, 502"),
        ("dtype", "float32", "FG scripts/train_flux.py:370, 407"),
        ("mixed_precision", "bf16", "FG config/grpo.py:511"),
    ],
    "flow-grpo-qwenimage": [
        _FG_CONSTANT_LR,
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:711"),
        ("per_device_train_batch_size", 4, "FG config/grpo.py:704, 710"),
        ("train_timesteps", "sde_window", "FG config/grpo.py:718"),
        ("sde_window_size", 2, "FG config/grpo.py:718"),
        ("sde_window_max_start", 3, "FG config/grpo.py:719: range (0, 10 // 2) holds starts 0..5 - 2"),
        ("jagg_group_size", 2, "W <= the 2 trained steps"),
        ("dtype", "float32", "FG scripts/train_qwenimage.py:451 (FSDP over float32 weights)"),
        ("mixed_precision", "bf16", "FG config/grpo.py:720, scripts/train_qwenimage.py:446"),
    ],
    "flow-grpo-qwenimage-edit": [
        _FG_CONSTANT_LR,
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:796, 801: 4 batches a rollout, accumulation 2"),
        ("per_device_train_batch_size", 4, "FG config/grpo.py:794, 800"),
        ("jagg_group_size", 4, "the paper's W, on the 9 trained steps (FG train_qwenimage_edit.py:367)"),
        ("ema_decay", 0.0, "FG config/grpo.py:806"),
        ("mixed_precision", "bf16", "FG config/grpo.py:810"),
    ],
    "flow-grpo-qwenimage-all-steps": [
        _FG_CONSTANT_LR,
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:711"),
        ("train_timesteps", "all_but_last", "trl_jagg's variant, not the peer's"),
        ("jagg_group_size", 4, "the paper's W"),
    ],
    "flow-grpo-fast-flux": [
        _FG_CONSTANT_LR,
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:629"),
        ("per_device_train_batch_size", 3, "FG config/grpo.py:622, 628"),
        ("dtype", "float32", "FG scripts/train_flux_fast.py:375, 412"),
        ("mixed_precision", "bf16", "FG config/grpo.py:640"),
    ],
    "flow-grpo-kontext": [
        ("lr_scheduler_type", "constant", "FG scripts/train_flux_kontext.py:462-468: an AdamW, no scheduler"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:673 (GA = num_batches_per_epoch // 2)"),
        ("num_iterations", 1, "FG config/grpo.py:674"),
        ("per_device_train_batch_size", 3, "FG config/grpo.py:666, 672"),
        ("num_generations", 21, "FG config/grpo.py:667"),
        ("beta", 0.0, "FG config/grpo.py:676"),
        ("scale_rewards", "batch", "FG config/grpo.py:677 (global_std = True)"),
        ("drop_zero_advantages", True, "FG scripts/train_flux_kontext.py:766-786 (zero-advantage samples masked)"),
        ("ema_decay", 0.9, "FG config/grpo.py:679, scripts/train_flux_kontext.py:442"),
        ("reward_funcs", ("clip-image-similarity", "geneval"), "FG config/grpo.py:685-688"),
        ("reward_weights", [0.5, 0.5], "FG config/grpo.py:685-688"),
        ("dtype", "float32", "FG scripts/train_flux_kontext.py:370, 407"),
        ("mixed_precision", "bf16", "FG config/grpo.py:681"),
    ],
    "flow-grpo-wan2.1": [
        _FG_CONSTANT_LR,
        ("per_device_train_batch_size", 8, "FG config/grpo.py:43, 48 (train_batch_size 8)"),
        ("optimizer_steps_per_rollout", 2, "FG config/grpo.py:45, 49 (2 batches, GA = 2 // 2 = 1)"),
        ("num_iterations", 1, "FG config/grpo.py:50"),
        ("reward_funcs", ("ocr",), "FG config/grpo.py:71-73 (video_ocr)"),
        ("dtype", "float32", "FG scripts/train_wan2_1.py:444 (the LoRA transformer not cast)"),
        ("mixed_precision", "bf16", "FG config/grpo.py:64"),
    ],
    "dancegrpo-flux": [
        ("lr_scheduler_type", "constant_with_warmup", "DG fastvideo/train_grpo_flux.py:1047-1049 (the default)"),
        ("warmup_steps", 0, "DG scripts/finetune/finetune_flux_grpo.sh:47"),
        ("per_device_train_batch_size", 1, "DG train_grpo_flux.py:571 (one sample a backward)"),
        ("steps_per_generation", 12, "DG finetune_flux_grpo.sh:29, 52 (1 prompt x 12 generations per rank)"),
        ("gradient_accumulation_steps", 4, "DG finetune_flux_grpo.sh:34, train_grpo_flux.py:609"),
        ("optimizer_steps_per_rollout", 3, "12 samples, a step every 4"),
        ("reward_on_predicted_x0", True, "DG train_grpo_flux.py:145, 254, 379-382 (pred_original decoded)"),
        ("dtype", "float32", "DG train_grpo_flux.py:697-703 (float32 master weights)"),
        ("mixed_precision", "bf16", "DG finetune_flux_grpo.sh:37"),
    ],
    "dancegrpo-flux-8gpu": [
        ("lr_scheduler_type", "constant_with_warmup", "DG fastvideo/train_grpo_flux.py:1047-1049 (the default)"),
        ("steps_per_generation", 24, "DG finetune_flux_grpo_8gpus.sh:26, 49 (2 prompts x 12 generations)"),
        ("gradient_accumulation_steps", 12, "DG finetune_flux_grpo_8gpus.sh:31"),
        ("optimizer_steps_per_rollout", 2, "24 samples, a step every 12"),
        ("ema_decay", 0.995, "DG finetune_flux_grpo_8gpus.sh:56-57"),
        ("ema_update_interval", 2, "DG train_grpo_flux.py:866-867: once per train_one_step, i.e. per rollout"),
        ("ema_warmup", False, "DG train_grpo_flux.py:81-85: decay * ema + (1 - decay) * w, no warm-up"),
        ("ema_offload", True, "DG train_grpo_flux.py:69-73 (full state dict, cpu_offload=True, on rank 0)"),
        ("max_grad_norm", 0.01, "DG finetune_flux_grpo_8gpus.sh:46"),
    ],
    "dancegrpo-wan2.1": [
        ("lr_scheduler_type", "constant_with_warmup", "DG fastvideo/train_grpo_wan_2_1.py:951-959 (the default)"),
        ("warmup_steps", 0, "DG scripts/finetune/finetune_wan_2_1_grpo.sh:42"),
        ("per_device_train_batch_size", 1, "DG train_grpo_wan_2_1.py:494-526 (one sample a backward)"),
        ("steps_per_generation", 24, "DG finetune_wan_2_1_grpo.sh:24, 47 (2 prompts x 12 generations per rank)"),
        ("gradient_accumulation_steps", 24, "DG finetune_wan_2_1_grpo.sh:29, train_grpo_wan_2_1.py:530"),
        ("optimizer_steps_per_rollout", 1, "24 samples, a step every 24"),
        ("max_grad_norm", 1.0, "DG finetune_wan_2_1_grpo.sh:44"),
        ("weight_decay", 1e-4, "DG finetune_wan_2_1_grpo.sh:45"),
        ("epsilon", 1e-4, "DG finetune_wan_2_1_grpo.sh:53"),
        ("adv_clip_max", 5.0, "DG finetune_wan_2_1_grpo.sh:54"),
        ("activation_checkpointing", True, "DG finetune_wan_2_1_grpo.sh:23, train_grpo_wan_2_1.py:620-623"),
        ("reward_funcs", ("hpsv2.1",), "DG finetune_wan_2_1_grpo.sh:46, train_grpo_wan_2_1.py:602 (HPS v2.1)"),
        ("mixed_precision", "bf16", "DG finetune_wan_2_1_grpo.sh:32"),
    ],
    "dancegrpo-qwenimage-edit": [
        ("lr_scheduler_type", "constant_with_warmup", "DG train_grpo_qwenimage_edit.py:1087-1095 (the default)"),
        ("warmup_steps", 0, "DG scripts/finetune/finetune_qwenimage_edit_grpo.sh:43"),
        ("per_device_train_batch_size", 1, "DG train_grpo_qwenimage_edit.py:597-635 (one sample a backward)"),
        ("steps_per_generation", 16, "DG finetune_qwenimage_edit_grpo.sh:25, 48 (2 prompts x 8 generations)"),
        ("gradient_accumulation_steps", 8, "DG finetune_qwenimage_edit_grpo.sh:30, train_grpo_qwenimage_edit.py:639"),
        ("optimizer_steps_per_rollout", 2, "16 samples, a step every 8"),
        ("max_grad_norm", 1.0, "DG finetune_qwenimage_edit_grpo.sh:45"),
        ("weight_decay", 1e-4, "DG finetune_qwenimage_edit_grpo.sh:46"),
        ("epsilon", 1e-4, "DG finetune_qwenimage_edit_grpo.sh:54"),
        ("adv_clip_max", 5.0, "DG finetune_qwenimage_edit_grpo.sh:55"),
        ("dtype", "float32", "DG train_grpo_qwenimage_edit.py:736-740 (float32 master weights)"),
        ("activation_checkpointing", True, "DG train_grpo_qwenimage_edit.py:758-760"),
        ("reward_funcs", ("hpsv2.1",), "DG finetune_qwenimage_edit_grpo.sh:47, train_grpo_qwenimage_edit.py:711"),
        ("mixed_precision", "bf16", "DG finetune_qwenimage_edit_grpo.sh:33"),
    ],
    "mixgrpo-flux": [
        ("lr_scheduler_type", "constant_with_warmup", "MG fastvideo/train_grpo_flux.py:1152-1156 (the default)"),
        ("warmup_steps", 0, "MG finetune_flux_grpo_MixGRPO_Flash.sh:146"),
        ("per_device_train_batch_size", 1, "MG train_grpo_flux.py:511-518, 543 (one sample a backward)"),
        ("steps_per_generation", 12, "MG finetune_flux_grpo_MixGRPO_Flash.sh:128, 150 (1 prompt x 12 generations)"),
        ("gradient_accumulation_steps", 3, "MG finetune_flux_grpo_MixGRPO_Flash.sh:68, train_grpo_flux.py:606"),
        ("optimizer_steps_per_rollout", 4, "12 samples, a step every 3"),
        ("dtype", "float32", "MG train_grpo_flux.py:776-781 (float32 master weights)"),
        ("mixed_precision", "bf16", "MG finetune_flux_grpo_MixGRPO_Flash.sh:136"),
        ("max_grad_norm", 1.0, "MG finetune_flux_grpo_MixGRPO_Flash.sh:148"),
        ("weight_decay", 1e-4, "MG finetune_flux_grpo_MixGRPO_Flash.sh:149"),
    ],
    **{
        name: [  # Flow-Factory's presets share these (trl_jagg.recipes._flow_factory)
            ("lr_scheduler_type", "constant", "FF src/flow_factory/trainers/abc.py:198-207 (an AdamW, no scheduler)"),
            (
                "steps_per_generation",
                24,
                "FF default.yaml / t2i.yaml: 48 prompts x 16 on 8 processes = 96 each, 4 a batch",
            ),
            ("optimizer_steps_per_rollout", 2, "FF default.yaml / t2i.yaml gradient_step_per_epoch: 2"),
            ("mixed_precision", "bf16", "FF default.yaml / t2i.yaml mixed_precision (L6)"),
            ("max_grad_norm", 1.0, "FF default.yaml / t2i.yaml max_grad_norm"),
            ("weight_decay", 1e-4, "FF default.yaml / t2i.yaml adam_weight_decay"),
        ]
        for name in FLOW_FACTORY
    },
    "nft-sd35": [
        ("lr_scheduler_type", "constant", "NFT scripts/train_nft_sd3.py:452-460: an AdamW, no scheduler"),
        ("optimizer_steps_per_rollout", 1, "NFT config/nft.py:103 (gradient_step_per_epoch=1)"),
        ("num_iterations", 1, "NFT config/base.py (train.num_inner_epochs = 1)"),
        ("use_jagg", False, "JAGG across timesteps is an option; on the CPU demo it lost reward per step"),
        ("mixed_precision", "fp16", "NFT config/base.py (mixed_precision = 'fp16')"),
    ],
    "nft-sd35-ocr": [
        ("optimizer_steps_per_rollout", 2, "NFT config/nft.py:75 (gradient_step_per_epoch=2)"),
        ("reward_funcs", ("ocr",), "NFT config/nft.py:71-73"),
    ],
    "nft-sd35-geneval": [("reward_funcs", ("geneval",), "NFT config/nft.py:83-85")],
}
PEER_TRAINING.update({
    "awm-sd35": [
        ("lr_scheduler_type", "constant", "AWM base_awm.py:70-83 (cosine over 1e10 steps: constant in practice)"),
        ("optimizer_steps_per_rollout", 1, "AWM dgx_awm.py:329-331 (36 micro-batches accumulated: one step)"),
        ("per_device_train_batch_size", 2, "AWM dgx_awm.py:322-324 (train batch 2)"),
        ("mixed_precision", "fp16", "AWM base_awm.py:23"),
        ("max_grad_norm", 1.0, "AWM base_awm.py (max_grad_norm 1.0)"),
        ("weight_decay", 1e-4, "AWM dgx_awm.py:340"),
    ],
    "awm-flux": [
        ("lr_scheduler_type", "constant", "FF src/flow_factory/trainers/abc.py:198-207 (an AdamW, no scheduler)"),
        ("optimizer_steps_per_rollout", 1, "FF examples/awm/lora/flux1/default.yaml L73-78"),
        ("mixed_precision", "bf16", "FF flux1/default.yaml L6"),
    ],
    "dgpo-sd35": [
        ("lr_scheduler_type", "constant", "DGPO config/base.py:68-81"),
        ("optimizer_steps_per_rollout", 1, "DGPO config/dgpo.py:152-159 (4 accumulated: one step an epoch)"),
        ("mixed_precision", "bf16", "DGPO config/base.py:21"),
    ],
})  # fmt: skip
PEER_TRAINING["jagg-fast-flux"] = PEER_TRAINING["mixgrpo-flux"]  # MixGRPO-Flash's training around its window
# LoRA (rank, alpha, target modules) exactly as the peer's scripts list them.
_FG_ATTENTION = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)  # fmt: skip
_SD35_LORA = (32, 64, _FG_ATTENTION)  # FG scripts/train_sd3.py:419-432
_FLUX_LORA = (64, 128, _FG_ATTENTION + ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"))
_QWEN_LORA = (
    64, 128, _FG_ATTENTION + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
)  # FG scripts/train_qwenimage.py:410-427  # fmt: skip
# Flow-Factory: lora_rank 64, lora_alpha 128 (examples/grpo/lora/*/default.yaml@a0b2bc5), its adapters'
# default_target_modules at a0b2bc5 (src/flow_factory/models/z_image/z_image.py:70-75; models/flux/flux2_klein.py:92-104
# and flux2.py:92-104, whose lists have attn.to_out.0 twice).
_ZIMAGE_LORA = (
    64, 128, ("attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
              "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"),
)  # fmt: skip
_FLUX2_KLEIN_LORA = (
    64, 128, _FG_ATTENTION + ("ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
                              "attn.to_qkv_mlp_proj"),
)  # fmt: skip
PUBLISHED_LORA = {
    "flow-grpo-sd35": _SD35_LORA,
    "flow-grpo-sd35-ocr": _SD35_LORA,
    "flow-grpo-sd35-geneval": _SD35_LORA,
    "flow-grpo-guard-sd35": _SD35_LORA,  # FG scripts/train_sd3_GRPO_Guard.py:421-436
    "flow-grpo-flux": _FLUX_LORA,  # FG scripts/train_flux.py:411-428
    "flow-grpo-qwenimage": _QWEN_LORA,
    "flow-grpo-qwenimage-all-steps": _QWEN_LORA,
    "flow-grpo-qwenimage-edit": _QWEN_LORA,  # FG scripts/train_qwenimage_edit.py:416-435
    "flow-grpo-fast-flux": _FLUX_LORA,  # FG scripts/train_flux_fast.py:416-433
    "flow-grpo-kontext": (64, 128, _FLUX_LORA[2] + ("proj_mlp",)),  # FG scripts/train_flux_kontext.py:411-430
    # FG scripts/train_wan2_1.py:451-466: its bare names but the add_* ones, absent from Wan's text-to-video blocks.
    "flow-grpo-wan2.1": (32, 64, ("to_q", "to_k", "to_v", "to_out.0")),
    "dancegrpo-flux": None,  # full fine-tuning
    "mixgrpo-flux": None,
    "jagg-fast-flux": None,
    "dancegrpo-flux-8gpu": None,
    "dancegrpo-wan2.1": None,  # full fine-tuning
    "dancegrpo-qwenimage-edit": None,
    "flow-factory-z-image": _ZIMAGE_LORA,
    "flow-factory-z-image-turbo": _ZIMAGE_LORA,
    "flow-factory-flux2-klein-base": _FLUX2_KLEIN_LORA,
    "flow-factory-flux2-klein": _FLUX2_KLEIN_LORA,
    "flow-factory-flux2-dev": _FLUX2_KLEIN_LORA,  # the same list
    # FF src/flow_factory/models/wan/wan2_t2v.py:74-85 (default_target_modules), on both experts (t2v.yaml L27).
    "flow-factory-wan2.2": (
        64, 128, ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                  "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"),
    ),
    # NFT scripts/train_nft_sd3.py:419-431: r 32, alpha 64, gaussian, the attn.* projections of both streams.
    **dict.fromkeys(DIFFUSION_NFT, _SD35_LORA),
    "awm-sd35": _SD35_LORA,  # AWM dgx_awm.py:366 (lora_type="attn"), train_sd3_awm.py:610-643: r 32, alpha 64
    "awm-flux": _FLUX_LORA,  # FF flux1/default.yaml L21-23, models/flux1.py:77-84: r 64, attention + feed-forward
    "dgpo-sd35": (64, 128, _FG_ATTENTION),  # DGPO train_sd3_dgpo.py:598-616: r 64, alpha 128, attention
}  # fmt: skip
MODELS = {
    "flow-grpo-sd35": "stabilityai/stable-diffusion-3.5-medium",
    "flow-grpo-sd35-ocr": "stabilityai/stable-diffusion-3.5-medium",
    "flow-grpo-sd35-geneval": "stabilityai/stable-diffusion-3.5-medium",  # FG config/grpo.py:131
    "flow-grpo-guard-sd35": "stabilityai/stable-diffusion-3.5-medium",
    "flow-grpo-flux": "black-forest-labs/FLUX.1-dev",
    "flow-grpo-qwenimage": "Qwen/Qwen-Image",
    "flow-grpo-qwenimage-all-steps": "Qwen/Qwen-Image",
    "flow-grpo-qwenimage-edit": "Qwen/Qwen-Image-Edit",  # FG config/grpo.py:788
    "flow-grpo-fast-flux": "black-forest-labs/FLUX.1-dev",
    "flow-grpo-kontext": "black-forest-labs/FLUX.1-Kontext-dev",
    "flow-grpo-wan2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    "dancegrpo-flux": "black-forest-labs/FLUX.1-dev",
    "mixgrpo-flux": "black-forest-labs/FLUX.1-dev",
    "jagg-fast-flux": "black-forest-labs/FLUX.1-dev",
    "dancegrpo-flux-8gpu": "black-forest-labs/FLUX.1-dev",
    "dancegrpo-wan2.1": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",  # DG finetune_wan_2_1_grpo.sh:19 (Wan2.1-T2V-1.3B)
    "dancegrpo-qwenimage-edit": "Qwen/Qwen-Image-Edit",  # DG finetune_qwenimage_edit_grpo.sh:20 (qwenimage_edit)
    "flow-factory-z-image": "Tongyi-MAI/Z-Image",
    "flow-factory-z-image-turbo": "Tongyi-MAI/Z-Image-Turbo",
    "flow-factory-flux2-klein-base": "black-forest-labs/FLUX.2-klein-base-9B",
    "flow-factory-flux2-klein": "black-forest-labs/FLUX.2-klein-9B",
    "flow-factory-flux2-dev": "black-forest-labs/FLUX.2-dev",
    "flow-factory-wan2.2": "Wan-AI/Wan2.2-T2V-A14B-Diffusers",  # t2v.yaml L34
    "nft-sd35": "stabilityai/stable-diffusion-3.5-medium",
    "nft-sd35-ocr": "stabilityai/stable-diffusion-3.5-medium",
    "nft-sd35-geneval": "stabilityai/stable-diffusion-3.5-medium",
    "awm-sd35": "stabilityai/stable-diffusion-3.5-medium",
    "awm-flux": "black-forest-labs/FLUX.1-dev",
    "dgpo-sd35": "stabilityai/stable-diffusion-3.5-medium",
}


def test_list_recipes():
    assert list_recipes() == NAMES


def test_every_preset_names_its_objective():
    from trl_jagg.objectives import OBJECTIVES

    for name in NAMES:
        recipe = get_recipe(name)
        assert recipe.objective == recipe.config.get("objective", "grpo") and recipe.objective in OBJECTIVES, name
    assert {get_recipe(n).objective for n in NAMES} == set(OBJECTIVES)  # every objective has a preset


@pytest.mark.parametrize("name", NAMES)
def test_preset_builds_a_valid_config(name, tmp_path):
    recipe = get_recipe(name)
    config = GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path))
    assert isinstance(config, GRPOJaggConfig) and config.output_dir == str(tmp_path)
    for key, value in {**recipe.config, **PUBLISHED[name], **PEER_CONVENTIONS[name]}.items():
        assert getattr(config, key) == value, key
    # The paper's JAGG settings; a window preset's W is its window (a W = 4 group never fits in 2 or 3 trained steps),
    # and the 4-step distilled klein trains 3 steps: W = 3.
    # DiffusionNFT's presets leave JAGG across timesteps off (an option; docs/benchmarks.md).
    assert config.use_jagg == (config.objective == "grpo") and config.jagg_frac == 0.6 and config.jagg_mode == "jagg"
    if config.train_timesteps == "sde_window":
        assert config.jagg_group_size == config.sde_window_size
    else:
        assert config.jagg_group_size == (3 if name == "flow-factory-flux2-klein" else 4)
    assert config.generation_batch_size % config.num_generations == 0
    assert recipe.model == MODELS[name]
    assert recipe.description and recipe.source and recipe.reward_funcs
    lora = recipe.lora_config()
    if PUBLISHED_LORA[name] is None:
        assert lora is None
    else:
        rank, alpha, targets = PUBLISHED_LORA[name]
        assert (lora.r, lora.lora_alpha, lora.init_lora_weights) == (rank, alpha, "gaussian")
        assert sorted(lora.target_modules) == sorted(targets)


@pytest.mark.parametrize(
    ("name", "key", "peer_value", "source"),
    [(name, *row) for name, rows in PEER_TRAINING.items() for row in rows],
    ids=lambda value: value if isinstance(value, str) and " " not in value else None,
)
def test_preset_trains_as_the_peer(name, key, peer_value, source, tmp_path):
    """One convention of the training around the formulas, against the peer's value at ``source``."""
    recipe = get_recipe(name)
    config = GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path))
    if key == "optimizer_steps_per_rollout":  # each sample used once: num_iterations = 1
        assert config.num_iterations == 1
        value = config.steps_per_generation // config.gradient_accumulation_steps
        assert config.steps_per_generation % config.gradient_accumulation_steps == 0
    elif key in ("mixed_precision", "reward_funcs"):
        value = getattr(recipe, key)
    else:
        value = getattr(config, key)
    assert value == peer_value, f"{name}.{key} = {value!r}; the peer's is {peer_value!r} ({source})"


def test_overrides_apply_and_are_validated(tmp_path):
    config = GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), max_steps=7, noise_level=0.5)
    assert (config.max_steps, config.noise_level, config.num_inference_steps) == (7, 0.5, 10)
    with pytest.raises(ValueError, match="num_generations"):
        GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), num_generations=1)
    with pytest.raises(TypeError, match="no field 'noise_levl'.*'noise_level'"):
        GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir=str(tmp_path), noise_levl=0.5)


def test_output_dir_is_required():
    with pytest.raises(ValueError, match="output_dir"):
        GRPOJaggConfig.from_recipe("flow-grpo-flux")


def test_unknown_recipe_lists_the_presets():
    with pytest.raises(ValueError, match="Did you mean 'flow-grpo-sd35'") as info:
        get_recipe("flow-grpo-sd3")
    for name in NAMES:
        assert name in str(info.value)


def test_recipes_are_read_only():
    with pytest.raises(TypeError):
        RECIPES["flow-grpo-sd35"].config["noise_level"] = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["flow-grpo-sd35"].model = "other"


# ---------------------------------------------------------------- YAML files for the CLI
def test_yaml_files_match_the_presets():
    """examples/recipes/*.yaml are generated (`python -m trl_jagg.recipes examples/recipes`): no drift."""
    assert sorted(f for f in os.listdir(YAML_DIR) if f.endswith(".yaml")) == sorted(f"{n}.yaml" for n in NAMES)
    for name in NAMES:
        with open(os.path.join(YAML_DIR, f"{name}.yaml")) as handle:
            assert handle.read() == get_recipe(name).to_yaml(), f"{name}.yaml is stale: regenerate it"


@pytest.mark.parametrize("name", NAMES)
def test_yaml_file_parses_to_the_preset_through_the_cli(name, tmp_path):
    from trl_jagg.scripts.train import parse_train_args

    path = os.path.join(YAML_DIR, f"{name}.yaml")
    script_args, config = parse_train_args(["--config", path, "--output_dir", str(tmp_path), "--prompts", "a cat"])
    expected = GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path))
    for item in dataclasses.fields(GRPOJaggConfig):
        if item.init:
            assert getattr(config, item.name) == getattr(expected, item.name), item.name
    recipe = get_recipe(name)
    assert script_args.recipe == name  # names the preset, so the CLI applies its scheduler override
    assert script_args.model_name_or_path == recipe.model
    assert script_args.reward_funcs == list(recipe.reward_funcs)
    assert script_args.use_peft == (recipe.lora is not None)
    if recipe.lora is not None:
        assert (script_args.lora_r, script_args.lora_alpha) == (recipe.lora["r"], recipe.lora["lora_alpha"])
        assert script_args.lora_target_modules == list(recipe.lora["target_modules"])


# ---------------------------------------------------------------- the presets train what they say
TINY = dict(
    height=32, width=32, per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=1,
    steps_per_generation=None, max_steps=1, dtype="float32", max_sequence_length=16, activation_checkpointing=False,
    offload_frozen_modules=False, report_to="none",
    save_strategy="no", disable_tqdm=True, seed=0,
)  # fmt: skip


def redness(prompts, images, **kwargs):
    return [float(np.asarray(im, dtype=np.float32)[..., 0].mean() / 255.0) for im in images]


def recipe_trainer(name: str, model, tmp_path, monkeypatch, **overrides) -> tuple[DDPOJaggTrainer, list]:
    """A trainer on the preset (tiny sizes), recording each update's trained steps and its rollout."""
    recipe = get_recipe(name)
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=model,
        reward_funcs=redness,
        args=GRPOJaggConfig.from_recipe(name, output_dir=str(tmp_path / "out"), **(TINY | overrides)),
        train_dataset=Dataset.from_dict(
            {"prompt": ["a red circle", "a green square", "a blue circle", "a red square"]}
        ),
        peft_config=recipe.lora_config(),
    )
    recorded = []
    trained_steps = update.trained_steps

    def spy(args, batch, **counters):
        steps = trained_steps(args, batch, **counters)
        recorded.append((steps, batch))
        return steps

    monkeypatch.setattr(update, "trained_steps", spy)
    return trainer, recorded


def test_fast_preset_trains_only_the_sde_window(tiny_flux_path, tmp_path, monkeypatch):
    trainer, recorded = recipe_trainer("flow-grpo-fast-flux", tiny_flux_path, tmp_path, monkeypatch)
    trainer.train()
    args = trainer.args
    assert recorded
    for steps, batch in recorded:
        window = batch.stochastic_steps
        assert steps == window and len(window) == args.sde_window_size == 3
        assert max(window) < args.num_inference_steps // 2  # the first half of the schedule
        stochastic = batch.log_probs.abs().sum(dim=0) != 0
        assert stochastic.tolist() == [k in window for k in range(args.num_inference_steps)]
    entry = next(e for e in trainer.state.log_history if "engine/jagg/backward_calls" in e)
    # The window is one JAGG group.
    assert entry["engine/jagg/groups_jagg"] == 1 and entry["engine/jagg/backward_calls"] == 1


def test_mix_preset_trains_its_sliding_window_on_a_compressed_ode_schedule(tiny_flux_path, tmp_path, monkeypatch):
    """MixGRPO-Flash on 10 steps, two optimizer steps a rollout, the window moving every rollout (as MixGRPO's
    update_iteration, once per train_one_step): the two updates of the first rollout train steps 0-3, those of the
    second steps 1-4, each as one JAGG group, the only stochastic steps of a rollout whose ODE after the window takes
    MixGRPO-Flash's int((10 - last) x 0.4) - 1 steps (1 after either window; 1 before the second: round(0.4))."""
    recipe = get_recipe("mixgrpo-flux")
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path))
    full_sigmas, _ = load_adapter(pipeline).schedule(10, 32, 32)
    trainer, recorded = recipe_trainer(
        "mixgrpo-flux", pipeline, tmp_path, monkeypatch, num_inference_steps=10, sde_window_max_start=None,
        sde_window_shift_interval=1, steps_per_generation=2, max_steps=4,
    )  # fmt: skip
    rollout_rows = []  # backbone rows in eval mode: the rollouts'
    trainer.adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: (
            None if module.training else rollout_rows.append(kwargs["hidden_states"].shape[0])
        ),
        with_kwargs=True,
    )
    trainer.train()
    # 8 rows (4 groups of G = 2) on 5 then 6 steps; the second window starts at step 1, whose ODE step runs once per
    # group: (G - 1) x 1 step x 4 groups = 4 rows fewer.
    assert sum(rollout_rows) == 8 * 5 + 8 * 6 - 4
    assert len(recorded) == 4
    paths = ([0, 1, 2, 3, 4, 10], [0, 1, 2, 3, 4, 5, 10])
    for update_index, ((steps, batch)) in enumerate(recorded):
        rollout = update_index // 2
        path, window = paths[rollout], batch.stochastic_steps
        assert steps == window and len(window) == 4
        torch.testing.assert_close(batch.sigmas, full_sigmas[path], atol=0, rtol=0)
        torch.testing.assert_close(batch.sigmas[window], full_sigmas[rollout : rollout + 4], atol=0, rtol=0)
        assert batch.latents.shape[1] == len(path)
        stochastic = batch.log_probs.abs().sum(dim=0) != 0
        assert stochastic.tolist() == [k in window for k in range(len(path) - 1)]
    for entry in (e for e in trainer.state.log_history if "engine/jagg/backward_calls" in e):
        # The window is one JAGG group.
        assert entry["engine/jagg/groups_jagg"] == 1 and entry["engine/jagg/backward_calls"] == 1


def test_mix_preset_window_resumes_at_its_rollout(tiny_flux_path, tmp_path, monkeypatch):
    """A run resumed after its first rollout (2 optimizer steps a rollout, a move every rollout) samples its second
    rollout with the second window, steps 1-4, as the uninterrupted run did: the rollout counter comes back from
    grpo_state.json with the checkpoint."""
    recipe = get_recipe("mixgrpo-flux")
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path))
    settings = dict(
        num_inference_steps=10, sde_window_max_start=None, sde_window_shift_interval=1, steps_per_generation=2,
        max_steps=4, save_strategy="steps", save_steps=2,
    )  # fmt: skip
    trainer, recorded = recipe_trainer("mixgrpo-flux", pipeline, tmp_path, monkeypatch, **settings)
    trainer.train()
    assert [steps for steps, _ in recorded] == [[0, 1, 2, 3]] * 2 + [[1, 2, 3, 4]] * 2
    resumed, resumed_recorded = recipe_trainer("mixgrpo-flux", pipeline, tmp_path, monkeypatch, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert [steps for steps, _ in resumed_recorded] == [[1, 2, 3, 4]] * 2


def test_fast_jagg_preset_trains_its_window_held_on_the_high_noise_steps(tiny_flux_path, tmp_path, monkeypatch):
    """jagg-fast-flux on 10 steps for 3 optimizer steps: every update trains steps 0-3 of the schedule as one JAGG
    group, on a rollout whose ODE after the window takes round(0.4 x 6) = 2 steps (MixGRPO's window slides with
    the rollouts; this one's schedule is "fixed", so a shift interval would be refused as a setting without effect)."""
    recipe = get_recipe("jagg-fast-flux")
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path))
    full_sigmas, _ = load_adapter(pipeline).schedule(10, 32, 32)
    trainer, recorded = recipe_trainer(
        "jagg-fast-flux", pipeline, tmp_path, monkeypatch, num_inference_steps=10, max_steps=3,
    )  # fmt: skip
    trainer.train()
    assert len(recorded) == 3
    for steps, batch in recorded:
        assert steps == batch.stochastic_steps == [0, 1, 2, 3]
        torch.testing.assert_close(batch.sigmas, full_sigmas[[0, 1, 2, 3, 4, 7, 10]], atol=0, rtol=0)
    for entry in (e for e in trainer.state.log_history if "engine/jagg/backward_calls" in e):
        # The window is one JAGG group.
        assert entry["engine/jagg/groups_jagg"] == 1 and entry["engine/jagg/backward_calls"] == 1


def test_dance_preset_trains_the_requested_fraction_never_the_last_step(tiny_flux_path, tmp_path, monkeypatch):
    recipe = get_recipe("dancegrpo-flux")
    pipeline = recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path))
    trainer, recorded = recipe_trainer(
        "dancegrpo-flux", pipeline, tmp_path, monkeypatch, gradient_accumulation_steps=2
    )
    assert trainer.peft_config is None  # full fine-tuning
    trainer.train()
    args = trainer.args
    # DanceGRPO trains int(len(timesteps) * timestep_fraction) of its samples' timesteps, which exclude the last:
    expected = int((args.num_inference_steps - 1) * 0.6)  # 9 of the first 15
    assert len(recorded) == 2  # one update per micro-batch
    for steps, _ in recorded:
        assert len(steps) == expected and steps == sorted(set(steps)) and set(steps) <= set(range(15))
    assert recorded[0][0] != recorded[1][0]  # a fresh random subset at every update
    entry = next(e for e in trainer.state.log_history if "engine/jagg/backward_calls" in e)
    # 9 steps in groups of 4, 4, 1: round(0.6 * 3) = 2 JAGG groups (1 backward each) and 1 exact step.
    assert entry["engine/jagg/groups_jagg"] == 2 and entry["engine/jagg/backward_calls"] == 3


def test_dance_scheduler_override_is_dancegrpo_shift_3(tiny_flux_path):
    recipe = get_recipe("dancegrpo-flux")
    pipeline = FluxPipeline.from_pretrained(tiny_flux_path)
    own, _ = load_adapter(pipeline).schedule(16, 720, 720)
    sigmas, timesteps = load_adapter(recipe.apply_scheduler(pipeline)).schedule(16, 720, 720)
    t = torch.linspace(1, 0, 17)
    torch.testing.assert_close(sigmas, 3 * t / (1 + 2 * t), atol=1e-6, rtol=0)  # DanceGRPO's sd3_time_shift
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, atol=1e-3, rtol=0)
    assert not torch.allclose(own, sigmas)  # Flux's own resolution-dependent shift differs


def test_dance_qwenimage_edit_scheduler_override_is_dancegrpo_shift_3(tiny_qwenimage_edit_path):
    # Qwen-Image's own schedule is dynamically shifted and stretched to end at 0.02 (shift_terminal): both go.
    recipe = get_recipe("dancegrpo-qwenimage-edit")
    pipeline = DiffusionPipeline.from_pretrained(tiny_qwenimage_edit_path)
    own, _ = load_adapter(pipeline).schedule(20, 512, 512)
    sigmas, timesteps = load_adapter(recipe.apply_scheduler(pipeline)).schedule(20, 512, 512)
    t = torch.linspace(1, 0, 21)
    # DanceGRPO's sd3_time_shift(3, linspace(1, 0, 21)) (fastvideo/train_grpo_qwenimage_edit.py:300-302)
    torch.testing.assert_close(sigmas, 3 * t / (1 + 2 * t), atol=1e-6, rtol=0)
    torch.testing.assert_close(timesteps, sigmas[:-1] * 1000, atol=1e-3, rtol=0)
    assert not torch.allclose(own, sigmas)


def test_dance_wan_steps_on_the_checkpoints_unipc_sigmas_near_dancegrpos(tiny_wan_path):
    """Wan2.1-T2V ships UniPC flow sigmas with flow_shift 3 (the tiny pipeline an Euler scheduler): the preset's
    schedule stays within 0.0025 of DanceGRPO's sd3_time_shift(3, linspace(1, 0, 21)), as its notes say."""
    pipeline = DiffusionPipeline.from_pretrained(tiny_wan_path)
    pipeline.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    recipe = get_recipe("dancegrpo-wan2.1")
    assert recipe.scheduler is None
    sigmas, _ = load_adapter(pipeline).schedule(recipe.config["num_inference_steps"], 512, 512)
    t = torch.linspace(1, 0, 21)
    torch.testing.assert_close(sigmas, 3 * t / (1 + 2 * t), atol=2.5e-3, rtol=0)


def test_recipes_import_nothing_of_trl_jagg():
    # The arrow points one way: the config reads the presets, the presets never import the config.
    import subprocess
    import sys

    code = "import sys, trl_jagg.recipes; print(sorted(m for m in sys.modules if m.startswith('trl_jagg.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # the presets (one module per peer) and their record class
    assert out.strip() == str(
        sorted(["trl_jagg.recipes.recipe", "trl_jagg.recipes", *(f"trl_jagg.recipes.{m}" for m in PEER_MODULES)])
    )


# ---------------------------------------------------------------- through the public trainer (issue 18)
@pytest.fixture(scope="module")
def tiny_dual_attention_sd3_path(tmp_path_factory) -> str:
    """A tiny SD3.5-M-like pipeline whose first block has SD3.5's second attention ``attn2``."""
    from trl_jagg.testing.tiny_models import save_tiny_pipeline

    path = tmp_path_factory.mktemp("tiny-sd3-attn2")
    return save_tiny_pipeline("sd3", path, seed=0, transformer={"dual_attention_layers": (0,)})


def _peer_value(name: str, key: str):
    return next(value for row_key, value, _ in PEER_TRAINING[name] if row_key == key)


def _peer_lora_parameters(transformer: torch.nn.Module, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters of rank ``rank`` on every linear layer a peer's target name selects: peft matches a name
    against the module's full name or a suffix after a dot (peft/tuners/tuners_utils.py check_target_module_exists)."""
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets)
    )


# Tiny sizes that keep the preset's split (gradient_accumulation_steps, steps_per_generation): micro-batches of one
# image, groups of 4 (which divide every preset's steps_per_generation).
PRESET_SPLIT_TINY = dict(
    height=32, width=32, per_device_train_batch_size=1, num_generations=4, max_sequence_length=16, dtype="float32",
    activation_checkpointing=False, offload_frozen_modules=False, report_to="none", save_strategy="no",
    disable_tqdm=True, seed=0,
)  # fmt: skip


# Every preset with its peer's training rows; of the six Flow-Factory presets (one shared split) the two cheapest
# (FLUX.2 dev's LoRA targets are klein's, and test_cli trains its preset on the tiny FLUX.2 dev; Wan2.2's targets
# and both experts train through `trl-jagg train` there too). flow-grpo-sd35-geneval is flow-grpo-sd35-ocr's split
# and LoRA (both change only beta and the reward of flow-grpo-sd35); examples/train_sd35_geneval.py trains it.
@pytest.mark.parametrize(
    "name",
    [
        n
        for n in PEER_TRAINING
        if n
        not in (
            "flow-grpo-sd35-geneval",
            "jagg-fast-flux",  # mixgrpo-flux's split; test_fast_jagg_preset_... trains its window
            "nft-sd35-geneval",  # nft-sd35's split and LoRA with another reward
            "flow-factory-z-image",
            "flow-factory-flux2-klein-base",
            "flow-factory-flux2-dev",
            "flow-factory-wan2.2",
            # AWM and DGPO train through train() in test_objectives.py, their presets in test_examples.py.
            "awm-sd35",
            "awm-flux",
            "dgpo-sd35",
        )
    ],
)
def test_preset_schedule_split_and_lora_through_the_trainer(name, request, tmp_path):
    """The logged learning rate stays constant, one rollout feeds the peer's number of optimizer steps (2 for
    Flow-GRPO and Flow-Factory, 3 for DanceGRPO's Flux, 1 for its Wan, 4 for MixGRPO), and the trained parameters are those of the peer's
    LoRA targets."""
    recipe = get_recipe(name)
    family = {
        "stabilityai": "sd3", "black-forest-labs": "flux", "Qwen": "qwenimage", "Tongyi-MAI": "zimage", "Wan-AI": "wan",
    }[recipe.model.split("/")[0]]  # fmt: skip
    family = "flux2_klein" if "FLUX.2-klein" in recipe.model else family
    family = "flux_kontext" if "Kontext" in recipe.model else family
    family += "_edit" if recipe.model == "Qwen/Qwen-Image-Edit" else ""
    path = request.getfixturevalue("tiny_dual_attention_sd3_path" if family == "sd3" else f"tiny_{family}_path")
    pipeline = recipe.apply_scheduler(DiffusionPipeline.from_pretrained(path))
    steps_per_rollout = _peer_value(name, "optimizer_steps_per_rollout")
    scored = []

    def reward(prompts, images, **kwargs):
        scored.extend(images)
        return redness(prompts, images)

    columns = {"prompt": ["a red circle", "a green square", "a blue circle", "a red square", "a cat", "a dog", "a"]}
    if family in ("flux_kontext", "qwenimage_edit"):  # an editing model: each instruction with the image it edits
        columns["source_image"] = [noise_image(seed, size=32) for seed in range(len(columns["prompt"]))]
    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=pipeline,
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(
            name,
            output_dir=str(tmp_path),
            **{
                **PRESET_SPLIT_TINY,
                "num_inference_steps": 8 if name == "dancegrpo-flux" else 5,
                "max_steps": steps_per_rollout,
                # The window slides past the 5 tiny steps otherwise (its last start, 19, is for 25).
                **({"sde_window_max_start": 1} if name == "mixgrpo-flux" else {}),
                # Qwen-Image-Edit encodes the source image at 32 x 32 px here, not the pipeline's 1024 x 1024.
                **({"source_image_area": 32 * 32} if family == "qwenimage_edit" else {}),
                "reward_weights": None,  # one reward here
                # Kontext's 14 micro-batches a rollout: groups of 2, so that they hold whole groups.
                **({"num_generations": 2} if family == "flux_kontext" else {}),
                # 2 latent frames, not the preset's 9; micro-batches of 2 so that its 2 make a group of 4 (DanceGRPO's
                # Wan samples its own single frame, 24 micro-batches of one).
                **({"num_frames": 5, "per_device_train_batch_size": 2} if name == "flow-grpo-wan2.1" else {}),
            },
        ),  # fmt: skip
        train_dataset=Dataset.from_dict(columns),
        peft_config=recipe.lora_config(),
    )
    trainer.train()
    args = trainer.args
    assert trainer.state.global_step == steps_per_rollout
    # One rollout fed all of them, each image used once (a video's frames are scored one by one).
    assert len(scored) == args.generation_batch_size * (args.num_frames or 1)
    rates = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    assert rates == [recipe.config["learning_rate"]] * steps_per_rollout  # constant, no warm-up

    transformer = trainer.adapter.transformer
    trainable = {n: p.numel() for n, p in transformer.named_parameters() if p.requires_grad}
    fresh = DiffusionPipeline.from_pretrained(path).transformer
    if PUBLISHED_LORA[name] is None:
        assert sum(trainable.values()) == sum(p.numel() for p in fresh.parameters())  # full fine-tuning
        return
    rank, _, targets = PUBLISHED_LORA[name]
    assert sum(trainable.values()) == _peer_lora_parameters(fresh, rank, targets)
    if family == "sd3":  # SD3.5's second attention is left alone; bare names would adapt it too
        assert any(".attn2." in n for n, _ in fresh.named_modules())
        assert not any(".attn2." in n for n in trainable)
    if family in ("flux", "flux_kontext"):
        assert any(".ff_context." in n for n in trainable) and any(".ff.net." in n for n in trainable)
    if family == "flux_kontext":  # the single blocks' MLP too
        assert any("single_transformer_blocks." in n and ".proj_mlp." in n for n in trainable)
    if family.startswith("qwenimage"):
        assert any(".img_mlp." in n for n in trainable) and any(".txt_mlp." in n for n in trainable)
    if family == "wan":  # Flow-GRPO's bare names adapt the self- and the cross-attention of every block
        assert any(".attn1." in n for n in trainable) and any(".attn2." in n for n in trainable)


# One optimizer step of plain SGD (no clipping, no decay, no KL) on one trained step: step 0, the SDE window.
GUARD_PROBE = dict(
    per_device_train_batch_size=4, num_generations=4, num_inference_steps=5, train_timesteps="sde_window",
    sde_window_size=1, sde_window_max_start=0, use_jagg=False, optim="sgd", learning_rate=1.0, weight_decay=0.0,
    max_grad_norm=0.0, beta=0.0, drop_zero_advantages=False,
)  # fmt: skip


def test_guard_options_scale_the_on_policy_gradient_as_the_peer(tiny_sd3_path, tmp_path):
    """Through the trainer, on-policy (the first optimizer step), at one trained step k: GRPO-Guard's normalised
    ratio exp(s (log p - log p_old) + |mu - mu_old|^2 / (2 s)) has gradient s d(log p), s the step's std, and the
    reweighting divides by |dt_k|. So with plain SGD the update is s times the plain one, and s / |dt_k| times with
    both options (Flow-GRPO's s = std_dev_t sqrt(-dt), std_dev_t = a sqrt(sigma / (1 - sigma)) with sigma_max for
    sigma = 1: flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:50)."""

    def update(**options) -> tuple[torch.Tensor, DDPOJaggTrainer]:
        torch.manual_seed(0)
        trainer = DDPOJaggTrainer(
            model=tiny_sd3_path,
            reward_funcs=redness,
            args=GRPOJaggConfig.from_recipe(
                "flow-grpo-sd35", output_dir=str(tmp_path), **(TINY | GUARD_PROBE | options)
            ),
            train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square"]}),
            peft_config=get_recipe("flow-grpo-sd35").lora_config(),
        )
        params = [p for p in trainer.adapter.transformer.parameters() if p.requires_grad]
        before = torch.cat([p.detach().flatten().clone() for p in params])
        trainer.train()
        return torch.cat([p.detach().flatten() for p in params]) - before, trainer

    plain, trainer = update()
    normalised, _ = update(ratio_normalization=True)
    guard, _ = update(ratio_normalization=True, step_gradient_reweighting=True)
    sigmas, _ = trainer.adapter.schedule(5, 32, 32)
    sigma, sigma_next, sigma_max = sigmas[0].item(), sigmas[1].item(), sigmas[1].item()  # the window is step 0
    std_dev_t = 0.7 * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    s = std_dev_t * math.sqrt(sigma - sigma_next)
    assert plain.abs().max() > 0
    torch.testing.assert_close(normalised, s * plain, rtol=1e-3, atol=1e-6 * plain.abs().max().item())
    torch.testing.assert_close(
        guard, s / (sigma - sigma_next) * plain, rtol=1e-3, atol=1e-6 * plain.abs().max().item()
    )


def test_dance_preset_rewards_score_the_last_steps_predicted_x0(tiny_flux_path, tmp_path):
    """DanceGRPO's reward decodes the last step's pred_original_sample = z - sigma v (fastvideo/train_grpo_flux.py:145,
    254, 379-382 at XueZeyue/DanceGRPO@15cc71d), not the final latent, which still carries that step's noise."""
    recipe = get_recipe("dancegrpo-flux")
    received, rollouts = [], []

    def reward(prompts, images, **kwargs):
        received.extend(np.asarray(image, dtype=np.float32) for image in images)
        return redness(prompts, images)

    torch.manual_seed(0)
    trainer = DDPOJaggTrainer(
        model=recipe.apply_scheduler(FluxPipeline.from_pretrained(tiny_flux_path)),
        reward_funcs=reward,
        args=GRPOJaggConfig.from_recipe(recipe.name, output_dir=str(tmp_path), **(TINY | {"num_inference_steps": 4})),
        train_dataset=Dataset.from_dict({"prompt": ["a red circle", "a green square"]}),
    )
    generate = trainer.generation.generate

    def spy(*args, **kwargs):
        rollouts.append(generate(*args, **kwargs))
        return rollouts[-1]

    trainer.generation.generate = spy
    trainer.train()
    (rollout,) = rollouts
    sigmas, latents, velocities = rollout.sigmas, rollout.latents, rollout.velocities  # the JAGG cache
    x0_hat = latents[:, -2] - sigmas[-2] * velocities[:, -1].float()  # the last step starts at z_{N-1}, sigma_{N-1}
    adapter = trainer.adapter

    def decoded(batch):
        return [np.asarray(image, dtype=np.float32) for image in adapter.decode(batch, 32, 32)]

    assert len(received) == len(x0_hat) == 4
    for got, want, final in zip(received, decoded(x0_hat), decoded(latents[:, -1])):
        np.testing.assert_allclose(got, want, atol=1.0)  # uint8 images: one level for float rounding
        assert np.abs(got - final).max() > 1.0  # the final latent decodes to another image


def test_jagg_fast_flux_is_deprecated_for_mixgrpo_flux(tmp_path):
    """Issue 37: at its own beta = 0 and MixGRPO's cadence, the held window did not beat MixGRPO's slide; the preset
    warns and names the replacement, and only it is deprecated."""
    with pytest.warns(FutureWarning, match="'jagg-fast-flux' is deprecated.*'mixgrpo-flux'"):
        GRPOJaggConfig.from_recipe("jagg-fast-flux", output_dir=str(tmp_path))
    assert [name for name in NAMES if get_recipe(name).deprecated] == ["jagg-fast-flux"]
