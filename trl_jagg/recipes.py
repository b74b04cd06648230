"""Presets: the public Flow-GRPO / Flow-GRPO-Fast / DanceGRPO recipes as named, documented GRPOJaggConfig values.

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
settings of the paper: groups of ``W = 4`` trained steps, the high-noise 60% of the groups routed to JAGG (the
Flow-GRPO-Fast preset trains only 3 steps, so its ``W`` is 3: a shorter group would always run exact).

The CLI's YAML files (``examples/recipes/<name>.yaml``) are generated from these presets, never edited by hand::

    python -m trl_jagg.recipes examples/recipes
"""

from __future__ import annotations

import difflib
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline
    from peft import LoraConfig


__all__ = [
    "ATTENTION_PROJECTIONS",
    "PAPER_JAGG",
    "RECIPES",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "write_recipe_yamls",
]

PAPER_JAGG: Mapping[str, Any] = MappingProxyType({"use_jagg": True, "jagg_group_size": 4, "jagg_frac": 0.6})
"""The JAGG settings of the paper (arXiv 2607.17572): W = 4, the high-noise 60% of the groups routed to JAGG."""

ATTENTION_PROJECTIONS: tuple[str, ...] = (
    "to_q", "to_k", "to_v", "to_out.0",  # image stream
    "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",  # text stream of the joint (MM-DiT) blocks
)  # fmt: skip
"""The attention projections of both streams, named alike in the SD3, Flux and Qwen-Image transformers."""

# Optimiser settings of Flow-GRPO's base config shared by its recipes (AdamW betas/eps are the defaults).
_FLOW_GRPO_OPTIM = {"learning_rate": 3e-4, "weight_decay": 1e-4, "max_grad_norm": 1.0}
_FLOW_GRPO_LOSS = {"clip_range": 1e-4, "adv_clip_max": 5.0}
# Flow-GRPO's advantages (flow_grpo/stat_tracking.py): the prompt's mean over a tracker cleared every epoch, numpy's
# population std + 1e-4; its KL divides by the sampler's std_dev_t (scripts/train_*.py).
_FLOW_GRPO_ADVANTAGES = {
    "per_prompt_stat_tracking": True,
    "advantage_std_ddof": 0,
    "advantage_eps": 1e-4,
    "kl_std": "flow_grpo",
}
# Flow-GRPO's EMAModuleWrapper(decay=0.9, update_step_interval=8) with its (1 + t) / (10 + t) warm-up.
_FLOW_GRPO_EMA = {"ema_decay": 0.9, "ema_update_interval": 8, "ema_warmup": True}


def _attention_lora(rank: int) -> dict[str, Any]:
    """Flow-GRPO's LoRA: rank ``rank`` and alpha ``2 * rank`` on the attention projections."""
    return {
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ATTENTION_PROJECTIONS,
        "init_lora_weights": "gaussian",
    }


@dataclass(frozen=True)
class Recipe:
    """A named preset.

    Attributes:
        name: the preset's name (``GRPOJaggConfig.from_recipe(name, ...)``).
        model: Hub id of the base pipeline the recipe fine-tunes.
        description: one line: what the recipe is.
        source: where the numbers come from.
        config: :class:`~trl_jagg.GRPOJaggConfig` field values (read-only).
        lora: :class:`~peft.LoraConfig` keyword arguments, or ``None`` for full fine-tuning.
        scheduler: scheduler config overrides the recipe applies to the pipeline (``None``: the model's own).
            :meth:`apply_scheduler` applies them; a pipeline loaded from ``model`` does not have them.
        reward_funcs: the reward names the recipe was published with (see ``docs/rewards.md``).
        notes: what the preset does not express, or chose where the source is silent.
    """

    name: str
    model: str
    description: str
    source: str
    config: Mapping[str, Any]
    lora: Mapping[str, Any] | None = None
    scheduler: Mapping[str, Any] | None = None
    reward_funcs: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("config", "lora", "scheduler"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, MappingProxyType(dict(value)))

    def lora_config(self) -> LoraConfig | None:
        """The recipe's LoRA adapter as a :class:`~peft.LoraConfig` (``None`` for full fine-tuning)."""
        if self.lora is None:
            return None
        from peft import LoraConfig

        values = dict(self.lora)
        values["target_modules"] = list(values["target_modules"])
        return LoraConfig(**values)

    def apply_scheduler(self, pipeline: DiffusionPipeline) -> DiffusionPipeline:
        """Replace ``pipeline.scheduler`` by one with the recipe's overrides (a no-op without any); returns it."""
        if self.scheduler:
            scheduler = pipeline.scheduler
            pipeline.scheduler = type(scheduler).from_config(scheduler.config, **self.scheduler)
        return pipeline

    def cli_values(self) -> dict[str, Any]:
        """The recipe as ``trl-jagg train`` fields: model, rewards and LoRA (``ScriptArguments``) then config."""
        values: dict[str, Any] = {"model_name_or_path": self.model, "reward_funcs": list(self.reward_funcs)}
        if self.lora is not None:
            values |= {
                "use_peft": True,
                "lora_r": self.lora["r"],
                "lora_alpha": self.lora["lora_alpha"],
                "lora_target_modules": list(self.lora["target_modules"]),
            }
        return values | dict(self.config)

    def to_yaml(self) -> str:
        """The YAML config of ``trl-jagg train --config``, with the recipe's documentation as a header."""
        import yaml

        usage = (
            f"trl-jagg train --config examples/recipes/{self.name}.yaml --output_dir runs/{self.name} "
            "--dataset_name <prompts: Hub dataset or .txt/.json/.jsonl/.csv/.parquet file>"
        )
        lines = [
            f"{self.name}: {self.description}",
            f"Source: {self.source}",
            "Generated from trl_jagg/recipes.py by `python -m trl_jagg.recipes examples/recipes`: edit the preset "
            "there, not this file (tests/test_recipes.py fails on drift).",
            f"Usage: {usage}",
        ]
        if self.scheduler:
            lines.append(
                f"The scheduler override {dict(self.scheduler)} is not a config field: the CLI applies it because "
                f"`recipe: {self.name}` names the preset. Keep that line."
            )
        lines += [f"Note: {note}" for note in self.notes]
        header = "".join(
            "\n".join(textwrap.wrap(line, 117, initial_indent="# ", subsequent_indent="#   ")) + "\n" for line in lines
        )
        # `recipe:` makes the CLI start from the preset (and apply its scheduler override); the explicit values
        # below repeat it so that the file documents, and can edit, every one of them.
        values = {"recipe": self.name} | self.cli_values()
        return header + yaml.safe_dump(values, sort_keys=False, default_flow_style=False, width=119)


# Flow-Factory's default LoRA targets (src/flow_factory/models/z_image/z_image.py L70-75 and
# src/flow_factory/models/flux/flux2_klein.py L92-104): attention and feed-forward of every block.
_ZIMAGE_LORA_TARGETS = (*ATTENTION_PROJECTIONS[:4], "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
_FLUX2_KLEIN_LORA_TARGETS = (
    *ATTENTION_PROJECTIONS, "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "to_qkv_mlp_proj",
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
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 4,  # one rollout = one group of 16 per process
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
        lora={"r": 64, "lora_alpha": 128, "target_modules": tuple(lora_targets), "init_lora_weights": "gaussian"},
        reward_funcs=("pickscore",),  # rewards: pick_score
        notes=(
            f"Flow-Factory trains one SDE step per rollout, drawn from {sde_steps} (num_sde_steps: 1), which leaves "
            f"JAGG nothing to group; the preset trains all steps but the last ({steps - 1} of {steps}, JAGG groups "
            f"of W = {width}) instead.",
            "Flow-Factory aggregates several rewards with GDPO (advantage_aggregation); with the one reward of this "
            "preset that is the per-group normalisation of scale_rewards='group'.",
            "LoRA r 64 / alpha 128 on Flow-Factory's default targets (lora_rank, lora_alpha, target_modules: "
            "default). Add bf16=True on GPUs.",
        ),
    )


RECIPES: Mapping[str, Recipe] = MappingProxyType(
    {
        recipe.name: recipe
        for recipe in (
            Recipe(
                name="flow-grpo-sd35",
                model="stabilityai/stable-diffusion-3.5-medium",
                description="Flow-GRPO on SD3.5-Medium: LoRA, CFG 4.5, SDE a = 0.7, all steps but the last trained.",
                source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), SD3.5-M configs; JAGG spec section 5.",
                config={
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 10,
                    "guidance_scale": 4.5,  # SD3's classifier-free guidance (negative prompt "")
                    "sampler": "sde",
                    "noise_level": 0.7,
                    "num_generations": 24,
                    "per_device_train_batch_size": 8,
                    "gradient_accumulation_steps": 3,  # one rollout = 24 images = one prompt group per process
                    "train_timesteps": "all_but_last",
                    "beta": 0.04,
                    **_FLOW_GRPO_LOSS,
                    **_FLOW_GRPO_ADVANTAGES,
                    "scale_rewards": "batch",  # config/grpo.py: sample.global_std = True
                    "drop_zero_advantages": True,  # scripts/train_sd3.py masks zero-advantage samples
                    "max_sequence_length": 128,
                    "eval_num_inference_steps": 40,
                    **_FLOW_GRPO_EMA,
                    **_FLOW_GRPO_OPTIM,
                    **PAPER_JAGG,
                    "dtype": "bfloat16",
                },
                lora=_attention_lora(32),
                reward_funcs=("pickscore",),
                notes=(
                    "beta 0.04 is Flow-GRPO's GenEval/OCR value (its PickScore run uses 0.01).",
                    "Both CFG branches get gradients, as Flow-GRPO's train_sd3.py since its FLUX/Fast releases; its "
                    "July 2025 version detached the unconditional prediction: cfg_gradient='conditional' reproduces "
                    "that and halves the update's backward (its gradient is larger, about the CFG scale times when "
                    "the branches' Jacobians are alike: mind max_grad_norm).",
                    "Batch sizes are chosen so that every process samples whole groups of G = 24 for any number of "
                    "processes; Flow-GRPO samples 48 prompts per epoch on 32 GPUs. Add bf16=True on GPUs.",
                ),
            ),
            Recipe(
                name="flow-grpo-flux",
                model="black-forest-labs/FLUX.1-dev",
                description="Flow-GRPO on FLUX.1-dev: LoRA, embedded guidance 3.5, SDE a = 0.9, 6 steps.",
                source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), FLUX.1-dev config; JAGG spec section 5.",
                config={
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 6,
                    "guidance_scale": 3.5,  # Flux.1-dev's embedded (distilled) guidance, no negative branch
                    "sampler": "sde",
                    "noise_level": 0.9,
                    "num_generations": 24,
                    "per_device_train_batch_size": 4,
                    "gradient_accumulation_steps": 6,
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
                    "dtype": "bfloat16",
                },
                lora=_attention_lora(64),
                reward_funcs=("pickscore",),
                notes=(
                    "6 steps train 5: one JAGG group of W = 4, the remaining step exact.",
                    "Add bf16=True on GPUs.",
                ),
            ),
            Recipe(
                name="flow-grpo-qwenimage",
                model="Qwen/Qwen-Image",
                description="Flow-GRPO on Qwen-Image: LoRA, true CFG 4 with norm rescaling, SDE a = 1.2, FSDP.",
                source="Flow-GRPO (Liu et al. 2025, arXiv 2505.05470), Qwen-Image config; JAGG spec section 5.",
                config={
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 10,
                    "true_cfg_scale": 4.0,  # two backbone calls per step, rescaled to the conditional norm
                    "negative_prompt": " ",  # Qwen-Image's and Flow-GRPO's empty negative prompt
                    "sampler": "sde",
                    "noise_level": 1.2,
                    "num_generations": 16,
                    "per_device_train_batch_size": 4,
                    "gradient_accumulation_steps": 4,
                    "train_timesteps": "all_but_last",
                    "beta": 0.0,
                    **_FLOW_GRPO_LOSS,
                    **_FLOW_GRPO_ADVANTAGES,
                    "scale_rewards": "batch",
                    "max_sequence_length": 512,  # QwenImagePipeline's default, which Flow-GRPO keeps
                    "eval_num_inference_steps": 50,
                    **_FLOW_GRPO_OPTIM,
                    **PAPER_JAGG,
                    "dtype": "bfloat16",
                    "activation_checkpointing": True,
                },
                lora=_attention_lora(64),
                reward_funcs=("pickscore",),
                notes=(
                    "FSDP: launch with `accelerate launch --config_file <fsdp.yaml>` (FULL_SHARD, wrapping "
                    "QwenImageTransformerBlock; Flow-GRPO also offloads the optimizer state). Add bf16=True on GPUs.",
                    "The spec gives no LoRA size for Qwen-Image: r 64 / alpha 128 as for FLUX.1-dev, a model of "
                    "similar size.",
                    "Flow-GRPO's public Qwen-Image config samples SDE only in a 2-step window (the Fast variant): "
                    "set train_timesteps='sde_window', sde_window_size=2 to match it (a W = 4 group does not fit "
                    "in 2 steps, so JAGG then stays idle).",
                ),
            ),
            Recipe(
                name="flow-grpo-fast-flux",
                model="black-forest-labs/FLUX.1-dev",
                description="Flow-GRPO-Fast on FLUX.1-dev: SDE only in a 3-step window in the first half, ODE "
                "elsewhere; only the window is trained.",
                source="Flow-GRPO-Fast (Flow-GRPO repository, FLUX.1-dev fast config); JAGG spec section 5.",
                config={
                    "height": 512,
                    "width": 512,
                    "num_inference_steps": 6,
                    "guidance_scale": 3.5,
                    "sampler": "cps",
                    "noise_level": 0.8,
                    "clip_range": 1e-5,  # CPS log-probs have no 1/std^2: a smaller clip range
                    "adv_clip_max": 5.0,
                    "num_generations": 24,
                    "per_device_train_batch_size": 4,
                    "gradient_accumulation_steps": 6,
                    "train_timesteps": "sde_window",
                    "sde_window_size": 3,
                    "sde_window_max_start": 0,  # the window lies in the first half: steps 0-2 of 6
                    "beta": 0.0,
                    **_FLOW_GRPO_ADVANTAGES,
                    "scale_rewards": "group",  # pickscore_flux_fast: sample.global_std = False
                    "max_sequence_length": 128,
                    "eval_num_inference_steps": 28,
                    **_FLOW_GRPO_EMA,
                    **_FLOW_GRPO_OPTIM,
                    **PAPER_JAGG,
                    "jagg_group_size": 3,  # the whole window is one group: W = 4 would never fit in 3 steps
                    "dtype": "bfloat16",
                },
                lora=_attention_lora(64),
                reward_funcs=("pickscore",),
                notes=(
                    "jagg_group_size is 3, not the paper's 4: only the 3 window steps are trained and a group must "
                    "fill W steps, so with W = 4 JAGG would silently never run.",
                    "CPS sampler with a = 0.8 and clip range 1e-5 as in Flow-GRPO-Fast's FLUX config. For a longer "
                    "schedule, raise num_inference_steps and sde_window_max_start (<= steps // 2 - window) together.",
                    "Add bf16=True on GPUs.",
                ),
            ),
            Recipe(
                name="dancegrpo-flux",
                model="black-forest-labs/FLUX.1-dev",
                description="DanceGRPO on FLUX.1-dev: full fine-tuning, constant-eta SDE (eta 0.3), 720 px, 16 steps "
                "with shift 3, a random 60% of the first 15 steps trained per update.",
                source="DanceGRPO (Xue et al. 2025, arXiv 2505.07818), FLUX script; JAGG spec section 5.",
                config={
                    "height": 720,
                    "width": 720,
                    "num_inference_steps": 16,
                    "guidance_scale": 3.5,
                    "sampler": "dance",
                    "noise_level": 0.3,  # eta
                    "num_generations": 12,
                    "per_device_train_batch_size": 2,
                    "gradient_accumulation_steps": 6,
                    "train_timesteps": "random_but_last",  # its samples drop the last step
                    "train_timestep_fraction": 0.6,
                    "beta": 0.0,
                    "clip_range": 1e-4,
                    "adv_clip_max": 5.0,
                    # Per-group torch std (unbiased) + 1e-8, the model fed int(sigma * 1000) / 1000, one initial
                    # noise per group, prompts at FluxPipeline's 512 tokens (fastvideo/train_grpo_flux.py).
                    "scale_rewards": "group",
                    "advantage_std_ddof": 1,
                    "advantage_eps": 1e-8,
                    "quantize_timesteps": True,
                    "same_group_noise": True,
                    "max_sequence_length": 512,
                    "learning_rate": 1e-5,
                    "weight_decay": 1e-4,
                    "max_grad_norm": 1.0,
                    **PAPER_JAGG,
                    "dtype": "float32",  # full fine-tuning keeps float32 master weights
                    "activation_checkpointing": True,
                },
                scheduler={"shift": 3.0, "use_dynamic_shifting": False},
                reward_funcs=("hpsv2.1",),
                notes=(
                    "Shift 3 is a scheduler override (a static time shift sigma' = 3 sigma / (1 + 2 sigma) instead of "
                    "Flux's resolution-dependent one). The CLI applies it for `--recipe dancegrpo-flux`; in Python, "
                    "pass get_recipe('dancegrpo-flux').apply_scheduler(pipeline) to DDPOJaggTrainer.",
                    "Full fine-tuning of a 12B backbone needs FSDP (optimizer state sharded) and bf16=True mixed "
                    "precision on GPUs, as DanceGRPO trains.",
                    "EMA is off as in finetune_flux_grpo.sh; the 8-GPU script adds --use_ema --ema_decay 0.995 (kept "
                    "on the CPU) and --max_grad_norm 0.01: set ema_decay=0.995, ema_offload=True, max_grad_norm=0.01 "
                    "to follow it.",
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
