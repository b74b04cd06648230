"""DanceGRPO's presets and MixGRPO's (built on DanceGRPO's FastVideo trainer): FLUX.1-dev full fine-tuning."""

from __future__ import annotations

from ..recipe import Recipe
from ._shared import PAPER_JAGG

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
)
"""DanceGRPO's and MixGRPO's presets, in the order of ``docs/models.md``."""
