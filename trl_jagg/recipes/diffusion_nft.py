"""DiffusionNFT's presets: SD3.5-Medium with PickScore, OCR and GenEval, as ``config/nft.py`` and
``scripts/train_nft_sd3.py`` set them at NVlabs/DiffusionNFT@24af555 (``objective="nft"``)."""

from __future__ import annotations

from trl_jagg.recipes._shared import _FLOW_GRPO_ADVANTAGES, _FLOW_GRPO_ATTENTION, _lora
from trl_jagg.recipes.recipe import Recipe

_NFT_SOURCE = (
    "DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): config/nft.py {config} (L{lines}) and config/base.py, "
    "scripts/train_nft_sd3.py (LoRA L419-431, EMA L565-567, loss L910-970, old policy L1035-1039) at "
    "NVlabs/DiffusionNFT@24af555."
)

# config/nft.py _get_config (L11-67) with config/base.py: SD3.5-M at 512 px, 10 rollout steps with DPM-Solver 2
# (sample.solver="dpm2", deterministic), CFG off (guidance 1.0), 24 images per prompt, 99% of the timesteps trained,
# KL 1e-4 (train.beta), adv_clip_max 5, lr 3e-4, AdamW weight decay 1e-4, grad norm 1, constant rate; EMA 0.9 every
# optimizer step with the (1 + t) / (10 + t) warm-up; Flow-GRPO's per-prompt advantages with global std.
DIFFUSION_NFT_PROCESSES = 8
"""The processes DiffusionNFT's SD3.5 configs are written for (``n_gpus=8``, config/nft.py L75, L88, L103)."""
DIFFUSION_NFT_MICRO_BATCH = 9
"""DiffusionNFT's images per GPU per micro-batch (``bsz = 9``, config/nft.py L26, kept by its search at 8 GPUs)."""
DIFFUSION_NFT_IMAGES_PER_ROLLOUT = 48 * 24
"""Images one DiffusionNFT epoch samples and trains on all GPUs together: 48 prompts x 24 (config/nft.py L28-29)."""


def diffusion_nft_batch(num_processes: int, optimizer_steps_per_rollout: int = 1) -> dict[str, int]:
    """The batch fields that give DiffusionNFT's ``48 x 24 = 1152`` images per rollout on ``num_processes``
    processes, in micro-batches of 9 per process, with ``optimizer_steps_per_rollout`` optimizer steps each
    (DiffusionNFT's ``gradient_step_per_epoch``: 1, or 2 for OCR: 1152 or 576 images per optimizer step).

    Fewer processes take more micro-batches (``gradient_accumulation_steps`` grows) instead of fewer images per
    step, so the old-policy decay and the EMA, which count optimizer steps, advance per image as DiffusionNFT's.
    The presets hold the values for 8 processes; pass ``**diffusion_nft_batch(n)`` to
    ``GRPOJaggConfig.from_recipe`` on ``n`` (1, 2, 4, 8, 16, ...)."""
    per_process = DIFFUSION_NFT_IMAGES_PER_ROLLOUT // DIFFUSION_NFT_MICRO_BATCH  # 128 micro-batches of 9 in all
    if (
        num_processes < 1
        or per_process % num_processes
        or (per_process // num_processes) % optimizer_steps_per_rollout
    ):
        raise ValueError(
            f"num_processes={num_processes}: DiffusionNFT's {DIFFUSION_NFT_IMAGES_PER_ROLLOUT} images per rollout are "
            f"{per_process} micro-batches of {DIFFUSION_NFT_MICRO_BATCH}, which do not split evenly over "
            f"{num_processes} processes into {optimizer_steps_per_rollout} optimizer step(s). Use a power of two "
            "up to 64, or set per_device_train_batch_size, steps_per_generation and gradient_accumulation_steps."
        )
    micro_batches = per_process // num_processes
    return {
        "per_device_train_batch_size": DIFFUSION_NFT_MICRO_BATCH,
        "steps_per_generation": micro_batches,
        "gradient_accumulation_steps": micro_batches // optimizer_steps_per_rollout,
    }


_NFT_SD35 = {
    "objective": "nft",
    "height": 512,
    "width": 512,
    "num_inference_steps": 10,
    "ode_solver_order": 2,
    "guidance_scale": 1.0,
    "num_generations": 24,
    # DiffusionNFT's batch on 8 processes: 16 micro-batches of 9 each, 1152 images (48 prompts) per rollout and per
    # optimizer step (config/nft.py L38-45: num_batches_per_epoch = gradient_accumulation_steps = 16).
    **diffusion_nft_batch(DIFFUSION_NFT_PROCESSES),
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
    "On GPUs add fp16=True: DiffusionNFT's precision (mixed_precision='fp16'). DiffusionNFT's fp16 rollout also "
    "stores its clean latents x0 in fp16 (the latents take the fp16 prompt embeddings' dtype) and feeds its "
    "sampler integer timesteps (long(sigma * 1000)); here x0 stays in float32 and the timesteps are the scheduler's "
    "floats (sigma * 1000), in the rollout and the update alike.",
    "The batch is DiffusionNFT's on 8 processes: 16 micro-batches of 9 per process, 1152 images (48 prompts x 24) "
    "per rollout. On n processes as written a step has 144 n images (n/8 of DiffusionNFT's) and the old-policy decay "
    "and the EMA, which count optimizer steps, advance 8/n times faster per image: pass "
    "**trl_jagg.recipes.diffusion_nft.diffusion_nft_batch(n) (on the CLI: --steps_per_generation 128/n "
    "--gradient_accumulation_steps 128/n, OCR 64/n) to keep DiffusionNFT's images per step.",
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
        # gradient_step_per_epoch=2 (config/nft.py L75): two optimizer steps of 576 images per rollout of 1152.
        **diffusion_nft_batch(DIFFUSION_NFT_PROCESSES, optimizer_steps_per_rollout=2),
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
