"""Flow-GRPO's presets (and GRPO-Guard's, Flow-GRPO-Fast's): SD3.5, FLUX.1, FLUX.1 Kontext, Qwen-Image(-Edit) and
Wan2.1, as Flow-GRPO's ``config/grpo.py`` and ``scripts/train_*.py`` set them."""

from __future__ import annotations

from trl_jagg.recipes._shared import (
    _FLOW_GRPO_ADVANTAGES_AND_KL,
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
from trl_jagg.recipes.recipe import Recipe

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
        "beta": 0.01,  # pickscore_sd3; the OCR and GenEval configs use 0.04 (flow-grpo-sd35-ocr, -geneval)
        **_FLOW_GRPO_LOSS,
        **_FLOW_GRPO_ADVANTAGES_AND_KL,
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
        **_FLOW_GRPO_ADVANTAGES_AND_KL,
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

# Shared with flow-grpo-flux: 512 px, a = 0.9, beta 0, global std, EMA, 128 tokens, bf16 (L665, L676-681 of the config;
# train_flux_kontext.py:442, 588) and the base config's optimiser.
_KONTEXT = _FLUX.variant(
    "flow-grpo-kontext",
    "Flow-GRPO on FLUX.1-Kontext-dev (image editing): LoRA on attention, feed-forward and the single blocks' MLP, "
    "embedded guidance 2.5, SDE a = 0.9, 6 steps, CLIP image similarity to the source + GenEval counting.",
    {
        **{"num_inference_steps": 6, "eval_num_inference_steps": 28, "guidance_scale": 2.5},  # L661-663
        "num_generations": 21,  # num_image_per_prompt (L667); train_batch_size 3 (L666), GA = batches // 2 (L673)
        **_two_updates_per_rollout(per_device=3, images_per_process=42),
        "drop_zero_advantages": True,  # train_flux_kontext.py:766-786 masks zero-advantage samples
        "reward_weights": [0.5, 0.5],  # L685-688
    },
    model="black-forest-labs/FLUX.1-Kontext-dev",
    source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): config/grpo.py counting_flux_kontext (L654-690) and "
    "scripts/train_flux_kontext.py at zhtmike/flow_grpo@9745241; JAGG spec section 5.",
    lora=_lora(64, _FLOW_GRPO_ATTENTION + _FLUX_FEED_FORWARD + ("proj_mlp",)),  # train_flux_kontext.py:411-430
    reward_funcs=("clip-image-similarity", "geneval"),
    notes=(
        "The dataset has `source_image` (resized to the output size, as train_flux_kontext.py:582) and GenEval's "
        "counting metadata (tag, include, exclude). Per-prompt statistics group by instruction and source image.",
        "Each process samples two groups of 21 (42 images, 14 micro-batches of 3, an optimizer step every 7); "
        "Flow-GRPO samples 12 batches of 3 per GPU on 28 GPUs (48 prompts x 21 images per epoch, L668). 6 steps "
        "train 5 (timestep_fraction 0.99, L675): one JAGG group of W = 4, the remaining step exact.",
        "geneval is GenEval-style (OWLv2), not Flow-GRPO's Mask2Former sidecar (examples/flow_grpo_sidecar.py "
        "serves that); clip-image-similarity is its image_similarity on the same CLIP ViT-L/14 (bicubic resize).",
        _FLUX.notes[-1],
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
        "epsilon": 1e-5,  # CPS log-probs have no 1/std^2: a smaller clip range
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
        **_FLOW_GRPO_ADVANTAGES_AND_KL,
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
        # L53, L55; base.py:97
        **{"beta": 0.004, "epsilon": 1e-3, "adv_clip_max": 5.0, **_FLOW_GRPO_ADVANTAGES_AND_KL},
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


FLOW_GRPO_RECIPES: tuple[Recipe, ...] = (
    _SD35,
    _SD35.variant(
        "flow-grpo-sd35-ocr",
        "Flow-GRPO on SD3.5-Medium with the OCR reward: flow-grpo-sd35 with beta 0.04.",
        {"beta": 0.04},  # general_ocr_sd3
        reward_funcs=("ocr",),
    ),
    _SD35.variant(
        "flow-grpo-sd35-geneval",
        "Flow-GRPO on SD3.5-Medium with the GenEval-style reward (OWLv2 + CLIP colours): flow-grpo-sd35 with beta "
        "0.04, on GenEval's metadata.",
        {"beta": 0.04},  # geneval_sd3 (config/grpo.py:147), as general_ocr_sd3
        source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470): config/grpo.py:125-161 geneval_sd3 and "
        "scripts/train_sd3.py at zhtmike/flow_grpo@9745241; JAGG spec section 5.",
        reward_funcs=("geneval",),
        notes=(
            "The dataset is GenEval's metadata: Flow-GRPO's dataset/geneval/train_metadata.jsonl (prompt_fn "
            "'geneval': GenevalPromptDataset, train_sd3.py:60-77, hands each row to the reward as the prompt's "
            "metadata). Load it with load_dataset('json', data_files=...): its tag, include and exclude columns reach "
            "the reward beside the prompt (examples/train_sd35_geneval.py).",
            "geneval is GenEval-style: GenEval's rules and Flow-GRPO's dense score on OWLv2 detections and CLIP "
            "colours on box crops, in process; Flow-GRPO's reward is GenEval's Mask2Former pipeline (mmdet) behind "
            "its reward server. For that one, serve it with examples/flow_grpo_sidecar.py and train with "
            "reward_funcs=['http://127.0.0.1:18085/score/geneval'] (docs/rewards.md).",
            "Flow-GRPO evaluates on dataset/geneval/test_metadata.jsonl (2212 prompts, test_batch_size 14): pass it "
            "as eval_dataset, loaded the same way.",
            *_SD35.notes,
        ),
    ),
    _SD35.variant(
        "flow-grpo-guard-sd35",
        "GRPO-Guard on SD3.5-Medium with PickScore: flow-grpo-sd35 with the normalised ratio and 1/|dt| "
        "step reweighting, clip range 4e-6, lr 1e-4, no KL, per-prompt std.",
        {
            "ratio_normalization": True,  # config.rationorm = True
            "step_gradient_reweighting": True,  # the same switch divides each step's policy loss by |dt|
            "epsilon": 4e-6,
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
            "source_image_area stays None (1024^2), 4096 reference tokens. Sources of other aspect ratios "
            "train too: each rollout draws rows of one reference grid (a bucket).",
            "Flow-GRPO's reward is 0.2 image_similarity + 0.8 geneval (config/grpo.py:817-820); trl_jagg has "
            "no image_similarity reward yet: the preset trains GenEval alone (add one with reward_funcs).",
            *_QWENIMAGE.notes[:1],
            *_QWENIMAGE.notes[-1:],
        ),
    ),
    _KONTEXT,
    _FAST_FLUX,
    _WAN21,
)
"""Flow-GRPO's presets, in the order of ``docs/models.md``."""
