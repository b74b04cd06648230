"""DanceGRPO's presets (FLUX.1-dev, Wan2.1-T2V-1.3B, Qwen-Image-Edit; full fine-tuning) and MixGRPO's (built on
DanceGRPO's FastVideo trainer, FLUX.1-dev)."""

from __future__ import annotations

from dataclasses import replace

from trl_jagg.recipes._shared import PAPER_JAGG
from trl_jagg.recipes.recipe import Recipe

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
        "epsilon": 1e-4,
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

# DanceGRPO's Wan2.1 and Qwen-Image-Edit runs share dancegrpo-flux's trainer (fastvideo/train_grpo_{wan_2_1,
# qwenimage_edit}.py are its copies): the same flux_step SDE, advantages, random 60% of the steps but the last, loss
# and optimizer. Lines: WS = scripts/finetune/finetune_wan_2_1_grpo.sh, WT = fastvideo/train_grpo_wan_2_1.py,
# QS = scripts/finetune/finetune_qwenimage_edit_grpo.sh, QT = fastvideo/train_grpo_qwenimage_edit.py at 15cc71d.
_DANCE_SHARED = {
    "sampler": "dance",  # flux_step(..., sde_solver=True): WT:94-133, 215; QT:132-171, 237
    "noise_level": 0.3,  # eta: WS:41, QS:42
    "per_device_train_batch_size": 1,  # one sample a backward: WT:494-526, QT:597-635
    "train_timesteps": "random_but_last",  # --ignore_last (WS:50, QS:51): WT:437-444, QT:537-547
    "train_timestep_fraction": 0.6,  # WS:51, QS:52; int(19 * 0.6) = 11 of 20 steps (WT:493, QT:596)
    "beta": 0.0,  # no KL term in the loss (WT:510-524, QT:619-633)
    "epsilon": 1e-4,  # WS:53, QS:54
    "adv_clip_max": 5.0,  # WS:54, QS:55
    # --use_group (WS:49, QS:50): per-group torch std (unbiased) + 1e-8 (WT:456-468, QT:559-571).
    "scale_rewards": "group",
    "advantage_std_ddof": 1,
    "advantage_eps": 1e-8,
    "quantize_timesteps": True,  # int(sigma * 1000) as the timestep (WT:192-193, 431-434; QT:220-227, 531-534)
    "same_group_noise": True,  # --init_same_noise (WS:52, QS:53): WT:300-305, QT:323-328
    "reward_on_predicted_x0": True,  # the last step's pred_original decoded (WT:219, 338-350; QT:241, 383-397)
    "learning_rate": 1e-5,  # WS:31, QS:32
    "lr_scheduler_type": "constant_with_warmup",  # --lr_scheduler's default (WT:951-959, QT:1087-1095)
    "warmup_steps": 0,  # WS:42, QS:43
    "weight_decay": 1e-4,  # WS:45, QS:46
    "max_grad_norm": 1.0,  # WS:44, QS:45
    **PAPER_JAGG,
    "dtype": "float32",  # QT:736-740 (float32 master weights); Wan: see its notes
    "activation_checkpointing": True,  # --gradient_checkpointing (WS:23, QS:24): WT:620-623, QT:758-760
}

_DANCE_WAN = Recipe(
    name="dancegrpo-wan2.1",
    model="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
    description="DanceGRPO on Wan2.1-T2V-1.3B: full fine-tuning, single-frame 512 x 512 videos, CFG 5, constant-eta "
    "SDE (eta 0.3), 20 steps with shift 3, a random 60% of the first 19 steps trained per sample, HPSv2.1.",
    source="DanceGRPO (Xue et al. 2025, arXiv 2505.07818): fastvideo/train_grpo_wan_2_1.py, "
    "scripts/finetune/finetune_wan_2_1_grpo.sh and fastvideo/data_preprocess/preprocess_wan_2_1_embeddings.py at "
    "XueZeyue/DanceGRPO@15cc71d.",
    config={
        **_DANCE_SHARED,
        **{"height": 512, "width": 512, "num_frames": 1},  # --h/--w/--t (WS:37-39): one latent frame (WT:291)
        "num_inference_steps": 20,  # WS:40
        # --cfg_infer 5 (WS:55): v_u + 5 (v_c - v_u) on one 2B call, both branches differentiated (WT:195-205,
        # 238-248); the negative embeddings are encode_prompt's of "" (preprocess_wan_2_1_embeddings.py:104-105).
        "guidance_scale": 5.0,
        "negative_prompt": "",
        "cfg_gradient": "both",
        "num_generations": 12,  # WS:47
        # 2 prompts x 12 samples per process (--train_batch_size 2, WS:24), an optimizer step every
        # --gradient_accumulation_steps 24 (WS:29, WT:530): one per rollout, each sample used once.
        "steps_per_generation": 24,
        "gradient_accumulation_steps": 24,
        # encode_prompt without max_sequence_length (preprocess_wan_2_1_embeddings.py:104-105): WanPipeline's
        # default 226 tokens (diffusers 0.35, pinned by scripts/preprocess/preprocess_wan_2_1_rl_embeddings.sh:5).
        "max_sequence_length": 226,
    },
    reward_funcs=("hpsv2.1",),  # --use_hpsv2 (WS:46): HPS_v2.1_compressed.pt (WT:602), on the first frame (WT:353-365)
    mixed_precision="bf16",  # WS:32; bf16 autocast (WT:196, 207, 239, 250)
    notes=(
        "DanceGRPO loads the transformer in bfloat16 and steps AdamW on it (train_grpo_wan_2_1.py:614-618, 643-652) "
        "despite its comment 'keep the master weight to float32' (L612); an AdamW update (about lr = 1e-5 per weight) "
        "is below half a bf16 ulp (at least |w| / 512) for every weight above about 5e-3 in magnitude and rounds away, "
        "so the preset keeps float32 master weights under bf16 autocast, as DanceGRPO's Flux and Qwen-Image-Edit runs.",
        "DanceGRPO's Wan script wraps the transformer in neither FSDP nor DDP (train_grpo_wan_2_1.py:614-652; its "
        "only all_reduce averages the logged loss, L528): each of its 8 processes trains its own replica. trl_jagg "
        "averages the gradients over processes (one model).",
        "The steps run on the checkpoint's UniPC flow sigmas (flow_shift 3, DanceGRPO's --shift 3), which end at "
        "1/1000 before the final 0: within 0.0024 of DanceGRPO's sd3_time_shift(3, linspace(1, 0, 21)) "
        "(train_grpo_wan_2_1.py:277-279); no scheduler override.",
        "DanceGRPO scores the first frame of the video after an mp4 export (export_to_video, then cv2: "
        "train_grpo_wan_2_1.py:351-356); trl_jagg scores the decoded frame itself (one frame: the mean over frames is "
        "that frame), without the H.264 round trip.",
        "--init_same_noise draws one noise per sampling call shared by the process's 24 samples, i.e. by its two "
        "groups (train_grpo_wan_2_1.py:300-305); same_group_noise gives each group its own.",
        "Full fine-tuning of the 1.3B backbone: AdamW's float32 state fits one GPU; FSDP or DeepSpeed ZeRO shard it "
        "over several.",
    ),
)

_DANCE_QWENIMAGE_EDIT = Recipe(
    name="dancegrpo-qwenimage-edit",
    model="Qwen/Qwen-Image-Edit",
    description="DanceGRPO on Qwen-Image-Edit: full fine-tuning, 512 x 512 edits of sources at 1024^2, no CFG, "
    "constant-eta SDE (eta 0.3), 20 steps with shift 3, a random 60% of the first 19 steps trained per sample, "
    "HPSv2.1.",
    source="DanceGRPO (Xue et al. 2025, arXiv 2505.07818): fastvideo/train_grpo_qwenimage_edit.py, "
    "scripts/finetune/finetune_qwenimage_edit_grpo.sh and fastvideo/data_preprocess/"
    "preprocess_qwenimage_edit_embeddings.py at XueZeyue/DanceGRPO@15cc71d.",
    config={
        **_DANCE_SHARED,
        **{"height": 512, "width": 512},  # --h/--w (QS:38-39)
        # The source resized to 1024^2 pixels at its aspect ratio, sides multiples of 32
        # (preprocess_qwenimage_edit_embeddings.py:35-42, 59, 68-70): the pipeline's own area.
        "source_image_area": None,
        "num_inference_steps": 20,  # QS:41
        "true_cfg_scale": 1.0,  # one conditional call a step, guidance=None (QT:223-236, 263-276): no CFG
        "num_generations": 8,  # QS:48
        # 2 prompts x 8 samples per process (--train_batch_size 2, QS:25), an optimizer step every
        # --gradient_accumulation_steps 8 (QS:30, QT:639): two per rollout, each sample used once.
        "steps_per_generation": 16,
        "gradient_accumulation_steps": 8,
        # encode_prompt untruncated (preprocess_qwenimage_edit_embeddings.py:74-78), padded to 5000 tokens and cut
        # back to its length (L167-172, QT:331).
        "max_sequence_length": None,
        # The float32 Qwen2.5-VL encoder (33 GB) stays on the CPU outside prompt encoding, as flow-grpo-qwenimage;
        # DanceGRPO encodes every prompt offline (preprocess_qwenimage_edit_embeddings.py), so none is on its GPUs.
        "offload_frozen_modules": True,
    },
    scheduler={"shift": 3.0, "use_dynamic_shifting": False, "shift_terminal": None},  # --shift 3 (QS:49), QT:300-302
    reward_funcs=(
        "hpsv2.1",
    ),  # --use_hpsv2 (QS:47): HPS_v2.1_compressed.pt (QT:711), on the edited image (QT:399-411)
    mixed_precision="bf16",  # QS:33; FSDP with bf16 mixed precision over float32 weights (QT:743-752)
    notes=(
        "Shift 3 is a scheduler override: a static sd3_time_shift(3) of linspace(1, 0, 21), as "
        "train_grpo_qwenimage_edit.py:300-302, instead of Qwen-Image's resolution-dependent shift stretched to end "
        "at 0.02 (shift_terminal). The CLI applies it for `--recipe dancegrpo-qwenimage-edit`; in Python, pass "
        "get_recipe('dancegrpo-qwenimage-edit').apply_scheduler(pipeline) to DDPOJaggTrainer.",
        "Datasets carry a `source_image` column (DanceGRPO's SEED-Data-Edit rows, "
        "preprocess_qwenimage_edit_embeddings.py:105-118); HPSv2.1 scores the edited image against the instruction, "
        "its caption (L207).",
        "--init_same_noise draws one noise per sampling call shared by the process's 16 samples, i.e. by its two "
        "groups (train_grpo_qwenimage_edit.py:323-328); same_group_noise gives each group its own.",
        "EMA is off as in finetune_qwenimage_edit_grpo.sh (no --use_ema; train_grpo_qwenimage_edit.py:754-756).",
        "Full fine-tuning of a 20B backbone needs FSDP (or DeepSpeed ZeRO) and bf16=True on GPUs.",
    ),
)


_MIX = Recipe(
    name="mixgrpo-flux",
    model="black-forest-labs/FLUX.1-dev",
    description="MixGRPO-Flash on FLUX.1-dev: full fine-tuning, 25 steps with shift 3, SDE (a = 0.7) only "
    "in a 4-step window that slides one step every 20 rollouts (80 optimizer steps), DPM-Solver++ (order 2) on "
    "MixGRPO-Flash's count of ODE steps after it (7 after steps 0-3); the window is trained, as one JAGG group.",
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
        # (L164, L168), moving prog_overlap_step 1 (L60) every iters_per_group 20 (L57) rollouts: one
        # update_iteration per train_one_step (train_grpo_flux.py L946-947), i.e. per rollout of 4 optimizer
        # steps; it stops before max_timesteps = 25 - 2 (L919; grpo_states.py L85-99, L141-148).
        "train_timesteps": "sde_window",
        "sde_window_size": 4,
        "sde_window_schedule": "progressive",
        "sde_window_stride": 1,
        "sde_window_shift_interval": 20,
        "sde_window_max_start": None,  # its last non-empty window: step 22 (max_timesteps = 25 - 2)
        # dpm_algorithm_type dpmsolver++, order 2, midpoint, post compress ratio 0.4 (L75-79): after the window,
        # int((25 - last) * 0.4) points, one step fewer (sampling_utils.py L44-53).
        "ode_solver_order": 2,
        "ode_step_ratio": 0.4,
        "beta": 0.0,  # kl_coeff (L56)
        "epsilon": 1e-4,  # L156
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
        "The window moves once every 20 rollouts, as MixGRPO's update_iteration (once per train_one_step); over "
        "MixGRPO-Flash's 300 rollouts it starts at steps 0-14. From start 20 on (rollout 400) the windows are cut "
        "short at MixGRPO's max_timesteps (steps 20-22, 21-22, 22); MixGRPO then spends 20 rollouts on an empty "
        "window (start 23), which is skipped here: the slide rolls back after start 22.",
        "MixGRPO-Flash compresses only the ODE steps after the window (dpm_apply_strategy 'post'), to "
        "int((25 - last) * 0.4) - 1 steps (7 after steps 0-3: 11 backbone calls a rollout), on points of a new "
        "schedule, and keeps its history across the window's SDE steps; here the same count after the window, on "
        "points of the pipeline's schedule, ode_step_ratio also thins the ODE before the window, and each ODE "
        "run starts its DPM-Solver++ history afresh. Before the window, the shared rollout prefix "
        "already runs the ODE once per group.",
        "MixGRPO sums per-reward advantages (multi_reward_mix 'advantage_aggr', L62); trl_jagg sums the "
        "weighted rewards before the group advantage.",
        "Shift 3 is a scheduler override, applied by the CLI for `--recipe mixgrpo-flux`; in Python, "
        "pass get_recipe('mixgrpo-flux').apply_scheduler(pipeline) to DDPOJaggTrainer.",
        "Full fine-tuning of a 12B backbone needs FSDP (or DeepSpeed ZeRO) on GPUs.",
    ),
)

_FAST = replace(
    _MIX,
    name="jagg-fast-flux",
    description="Deprecated (use mixgrpo-flux): MixGRPO-Flash's rollout on FLUX.1-dev (SDE only in a 4-step "
    "window, DPM-Solver++ of order 2 after it, the shared prefix) with the window held on the first, high-noise "
    "steps instead of sliding; the window is trained, as one JAGG group.",
    source="trl_jagg (issue 29), built on MixGRPO-Flash (mixgrpo-flux): docs/models.md says where it departs.",
    deprecated="its held window did not beat MixGRPO's slide at the preset's own beta = 0 once the slide moved at "
    "MixGRPO's cadence (held-out reward at step 100 on the CPU demo, 3 seeds: +0.194 against +0.245; "
    "docs/models.md). Use 'mixgrpo-flux', which is as fast per step (JAGG 1.32x over MixGRPO-Flash) and samples "
    "one ODE step fewer.",
    config={
        **{k: v for k, v in _MIX.config.items() if k not in ("sde_window_stride", "sde_window_shift_interval")},
        # Held on steps 0-3, where the layout and colours are settled. On the CPU demo this beat MixGRPO's slide with
        # a KL term (beta 0.15: the slide forgets); at this preset's beta = 0 it did not (docs/models.md).
        "sde_window_schedule": "fixed",
        "sde_window_max_start": 0,
    },
    notes=(
        "Departs from MixGRPO-Flash only in where the window sits: held at steps 0-3 for the whole run "
        "instead of sliding one step every 20 rollouts over steps 0-22. Steps 4-24 run DPM-Solver++ "
        "(order 2) on 40% of their points: 8 backbone calls, 12 a rollout in all instead of 25.",
        "The window starts at step 0, so the shared prefix before it is empty: same_group_noise is kept "
        "only so that a user who moves the window (sde_window_max_start) keeps MixGRPO's shared prefix.",
        "The ODE after the held window takes round(0.4 x 21) = 8 steps, the count trl_jagg uses for a fixed "
        "window; MixGRPO-Flash's own count after steps 0-3 is 7 (int(22 x 0.4) - 1, mixgrpo-flux). Each ODE run "
        "starts its DPM-Solver++ history afresh.",
        _MIX.notes[2],
        "Shift 3 is a scheduler override, applied by the CLI for `--recipe jagg-fast-flux`; in Python, "
        "pass get_recipe('jagg-fast-flux').apply_scheduler(pipeline) to DDPOJaggTrainer.",
        _MIX.notes[4],
    ),
)

DANCEGRPO_RECIPES: tuple[Recipe, ...] = (
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
    _DANCE_WAN,
    _DANCE_QWENIMAGE_EDIT,
    _MIX,
    _FAST,
)
"""DanceGRPO's and MixGRPO's presets, in the order of ``docs/models.md``."""
