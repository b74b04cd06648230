"""Each objective's check of its own config fields (called by the objective field group of
:class:`~trl_jagg.GRPOJaggConfig` through the registry, :mod:`trl_jagg.config.objective_registry`): allowed values, and the settings it cannot serve. Torch-free
but for the core's tables of allowed values."""

from __future__ import annotations

from typing import Any

from trl_jagg.config.reporting import fail
from trl_jagg.core.awm import AWM_TIMESTEP_STRATEGIES, AWM_WEIGHTINGS
from trl_jagg.core.nft import OLD_POLICY_DECAY_TYPES

NFT_BETA_MAX = 1e3
"""The largest ``nft_beta`` accepted: the implicit policies scale the velocity difference by it, and beyond this the
loss overflows (DiffusionNFT uses 1 or 0.1)."""


def check_nft_fields(config: Any) -> None:
    """DiffusionNFT's fields."""
    if not 0 < config.nft_beta <= NFT_BETA_MAX:
        fail(
            "nft_beta",
            f"is {config.nft_beta}",
            f"Use a positive guidance strength up to {NFT_BETA_MAX:g} (DiffusionNFT: 1, or 0.1).",
        )
    if config.nft_decay_type not in OLD_POLICY_DECAY_TYPES:
        fail("nft_decay_type", f"is {config.nft_decay_type!r}", f"Use one of {sorted(OLD_POLICY_DECAY_TYPES)}.")


def _check_ramp(config: Any, ceiling_name: str, rate_name: str) -> None:
    if not 0 <= getattr(config, ceiling_name) < 1:
        fail(ceiling_name, f"is {getattr(config, ceiling_name)!r}", "Use a decay in [0, 1) (the authors': 0.3).")
    if not getattr(config, rate_name) >= 0:
        fail(rate_name, f"is {getattr(config, rate_name)!r}", "Use a rate >= 0 per optimizer step (0.001).")


def _check_one_step_per_rollout(config: Any, objective: str, why: str) -> None:
    # steps_per_generation defaults to gradient_accumulation_steps (resolved later in __post_init__).
    per_rollout = config.steps_per_generation or config.gradient_accumulation_steps
    steps = per_rollout * config.num_iterations / config.gradient_accumulation_steps
    if steps != 1:
        fail(
            "steps_per_generation",
            f"is {per_rollout} with gradient_accumulation_steps={config.gradient_accumulation_steps} "
            f"and num_iterations={config.num_iterations}: {steps:g} optimizer steps per rollout with "
            f"objective={objective!r}",
            f"{why} Set steps_per_generation = gradient_accumulation_steps and num_iterations=1.",
        )


def check_awm_fields(config: Any) -> None:
    """AWM's fields; the update is on-policy (one optimizer step per rollout, as every published AWM config)."""
    if config.awm_weighting not in AWM_WEIGHTINGS:
        fail("awm_weighting", f"is {config.awm_weighting!r}", f"Use one of {AWM_WEIGHTINGS}.")
    if config.awm_timestep_strategy not in AWM_TIMESTEP_STRATEGIES:
        fail("awm_timestep_strategy", f"is {config.awm_timestep_strategy!r}", f"Use one of {AWM_TIMESTEP_STRATEGIES}.")
    if not config.awm_ghuber_power > 0:
        fail("awm_ghuber_power", f"is {config.awm_ghuber_power!r}", "Use a power > 0 (the authors': 0.25).")
    if not 0 < config.awm_timestep_fraction <= 1:
        fail("awm_timestep_fraction", f"is {config.awm_timestep_fraction!r}", "Use a fraction in (0, 1] (0.9).")
    start = 0 if config.awm_timestep_strategy == "discrete" else 1
    room = int(config.num_inference_steps * config.awm_timestep_fraction) - start
    if not 1 <= config.awm_num_train_timesteps <= max(room, 1):
        fail(
            "awm_num_train_timesteps",
            f"is {config.awm_num_train_timesteps!r}: its strata must fit the {room} rollout indices that "
            f"num_inference_steps={config.num_inference_steps} and awm_timestep_fraction="
            f"{config.awm_timestep_fraction} leave",
            "Lower it, or raise awm_timestep_fraction.",
        )
    if config.awm_advantage_max is not None and not config.awm_advantage_max > 0:
        fail("awm_advantage_max", f"is {config.awm_advantage_max!r}", "Use a scale > 0 (1.0), or None.")
    if not config.awm_ema_kl_beta >= 0:
        fail("awm_ema_kl_beta", f"is {config.awm_ema_kl_beta!r}", "Use a coefficient >= 0.")
    _check_ramp(config, "awm_kl_ema_decay", "awm_kl_ema_ramp_rate")
    _check_one_step_per_rollout(
        config, "awm", "AWM's old log-probability is the rollout policy's; this update computes it on-policy."
    )


def check_dgpo_fields(config: Any) -> None:
    """DGPO's fields; a micro-batch must hold whole prompt groups (the group logits couple their images)."""
    if not config.dgpo_beta > 0:
        fail("dgpo_beta", f"is {config.dgpo_beta!r}", "Use a preference scale > 0 (the authors': 10 or 100).")
    if not 0 <= config.dgpo_trunc_steps < config.num_inference_steps:
        fail(
            "dgpo_trunc_steps",
            f"is {config.dgpo_trunc_steps!r}",
            f"Use an index in [0, num_inference_steps={config.num_inference_steps}).",
        )
    if not 1 <= config.dgpo_num_train_timesteps <= config.dgpo_trunc_steps + 1:
        fail(
            "dgpo_num_train_timesteps",
            f"is {config.dgpo_num_train_timesteps!r}",
            f"Use 1 to dgpo_trunc_steps + 1 = {config.dgpo_trunc_steps + 1} distinct timesteps.",
        )
    if not config.dgpo_sample_old_policy_after >= 0:
        fail("dgpo_sample_old_policy_after", f"is {config.dgpo_sample_old_policy_after!r}", "Use a step >= 0.")
    _check_ramp(config, "dgpo_old_policy_decay", "dgpo_old_policy_ramp_rate")
    if config.per_device_train_batch_size % config.num_generations:
        fail(
            "per_device_train_batch_size",
            f"is {config.per_device_train_batch_size} with num_generations={config.num_generations} and "
            "objective='dgpo'",
            "DGPO's loss couples the images of a prompt group: use a multiple of num_generations, so that every "
            "micro-batch holds whole groups.",
        )
    if (config.dgpo_clip_dsm or config.dgpo_clip_kl) and config.epsilon < 1e-3:
        fail(
            "epsilon",
            f"is {config.epsilon:g} with objective='dgpo': DGPO clips the ratio of denoising errors, "
            "exp(old_dsm - dsm), which this range would clip almost everywhere",
            "Use the authors' 5e-2 (1e-2 for GenEval and OCR), or dgpo_clip_dsm=False.",
        )
