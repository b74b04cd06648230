"""Presets: the public Flow-GRPO(-Fast), DanceGRPO, MixGRPO and Flow-Factory recipes as named GRPOJaggConfig values.

.. code-block:: python

    from trl_jagg import DDPOJaggTrainer, GRPOJaggConfig
    from trl_jagg.recipes import get_recipe

    args = GRPOJaggConfig.from_recipe("flow-grpo-sd35", output_dir="runs/sd35", max_steps=500)
    recipe = get_recipe("flow-grpo-sd35")
    trainer = DDPOJaggTrainer(
        recipe.model, reward_funcs=list(recipe.reward_funcs), args=args, train_dataset=dataset,
        peft_config=recipe.lora_config(),
    )

This module holds data only and imports nothing of trl_jagg: the config reads it
(:meth:`GRPOJaggConfig.from_recipe <trl_jagg.GRPOJaggConfig.from_recipe>`), never the other way round.

A :class:`Recipe` holds the base model's Hub id, the :class:`~trl_jagg.GRPOJaggConfig` values, the LoRA settings
(``None`` for full fine-tuning), a scheduler override where the recipe changes the model's schedule (DanceGRPO's
fixed shift 3), the reward it was published with, and where the numbers come from. Every preset uses the JAGG
settings of the paper: groups of ``W = 4`` trained steps, the high-noise 60% of the groups routed to JAGG, except
where fewer steps are trained (Flow-GRPO-Fast trains 3, so its ``W`` is 3; Flow-GRPO's Qwen-Image 2, so ``W = 2``:
a group longer than the trained steps would always run exact).

The CLI's YAML files are generated from these presets, never edited by hand; they ship in the package
(``trl_jagg/configs/recipes/<name>.yaml``, :func:`trl_jagg.configs.config_dir`), which a checkout links as
``examples/recipes/``::

    python -m trl_jagg.recipes examples/recipes
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from .recipe import Recipe
from .recipe_parts import (
    _FLOW_GRPO_ADVANTAGES,
    _FLOW_GRPO_ATTENTION,
    _FLOW_GRPO_EMA,
    _FLOW_GRPO_LOSS,
    _FLOW_GRPO_OPTIM,
    _FLUX_FEED_FORWARD,
    _QWENIMAGE_FEED_FORWARD,
    ATTENTION_PROJECTIONS,
    PAPER_JAGG,
    _lora,
    _two_updates_per_rollout,
)

__all__ = [
    "ATTENTION_PROJECTIONS",
    "PAPER_JAGG",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "write_recipe_yamls",
]

_SD35 = Recipe(
    name="flow-grpo-sd35",
    model="stabilityai/stable-diffusion-3.5-medium",
    description="Flow-GRPO on SD3.5-Medium with PickScore: LoRA, CFG 4.5, SDE a = 0.7, all steps but the last trained.",
    source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): config/grpo.py pickscore_sd3 and scripts/train_sd3.py "
    "at zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    config={
        "height": 512,
        "width": 512,
        "num_inference_steps": 10,
        "guidance_scale": 4.5,  # SD3's classifier-free guidance (negative prompt "")
        "sampler": "sde",
        "noise_level": 0.7,
        "num_generations": 24,
        # Flow-GRPO samples 9 images a batch; here 6, so that a rollout is one whole group of 24 per process.
        **_two_updates_per_rollout(per_device=6, images_per_process=24),
        "train_timesteps": "all_but_last",
        "beta": 0.01,  # pickscore_sd3; the OCR and GenEval configs use 0.04 (flow-grpo-sd35-ocr)
        **_FLOW_GRPO_LOSS,
        **_FLOW_GRPO_ADVANTAGES,
        "scale_rewards": "batch",  # config/grpo.py: sample.global_std = True
        "drop_zero_advantages": True,  # scripts/train_sd3.py masks zero-advantage samples
        "max_sequence_length": 128,
        "eval_num_inference_steps": 40,
        **_FLOW_GRPO_EMA,
        **_FLOW_GRPO_OPTIM,
        **PAPER_JAGG,
        "dtype": "float32",  # with fp16=True: float32 weights, fp16 autocast (Flow-GRPO's mixed_precision="fp16")
    },
    lora=_lora(32, _FLOW_GRPO_ATTENTION),
    reward_funcs=("pickscore",),
    mixed_precision="fp16",
    notes=(
        "Both CFG branches get gradients, as Flow-GRPO's train_sd3.py before 2025-07-15 (2d76907) and again since "
        "2025-08-19 (a482878); in between it detached the unconditional prediction: cfg_gradient='conditional' "
        "reproduces that and halves the update's backward (its gradient is larger, about the CFG scale times when "
        "the branches' Jacobians are alike: mind max_grad_norm).",
        "Two optimizer steps per rollout, each image used once, as Flow-GRPO (gradient_accumulation_steps = "
        "num_batches_per_epoch // 2). Every process samples one whole group of G = 24; Flow-GRPO samples 48 "
        "prompts per epoch on 32 GPUs.",
        "On GPUs add fp16=True: Flow-GRPO's precision (the pipeline in float32, the backbone's forward under fp16 "
        "autocast). The float32 transformer takes 2x the memory of a bf16 one (about 10 GB for SD3.5-M).",
    ),
)

_FLUX = Recipe(
    name="flow-grpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    description="Flow-GRPO on FLUX.1-dev: LoRA on attention and feed-forward, embedded guidance 3.5, SDE a = 0.9, "
    "6 steps.",
    source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): config/grpo.py pickscore_flux and scripts/train_flux.py "
    "at zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    config={
        "height": 512,
        "width": 512,
        "num_inference_steps": 6,
        "guidance_scale": 3.5,  # Flux.1-dev's embedded (distilled) guidance, no negative branch
        "sampler": "sde",
        "noise_level": 0.9,
        "num_generations": 24,
        **_two_updates_per_rollout(per_device=3, images_per_process=24),  # Flow-GRPO's 3 images a batch
        "train_timesteps": "all_but_last",
        "beta": 0.0,
        **_FLOW_GRPO_LOSS,
        **_FLOW_GRPO_ADVANTAGES,
        "scale_rewards": "batch",
        "max_sequence_length": 128,
        "eval_num_inference_steps": 28,
        **_FLOW_GRPO_EMA,
        **_FLOW_GRPO_OPTIM,
        **PAPER_JAGG,
        "dtype": "float32",  # with bf16=True: Flow-GRPO's float32 weights and bf16 autocast
        "offload_frozen_modules": True,  # the float32 T5 (19 GB) stays on the CPU outside prompt encoding
    },
    lora=_lora(64, _FLOW_GRPO_ATTENTION + _FLUX_FEED_FORWARD),
    reward_funcs=("pickscore",),
    mixed_precision="bf16",
    notes=(
        "6 steps train 5: one JAGG group of W = 4, the remaining step exact.",
        "Two optimizer steps per rollout, each image used once, as Flow-GRPO.",
        "On GPUs add bf16=True: Flow-GRPO's precision. The float32 transformer takes 48 GB (24 GB in bf16), as in "
        "Flow-GRPO; dtype='bfloat16' halves it (the matmuls round the weights to bf16 under autocast either way).",
    ),
)

_FAST_FLUX = Recipe(
    name="flow-grpo-fast-flux",
    model="black-forest-labs/FLUX.1-dev",
    description="Flow-GRPO-Fast on FLUX.1-dev: SDE only in a 3-step window in the first half, ODE elsewhere; only "
    "the window is trained.",
    source="Flow-GRPO-Fast: config/grpo.py pickscore_flux_fast and scripts/train_flux_fast.py at "
    "zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    config={
        **_FLUX.config,
        "sampler": "cps",
        "noise_level": 0.8,
        "clip_range": 1e-5,  # CPS log-probs have no 1/std^2: a smaller clip range
        "train_timesteps": "sde_window",
        "sde_window_size": 3,
        "sde_window_max_start": 0,  # the window lies in the first half: steps 0-2 of 6
        "scale_rewards": "group",  # pickscore_flux_fast: sample.global_std = False
        "jagg_group_size": 3,  # the whole window is one group: W = 4 would never fit in 3 steps
    },
    lora=_FLUX.lora,  # train_flux_fast.py adapts the same modules as train_flux.py
    reward_funcs=("pickscore",),
    mixed_precision="bf16",
    notes=(
        "jagg_group_size is 3, not the paper's 4: only the 3 window steps are trained and a group must fill W "
        "steps, so with W = 4 JAGG would silently never run.",
        "CPS sampler with a = 0.8 and clip range 1e-5 as in Flow-GRPO-Fast's FLUX config. For a longer schedule, "
        "raise num_inference_steps and sde_window_max_start (<= steps // 2 - window) together.",
        _FLUX.notes[-1],
    ),
)

_QWENIMAGE = Recipe(
    name="flow-grpo-qwenimage",
    model="Qwen/Qwen-Image",
    description="Flow-GRPO on Qwen-Image: LoRA on attention and MLPs, true CFG 4 with norm rescaling, SDE a = 1.2 "
    "in a 2-step window, FSDP.",
    source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): config/grpo.py pickscore_qwenimage and "
    "scripts/train_qwenimage.py at zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    config={
        "height": 512,
        "width": 512,
        "num_inference_steps": 10,
        "true_cfg_scale": 4.0,  # two backbone calls per step, rescaled to the conditional norm
        "negative_prompt": " ",  # Qwen-Image's and Flow-GRPO's empty negative prompt
        "sampler": "sde",
        "noise_level": 1.2,
        "num_generations": 16,
        **_two_updates_per_rollout(per_device=4, images_per_process=16),  # Flow-GRPO's 4 images a batch
        # SDE in a 2-step window drawn in steps 0-4 (sde_window_range = (0, num_steps // 2)), ODE elsewhere.
        "train_timesteps": "sde_window",
        "sde_window_size": 2,
        "sde_window_max_start": 3,
        "beta": 0.0,
        **_FLOW_GRPO_LOSS,
        **_FLOW_GRPO_ADVANTAGES,
        "scale_rewards": "batch",
        "max_sequence_length": 512,  # QwenImagePipeline's default, which Flow-GRPO keeps
        "eval_num_inference_steps": 50,
        **_FLOW_GRPO_OPTIM,
        **PAPER_JAGG,
        "jagg_group_size": 2,  # W <= the 2 trained steps: the window is one group, exact by construction
        "dtype": "float32",  # with bf16=True: Flow-GRPO's float32 FSDP shards and bf16 compute
        "offload_frozen_modules": True,  # the float32 Qwen2.5-VL encoder (33 GB) stays on the CPU
        "activation_checkpointing": True,
    },
    lora=_lora(64, _FLOW_GRPO_ATTENTION + _QWENIMAGE_FEED_FORWARD),
    reward_funcs=("pickscore",),
    mixed_precision="bf16",
    notes=(
        "FSDP: launch with `accelerate launch --config_file <fsdp.yaml>` (FULL_SHARD, wrapping "
        "QwenImageTransformerBlock; Flow-GRPO also offloads the optimizer state).",
        "The 2-step SDE window is Flow-GRPO's (sde_window_size=2, range (0, 5)); its pipeline reseeds Python's "
        "random with process_index=0 (which train_qwenimage.py never passes) before drawing the start, so in practice "
        "it always trains steps 3-4. The preset draws the start in 0-3 each rollout, as the config intends.",
        "JAGG needs W <= the trained steps: with 2 trained steps W = 2, where JAGG is exact (both Jacobians are "
        "kept) and saves only the second backward call (one joint backward, parameters gathered once under FSDP). "
        "flow-grpo-qwenimage-all-steps trains every step but the last with W = 4 (the preset before issue 18).",
        "On GPUs add bf16=True: Flow-GRPO's precision. The float32 transformer is 82 GB (41 GB in bf16) before "
        "FSDP sharding.",
    ),
)

_WAN21 = Recipe(
    name="flow-grpo-wan2.1",
    model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    description="Flow-GRPO on Wan2.1-T2V-1.3B: 33-frame 240x416 videos, LoRA r 32, CFG 4.5, 20 steps, OCR per frame.",
    source="Flow-GRPO: config/grpo.py:29-79 (general_ocr_wan2_1) and scripts/train_wan2_1.py:444-478 at "
    "zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    config={
        **{"height": 240, "width": 416, "num_frames": 33, "num_inference_steps": 20, "guidance_scale": 4.5},  # L35-42
        **{"negative_prompt": "", "sampler": "sde", "noise_level": 0.5},  # [""] negatives; a: see the notes
        "num_generations": 4,  # num_image_per_prompt (L44)
        # train_batch_size 8, num_batches_per_epoch 2, GA = 2 // 2 = 1 (L43-49): two optimizer steps per rollout.
        **{"per_device_train_batch_size": 8, "steps_per_generation": 2, "gradient_accumulation_steps": 1},
        "train_timesteps": "all_but_last",  # timestep_fraction 0.99: int(20 * 0.99) = 19 of 20 (L51)
        **{"beta": 0.004, "clip_range": 1e-3, "adv_clip_max": 5.0, **_FLOW_GRPO_ADVANTAGES},  # L53, L55; base.py:97
        "scale_rewards": "group",  # global_std = False (L62)
        "drop_zero_advantages": True,  # train_wan2_1.py masks zero-advantage samples, as train_sd3.py
        "max_sequence_length": 512,  # compute_text_embeddings(..., max_sequence_length=512)
        "eval_num_inference_steps": 50,  # L36
        **_FLOW_GRPO_EMA,  # ema = True (L63); EMAModuleWrapper(decay=0.9, update_step_interval=8) (train:478)
        **{**_FLOW_GRPO_OPTIM, "learning_rate": 1e-4},  # L54
        **PAPER_JAGG,
        "dtype": "float32",  # the LoRA transformer kept in float32 under bf16 autocast (train_wan2_1.py:444)
    },
    lora=_lora(32, ATTENTION_PROJECTIONS[:4]),  # r 32, alpha 64 on train_wan2_1.py:451-466's names in T2V blocks
    reward_funcs=("ocr",),  # video_ocr (L71-73)
    mixed_precision="bf16",  # L64
    notes=(
        "Flow-GRPO's Wan SDE (wan_pipeline_with_logprob.py:51) has std_dev_t = sigma_min + (sigma_max - sigma_min) "
        "sigma, not the noise level a of its SD3 SDE; sampler 'sde' with a = 0.5 matches it at sigma = 0.5.",
        "The ocr reward scores every frame and a video gets the mean; Flow-GRPO's video OCR (flow_grpo/ocr.py:92-119) "
        "reads every 4th frame and averages the frames with a positive score.",
        "The steps run on the checkpoint's UniPC flow sigmas (shift 3), as Flow-GRPO's Wan sampler. Its LoRA list "
        "also names add_k/q/v_proj and to_add_out, absent from text-to-video blocks (peft skips them; trl_jagg refuses "
        "targets that match nothing).",
    ),
)

_DANCE = Recipe(
    name="dancegrpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    description="DanceGRPO on FLUX.1-dev: full fine-tuning, constant-eta SDE (eta 0.3), 720 px, 16 steps with "
    "shift 3, a random 60% of the first 15 steps trained per sample.",
    source="DanceGRPO (Xue et al. 2025, arXiv 2505.07818): fastvideo/train_grpo_flux.py and "
    "scripts/finetune/finetune_flux_grpo.sh at XueZeyue/DanceGRPO@15cc71d; JAGG spec section 5.",
    config={
        "height": 720,
        "width": 720,
        "num_inference_steps": 16,
        "guidance_scale": 3.5,
        "sampler": "dance",
        "noise_level": 0.3,  # eta
        "num_generations": 12,
        # 12 samples per process (--train_batch_size 1 x --num_generations 12), trained one at a time, an optimizer
        # step every --gradient_accumulation_steps 4: three per rollout, each sample used once.
        "per_device_train_batch_size": 1,
        "steps_per_generation": 12,
        "gradient_accumulation_steps": 4,
        "train_timesteps": "random_but_last",  # its samples drop the last step
        "train_timestep_fraction": 0.6,
        "beta": 0.0,
        "clip_range": 1e-4,
        "adv_clip_max": 5.0,
        # Per-group torch std (unbiased) + 1e-8, the model fed int(sigma * 1000) / 1000, one initial noise per
        # group, prompts at FluxPipeline's 512 tokens (fastvideo/train_grpo_flux.py).
        "scale_rewards": "group",
        "advantage_std_ddof": 1,
        "advantage_eps": 1e-8,
        "quantize_timesteps": True,
        "same_group_noise": True,
        "reward_on_predicted_x0": True,  # its reward decodes the last step's pred_original_sample
        "max_sequence_length": 512,
        "learning_rate": 1e-5,
        "lr_scheduler_type": "constant_with_warmup",  # its --lr_scheduler default, with --lr_warmup_steps 0
        "warmup_steps": 0,
        "weight_decay": 1e-4,
        "max_grad_norm": 1.0,
        **PAPER_JAGG,
        "dtype": "float32",  # full fine-tuning keeps float32 master weights, as DanceGRPO
        "activation_checkpointing": True,
    },
    scheduler={"shift": 3.0, "use_dynamic_shifting": False},
    reward_funcs=("hpsv2.1",),
    mixed_precision="bf16",
    notes=(
        "Shift 3 is a scheduler override (a static time shift sigma' = 3 sigma / (1 + 2 sigma) instead of "
        "Flux's resolution-dependent one). The CLI applies it for `--recipe dancegrpo-flux`; in Python, "
        "pass get_recipe('dancegrpo-flux').apply_scheduler(pipeline) to DDPOJaggTrainer.",
        "Micro-batches of one sample, as DanceGRPO: the random trained steps are drawn per micro-batch, so per "
        "sample as in DanceGRPO.",
        "Full fine-tuning of a 12B backbone needs FSDP (optimizer state sharded) and bf16=True on GPUs "
        "(DanceGRPO's --mixed_precision bf16 over float32 weights).",
        "EMA is off as in finetune_flux_grpo.sh; dancegrpo-flux-8gpu follows the 8-GPU script (EMA 0.995 once "
        "per rollout, on the CPU, max_grad_norm 0.01).",
    ),
)
# Flow-Factory's default LoRA targets, as its adapters list them (default_target_modules in
# src/flow_factory/models/z_image/z_image.py@5405453 and src/flow_factory/models/flux/flux2_klein.py@1e4264b, which
# names attn.to_out.0 twice): attention and feed-forward of every block.
_ZIMAGE_LORA_TARGETS = (
    "attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)  # fmt: skip
_FLUX2_KLEIN_LORA_TARGETS = (
    *_FLOW_GRPO_ATTENTION, "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)  # fmt: skip


def _flow_factory(
    name: str,
    model: str,
    folder: str,
    description: str,
    settings: Mapping[str, Any],
    lora_targets: Sequence[str],
    *,
    sde_steps: str,
) -> Recipe:
    """A Flow-Factory GRPO LoRA preset (``examples/grpo/lora/<folder>/default.yaml`` at a0b2bc5). The settings its
    configs share are here, with their lines in the Z-Image files (the FLUX.2 klein files hold the same keys at
    L43-73); ``settings`` holds the model's own."""
    steps = settings["num_inference_steps"]
    width = settings.get("jagg_group_size", PAPER_JAGG["jagg_group_size"])
    return Recipe(
        name=name,
        model=model,
        description=description,
        source=f"Flow-Factory (X-GenGroup/Flow-Factory@a0b2bc5) examples/grpo/lora/{folder}/default.yaml; JAGG as in "
        "the paper.",
        config={
            "sampler": "sde",  # dynamics_type Flow-SDE
            "num_generations": 16,  # group_size (L58)
            # 48 prompts x 16 per rollout over 8 processes (unique_sample_num_per_epoch, L60) = 96 samples a
            # process, 2 optimizer steps a rollout (gradient_step_per_epoch, L61; src/flow_factory/hparams/
            # training_args.py L293-300, L336); micro-batches of 4 where Flow-Factory backpropagates 1 at a time.
            "per_device_train_batch_size": 4,
            "steps_per_generation": 24,
            "gradient_accumulation_steps": 12,
            "lr_scheduler_type": "constant",  # one AdamW, no scheduler (src/flow_factory/trainers/abc.py L198-207)
            "train_timesteps": "all_but_last",
            "beta": 0.0,  # kl_beta (L48)
            "clip_range": 1e-4,  # L44
            "adv_clip_max": 5.0,  # adv_clip_range (L45)
            "scale_rewards": "group",  # global_std: false (L59)
            "max_sequence_length": 512,  # the pipelines' default, which Flow-Factory keeps
            "ema_decay": 0.9,  # L73
            "ema_update_interval": 4,  # L74
            "learning_rate": 3e-4,  # L66
            "weight_decay": 1e-4,
            "max_grad_norm": 1.0,
            **PAPER_JAGG,
            "dtype": "bfloat16",
            **settings,
        },
        lora=_lora(64, tuple(lora_targets)),  # lora_rank 64, lora_alpha 128
        reward_funcs=("pickscore",),  # rewards: pick_score
        mixed_precision="bf16",
        notes=(
            f"Flow-Factory trains one SDE step per rollout, drawn from {sde_steps} (num_sde_steps: 1), which leaves "
            f"JAGG nothing to group; the preset trains all steps but the last ({steps - 1} of {steps}, JAGG groups "
            f"of W = {width}) instead.",
            "Flow-Factory aggregates several rewards with GDPO (advantage_aggregation); with the one reward of this "
            "preset that is the per-group normalisation of scale_rewards='group'.",
            "LoRA r 64 / alpha 128 on Flow-Factory's default targets (lora_rank, lora_alpha, target_modules: "
            "default).",
        ),
    )


RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        recipe.name: recipe
        for recipe in (
            _SD35,
            _SD35.variant(
                "flow-grpo-sd35-ocr",
                "Flow-GRPO on SD3.5-Medium with the OCR reward: flow-grpo-sd35 with beta 0.04.",
                {"beta": 0.04},  # general_ocr_sd3 (and geneval_sd3)
                reward_funcs=("ocr",),
            ),
            _SD35.variant(
                "flow-grpo-guard-sd35",
                "GRPO-Guard on SD3.5-Medium with PickScore: flow-grpo-sd35 with the normalised ratio and 1/|dt| "
                "step reweighting, clip range 4e-6, lr 1e-4, no KL, per-prompt std.",
                {
                    "ratio_normalization": True,  # config.rationorm = True
                    "step_gradient_reweighting": True,  # the same switch divides each step's policy loss by |dt|
                    "clip_range": 4e-6,
                    "learning_rate": 1e-4,
                    "beta": 0.0,
                    "scale_rewards": "group",  # sample.global_std = False
                },
                source="GRPO-Guard (arXiv 2510.22319): config/grpo_guard.py pickscore_hps_sd3_ratio_norm and "
                "scripts/train_sd3_GRPO_Guard.py at zhtmike/flow_grpo@9745241.",
                notes=(
                    "Flow-GRPO's one switch `rationorm` turns on both the ratio normalisation and the per-step "
                    "reweighting; here they are two fields. Its `highclip_range` (also 4e-6) is unused by its "
                    "script, which clips both sides with clip_range.",
                    *_SD35.notes,
                ),
            ),
            _FLUX,
            _QWENIMAGE,
            _QWENIMAGE.variant(
                "flow-grpo-qwenimage-all-steps",
                "flow-grpo-qwenimage trained on every step but the last (SDE everywhere) with W = 4 JAGG groups.",
                {
                    "train_timesteps": "all_but_last",
                    "sde_window_size": 0,
                    "sde_window_max_start": None,
                    "jagg_group_size": 4,
                },  # fmt: skip
                notes=(
                    "Not Flow-GRPO's run (its Qwen-Image config trains a 2-step window): 9 trained steps in JAGG "
                    "groups of 4 + 4 + 1, for the update-stage saving the window cannot give.",
                    *_QWENIMAGE.notes[:1],
                    *_QWENIMAGE.notes[-1:],
                ),
            ),
            _QWENIMAGE.variant(
                "flow-grpo-qwenimage-edit",
                "Flow-GRPO on Qwen-Image-Edit (counting edits, GenEval): flow-grpo-qwenimage with SDE a = 1.0 on "
                "every step but the last, JAGG W = 4.",
                {
                    "noise_level": 1.0,  # config/grpo.py:807
                    # sde_window_size = 0 (config/grpo.py:808): steps 0-8 of 10 (train_qwenimage_edit.py:367)
                    "train_timesteps": "all_but_last",
                    "sde_window_size": 0,
                    "sde_window_max_start": None,
                    "jagg_group_size": 4,
                    "max_sequence_length": None,  # QwenImageEditPipeline.encode_prompt does not truncate
                },
                model="Qwen/Qwen-Image-Edit",
                source="Flow-GRPO: config/grpo.py:782-822 counting_qwenimage_edit, scripts/train_qwenimage_edit.py "
                "and flow_grpo/diffusers_patch/qwenimage_edit_pipeline_with_logprob.py at zhtmike/flow_grpo@9745241.",
                reward_funcs=("geneval",),
                notes=(
                    "Datasets carry a `source_image` column (Flow-GRPO's dataset/counting_edit), resized by Flow-GRPO "
                    "to 512 x 512 (train_qwenimage_edit.py:614), then by its pipeline to 1024 x 1024 for the VAE: "
                    "source_image_area stays None (1024^2), 4096 reference tokens. Give them one aspect ratio.",
                    "Flow-GRPO's reward is 0.2 image_similarity + 0.8 geneval (config/grpo.py:817-820); trl_jagg has "
                    "no image_similarity reward yet: the preset trains GenEval alone (add one with reward_funcs).",
                    *_QWENIMAGE.notes[:1],
                    *_QWENIMAGE.notes[-1:],
                ),
            ),
            _FAST_FLUX,
            _WAN21,
            _DANCE,
            _DANCE.variant(
                "dancegrpo-flux-8gpu",
                "dancegrpo-flux as DanceGRPO's 8-GPU script: 2 prompts x 12 samples per process, two optimizer steps "
                "per rollout, EMA 0.995 once per rollout, gradient clipping at 0.01.",
                {
                    # --train_batch_size 2 x --num_generations 12, --gradient_accumulation_steps 12
                    "steps_per_generation": 24,
                    "gradient_accumulation_steps": 12,
                    # --use_ema --ema_decay 0.995: FSDP_EMA.update after every train_one_step (one rollout), no
                    # warm-up, the average on rank 0's CPU
                    "ema_decay": 0.995,
                    "ema_update_interval": 2,  # the optimizer steps of one rollout
                    "ema_warmup": False,
                    "ema_offload": True,
                    "max_grad_norm": 0.01,
                },
                source="DanceGRPO (Xue et al. 2025, arXiv 2505.07818): fastvideo/train_grpo_flux.py and "
                "scripts/finetune/finetune_flux_grpo_8gpus.sh at XueZeyue/DanceGRPO@15cc71d.",
                notes=(
                    "--init_same_noise draws one noise per sampling call shared by the process's 24 samples, i.e. "
                    "by its two groups; same_group_noise gives each group its own.",
                    "DanceGRPO keeps the whole EMA on rank 0's CPU; under FSDP2 each process averages its own "
                    "shard of it (on its CPU with ema_offload), gathered into ema/ at save time.",
                    *_DANCE.notes[:-1],
                ),
            ),
            Recipe(
                name="mixgrpo-flux",
                model="black-forest-labs/FLUX.1-dev",
                description="MixGRPO-Flash on FLUX.1-dev: full fine-tuning, 25 steps with shift 3, SDE (a = 0.7) only "
                "in a 4-step window that slides one step every 20 optimizer steps, DPM-Solver++ (order 2) on 40% of "
                "the ODE steps around it; the window is trained, as one JAGG group.",
                source="MixGRPO (Li et al. 2025, arXiv 2507.21802), Tencent-Hunyuan/MixGRPO@e5cdd6a: "
                "scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh, fastvideo/train_grpo_flux.py, "
                "fastvideo/utils/grpo_states.py, fastvideo/utils/sampling_utils.py.",
                config={
                    # finetune_flux_grpo_MixGRPO_Flash.sh L141-142, L54, L55 (eta with --flow_grpo_sampling L196:
                    # Flow-GRPO's SDE step, sampling_utils.py L157-186), L150.
                    "height": 720,
                    "width": 720,
                    "num_inference_steps": 25,
                    "guidance_scale": 3.5,  # sampling_utils.py L72-76
                    "sampler": "sde",
                    "noise_level": 0.7,
                    "num_generations": 12,
                    # One prompt x 12 generations per process (--train_batch_size 1, L128, L150), one sample per
                    # backward, an optimizer step every 3 samples (L68; train_grpo_flux.py L543-609): 4 per rollout.
                    "per_device_train_batch_size": 1,
                    "steps_per_generation": 12,
                    "gradient_accumulation_steps": 3,
                    # The sliding window: group_size 4 (L58), progressive (L59) with prog_overlap and roll_back
                    # (L164, L168), moving prog_overlap_step 1 (L60) every iters_per_group 20 (L57) steps;
                    # grpo_states.py L85-99 and L141-148, train_grpo_flux.py L916-928 and L946-947.
                    "train_timesteps": "sde_window",
                    "sde_window_size": 4,
                    "sde_window_schedule": "progressive",
                    "sde_window_stride": 1,
                    "sde_window_shift_interval": 20,
                    "sde_window_max_start": 19,  # its last full window: steps 19-22 (max_timesteps = 25 - 2)
                    # dpm_algorithm_type dpmsolver++, order 2, midpoint, post compress ratio 0.4 (L75-79).
                    "ode_solver_order": 2,
                    "ode_step_ratio": 0.4,
                    "beta": 0.0,  # kl_coeff (L56)
                    "clip_range": 1e-4,  # L156
                    "adv_clip_max": 5.0,  # L157
                    # Per group (--use_group L152), torch's unbiased std + 1e-8 (train_grpo_flux.py L428-448); int(sigma * 1000)
                    # fed to the model (sampling_utils.py L64); --init_same_noise (L155).
                    "scale_rewards": "group",
                    "advantage_std_ddof": 1,
                    "advantage_eps": 1e-8,
                    "quantize_timesteps": True,
                    "same_group_noise": True,
                    "max_sequence_length": 512,
                    "learning_rate": 1e-5,  # L135
                    # --lr_scheduler's default (train_grpo_flux.py L1152-1156) with --lr_warmup_steps 0 (L146).
                    "lr_scheduler_type": "constant_with_warmup",
                    "warmup_steps": 0,
                    "weight_decay": 1e-4,  # L149
                    "max_grad_norm": 1.0,  # L148
                    **PAPER_JAGG,  # W = 4: the whole window is one group
                    "dtype": "float32",  # full fine-tuning keeps float32 master weights
                    "activation_checkpointing": True,  # --gradient_checkpointing (L127)
                },
                scheduler={"shift": 3.0, "use_dynamic_shifting": False},  # --shift 3 (L151), sd3_time_shift
                reward_funcs=("hpsv2.1", "imagereward", "pickscore"),  # multi_reward (train_grpo_flux.py L710-727)
                mixed_precision="bf16",  # --mixed_precision bf16 (L136) over float32 weights
                notes=(
                    "MixGRPO truncates the windows that reach its max_timesteps (grpo_states.py L148) and includes "
                    "an empty one; here every window is full (sde_window_max_start=19: its last full window, "
                    "steps 19-22), so the trained steps are always one JAGG group of W = 4.",
                    "MixGRPO-Flash compresses only the ODE steps after the window (dpm_apply_strategy 'post') and "
                    "keeps its history across the window's SDE steps; ode_step_ratio thins both sides and each ODE "
                    "run starts its DPM-Solver++ history afresh. Before the window, the shared rollout prefix "
                    "already runs the ODE once per group.",
                    "MixGRPO sums per-reward advantages (multi_reward_mix 'advantage_aggr', L62); trl_jagg sums the "
                    "weighted rewards before the group advantage.",
                    "Shift 3 is a scheduler override, applied by the CLI for `--recipe mixgrpo-flux`; in Python, "
                    "pass get_recipe('mixgrpo-flux').apply_scheduler(pipeline) to DDPOJaggTrainer.",
                    "Full fine-tuning of a 12B backbone needs FSDP (or DeepSpeed ZeRO) on GPUs.",
                ),
            ),
            _flow_factory(
                "flow-factory-z-image",
                "Tongyi-MAI/Z-Image",
                "z_image",
                "Flow-Factory's GRPO on Z-Image: LoRA, CFG 4, SDE a = 0.7, 10 steps.",
                # guidance_scale 4.0 (L54), the pipeline's empty negative prompt; eval 40 steps (L90).
                {
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 10,
                    "guidance_scale": 4.0,
                    "negative_prompt": "",
                    "noise_level": 0.7,
                    "eval_num_inference_steps": 40,
                },
                _ZIMAGE_LORA_TARGETS,
                sde_steps="steps {1, 2, 3} (L81-82)",
            ),
            _flow_factory(
                "flow-factory-z-image-turbo",
                "Tongyi-MAI/Z-Image-Turbo",
                "z_image_turbo",
                "Flow-Factory's GRPO on Z-Image-Turbo: LoRA, no CFG (distilled), SDE a = 0.7, 6 steps.",
                # guidance_scale 0 (L54): one backbone call per step; eval 10 steps (L90).
                {
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 6,
                    "guidance_scale": 0.0,
                    "noise_level": 0.7,
                    "eval_num_inference_steps": 10,
                },
                _ZIMAGE_LORA_TARGETS,
                sde_steps="steps {1, 2, 3} (L81-82)",
            ),
            _flow_factory(
                "flow-factory-flux2-klein-base",
                "black-forest-labs/FLUX.2-klein-base-9B",
                "flux2_klein_base",
                "Flow-Factory's GRPO on FLUX.2 klein base 9B: LoRA, CFG 4, SDE a = 0.7, 8 steps at 384 px.",
                # resolution 384 (L51), 8 steps, guidance 4.0 (L53-54), noise 0.7 (L90), eval 28 steps (L101); the
                # pipeline's negative prompt is always "".
                {
                    "height": 384,
                    "width": 384,
                    "num_inference_steps": 8,
                    "guidance_scale": 4.0,
                    "negative_prompt": "",
                    "noise_level": 0.7,
                    "eval_num_inference_steps": 28,
                },
                _FLUX2_KLEIN_LORA_TARGETS,
                sde_steps="steps {1, 2, 3} (L91-92)",
            ),
            _flow_factory(
                "flow-factory-flux2-klein",
                "black-forest-labs/FLUX.2-klein-9B",
                "flux2_klein",
                "Flow-Factory's GRPO on the step-distilled FLUX.2 klein 9B: LoRA, no CFG, SDE a = 0.5, 4 steps.",
                # resolution 384 (L51), 4 steps, guidance 1.0 (L53-54), noise 0.5 (L90), eval 10 steps (L102). Only 3
                # steps are trained: one group of W = 3 (a W = 4 group would never fit).
                {
                    "height": 384,
                    "width": 384,
                    "num_inference_steps": 4,
                    "guidance_scale": 1.0,
                    "noise_level": 0.5,
                    "eval_num_inference_steps": 10,
                    "jagg_group_size": 3,
                },
                _FLUX2_KLEIN_LORA_TARGETS,
                sde_steps="steps {1, 2} (L91-92)",
            ),
        )
    }
)


def list_recipes() -> list[str]:
    """The preset names, in the order of ``docs/models.md``."""
    return list(RECIPES)


def get_recipe(name: str) -> Recipe:
    """The preset ``name``; an unknown name raises a ``ValueError`` listing the presets."""
    try:
        return RECIPES[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown recipe {name!r}.{hint} Presets: {list_recipes()}.") from None


def write_recipe_yamls(directory: str | os.PathLike[str]) -> list[str]:
    """Write ``<directory>/<name>.yaml`` for every preset; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for recipe in RECIPES.values():
        path = os.path.join(directory, f"{recipe.name}.yaml")
        with open(path, "w") as handle:
            handle.write(recipe.to_yaml())
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trl_jagg.recipes [DIRECTORY]``: regenerate the YAML files (default ``examples/recipes``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for path in write_recipe_yamls(argv[0] if argv else os.path.join("examples", "recipes")):
        print(path)


if __name__ == "__main__":
    main()
