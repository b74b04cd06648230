"""Flow-Factory's GRPO LoRA presets: Z-Image(-Turbo), FLUX.2 klein (base and distilled), FLUX.2 dev and Wan2.2 A14B."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trl_jagg.recipes._shared import _FLOW_GRPO_ATTENTION, PAPER_JAGG, _lora
from trl_jagg.recipes.recipe import Recipe

# Flow-Factory's default LoRA targets, as its adapters list them at a0b2bc5 (default_target_modules in
# src/flow_factory/models/z_image/z_image.py:70-75, and the same list for FLUX.2 klein and dev in
# src/flow_factory/models/flux/flux2_klein.py:92-104 and flux2.py:92-104, which name attn.to_out.0 twice): attention
# and feed-forward of every block.
_ZIMAGE_LORA_TARGETS = (
    "attention.to_k", "attention.to_q", "attention.to_v", "attention.to_out.0",
    "feed_forward.w1", "feed_forward.w2", "feed_forward.w3",
)  # fmt: skip
_FLUX2_LORA_TARGETS = (
    *_FLOW_GRPO_ATTENTION, "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)  # fmt: skip
# src/flow_factory/models/wan/wan2_t2v.py:74-85 at a0b2bc5: self- and cross-attention and the feed-forward.
_WAN_LORA_TARGETS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
    "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2",
)  # fmt: skip


def _flow_factory(
    name: str,
    model: str,
    config_file: str,
    description: str,
    settings: Mapping[str, Any],
    lora_targets: Sequence[str],
    *,
    sde_steps: str,
    reward_funcs: tuple[str, ...] = ("pickscore",),  # rewards: pick_score
    reward_note: str = "Flow-Factory aggregates several rewards with GDPO (advantage_aggregation); with the one "
    "reward of this preset that is the per-group normalisation of scale_rewards='group'.",
    notes: Sequence[str] = (),
) -> Recipe:
    """A Flow-Factory GRPO LoRA preset (``examples/grpo/lora/<config_file>`` at a0b2bc5). The settings its configs
    share are here, with their lines in the Z-Image files (the FLUX.2 klein files hold the same keys at L43-73, FLUX.2
    dev's ``flux2/t2i.yaml`` at L43-72, Wan2.2's ``wan22/t2v.yaml`` at L53-85); ``settings`` holds the model's own,
    ``reward_funcs`` and ``reward_note`` its rewards and how they are aggregated, ``notes`` its other differences."""
    steps = settings["num_inference_steps"]
    width = settings.get("jagg_group_size", PAPER_JAGG["jagg_group_size"])
    return Recipe(
        name=name,
        model=model,
        description=description,
        source=f"Flow-Factory (X-GenGroup/Flow-Factory@a0b2bc5) examples/grpo/lora/{config_file}; JAGG as in the paper.",
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
            "epsilon": 1e-4,  # L44
            "adv_clip_max": 5.0,  # adv_clip_range (L45)
            "scale_rewards": "group",  # global_std: false (L59)
            # numpy's population std, per group and over the batch (src/flow_factory/advantage/
            # advantage_processor.py L385, L463, L259-262)
            "advantage_std_ddof": 0,
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
        reward_funcs=reward_funcs,
        mixed_precision="bf16",
        notes=(
            f"Flow-Factory trains one SDE step per rollout, drawn from {sde_steps} (num_sde_steps: 1), which leaves "
            f"JAGG nothing to group; the preset trains all steps but the last ({steps - 1} of {steps}, JAGG groups "
            f"of W = {width}) instead.",
            reward_note,
            "LoRA r 64 / alpha 128 on Flow-Factory's default targets (lora_rank, lora_alpha, target_modules: "
            "default).",
            *notes,
        ),
    )


FLOW_FACTORY_RECIPES: tuple[Recipe, ...] = (
    _flow_factory(
        "flow-factory-z-image",
        "Tongyi-MAI/Z-Image",
        "z_image/default.yaml",
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
        "z_image_turbo/default.yaml",
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
        "flux2_klein_base/default.yaml",
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
        _FLUX2_LORA_TARGETS,
        sde_steps="steps {1, 2, 3} (L91-92)",
    ),
    _flow_factory(
        "flow-factory-flux2-klein",
        "black-forest-labs/FLUX.2-klein-9B",
        "flux2_klein/default.yaml",
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
        _FLUX2_LORA_TARGETS,
        sde_steps="steps {1, 2} (L91-92)",
    ),
    _flow_factory(
        "flow-factory-flux2-dev",
        "black-forest-labs/FLUX.2-dev",
        "flux2/t2i.yaml",
        "Flow-Factory's GRPO on FLUX.2 dev: LoRA, embedded guidance 4, SDE a = 1.0, 8 steps at 512 px, CLIP + "
        "PickScore with GDPO.",
        # resolution 512 (L51), 8 steps, guidance 4 (L52-53: embedded, one backbone call, no negative prompt), noise
        # 1.0 (L89), eval 28 steps (L99). Rewards CLIP (weight 1.0) and PickScore (0.5) (L104-116), aggregated with
        # GDPO (advantage_aggregation 'gdpo', L41: src/flow_factory/advantage/advantage_processor.py:403-470).
        {
            "height": 512,
            "width": 512,
            "num_inference_steps": 8,
            "guidance_scale": 4.0,
            "noise_level": 1.0,
            "eval_num_inference_steps": 28,
            "reward_weights": [1.0, 0.5],
            "multi_objective_aggregation": "normalize_then_sum",
        },
        _FLUX2_LORA_TARGETS,
        sde_steps="steps {1, 2, 3} (L91)",
        reward_funcs=("clipscore", "pickscore"),
        reward_note="CLIP is clipscore, 100 max(cos, 0) on CLIP ViT-L/14, where Flow-Factory's is the cosine "
        "(src/flow_factory/rewards/clip.py:33, 87-97): GDPO normalises each reward within its group, so the factor "
        "100 cancels, and the clamp at 0 only acts on a negative cosine. Flow-Factory evaluates at 1024 px (L96); "
        "evaluation here samples at the training size.",
    ),
    _flow_factory(
        "flow-factory-wan2.2",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        "wan22/t2v.yaml",
        "Flow-Factory's GRPO on Wan2.2 T2V A14B: LoRA on both experts, CFG 4 / 3, SDE a = 0.9, 10 steps, 5 frames.",
        # resolution 480, 5 frames, 10 steps, guidance 4.0 / guidance_scale_2 3.0 (L61-65), noise 0.9 (L96),
        # learning rate 1e-4 (L77), both experts (target_components, L27); eval 720 px, 21 frames, 28 steps (L103-108).
        {
            "height": 480,
            "width": 480,
            "num_frames": 5,
            "num_inference_steps": 10,
            "guidance_scale": 4.0,
            "guidance_scale_2": 3.0,
            "train_experts": "both",
            "noise_level": 0.9,
            "learning_rate": 1e-4,
            "eval_num_inference_steps": 28,
        },
        _WAN_LORA_TARGETS,
        sde_steps="steps {1, 2, 3} (L97-98)",
        notes=(
            "JAGG groups never straddle the switch between the experts (boundary_ratio): each group interpolates one "
            "expert's Jacobian, so the trained steps are grouped on each side of it.",
            "Each expert's LoRA is saved in its own folder (transformer/, transformer_2/), loaded with "
            "load_lora_weights (load_into_transformer_2=True for the second), as Flow-Factory saves one folder per "
            "target component.",
            "Flow-Factory evaluates at 720 px and 21 frames (L103-104); the preset's sample images use the training "
            "size and frames. It launches DeepSpeed ZeRO-2 (L7); the preset sets no launcher.",
        ),
    ),
)
"""Flow-Factory's presets, in the order of ``docs/models.md``."""
