"""DGPO's update stage (``objective="dgpo"``): Direct Group Preference Optimization (Luo, Hu and Tang, arXiv
2510.08425), the group-level DPO loss on the rollout's clean samples, through the JAGG engine.

At each trained timestep (``dgpo_num_train_timesteps`` distinct indices of ``0..dgpo_trunc_steps``, drawn once per
optimizer step and shared by its micro-batches) every image of a prompt group is noised with the group's ``eps``
(``dgpo_shared_noise``) and :func:`~trl_jagg.core.dgpo.dgpo_loss` weights its denoising error by the advantage and
the sigmoid of the group's detached preference logit against the frozen base model. A micro-batch holds whole
groups (the config refuses otherwise), so the logits need no cross-process sum. The old policy, an EMA of the
trained weights (:func:`~trl_jagg.core.dgpo.old_policy_decay`), gives the PPO-style clip and samples the rollouts
after ``dgpo_sample_old_policy_after`` optimizer steps. docs/peers/dgpo.md says how it follows the authors' code and
Flow-Factory's.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.core.awm import linear_ramp_decay
from trl_jagg.core.dgpo import DGPOLossOutput, dgpo_loss, dgpo_train_timestep_indices
from trl_jagg.objectives.forward import ForwardInputs, ForwardProcessStage
from trl_jagg.objectives.update import StageInputs
from trl_jagg.trainer.batch import resolved, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy


@dataclass
class DGPOPrepared:
    """A micro-batch's no-grad inputs of the DGPO loss."""

    advantages: torch.Tensor
    group_ids: torch.Tensor
    ref: list[torch.Tensor]
    old: list[torch.Tensor] | None


class DGPOUpdateStage(ForwardProcessStage):
    """DGPO's update of one micro-batch (:class:`~trl_jagg.objectives.update.UpdateStage` says what it gets). Its
    state is the old policy (the clip's reference, and the sampler after ``dgpo_sample_old_policy_after``)."""

    stat_prefix = "dgpo/"
    stat_names = ("policy_loss", "kl", "dsm", "group_weight", "clip_fraction")

    def setup(self, inputs: StageInputs) -> None:
        """The old policy."""
        args = self.args
        decay = functools.partial(
            linear_ramp_decay, ceiling=args.dgpo_old_policy_decay, rate=args.dgpo_old_policy_ramp_rate
        )
        self.old_policy = OldPolicy(inputs.trainable_parameters, decay, objective="dgpo", accelerator=self.accelerator)
        self.global_step = 0

    # ------------------------------------------------------------------ the old policy
    def followed_weights(self) -> OldPolicy:
        """The old policy, following the trained weights after each optimizer step (train_sd3_dgpo.py L1174-1177)."""
        return self.old_policy

    def before_rollout(self, global_step: int) -> None:
        super().before_rollout(global_step)
        self.global_step = global_step  # when the old policy starts sampling

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        """The trained weights sample, then the old policy from ``dgpo_sample_old_policy_after`` steps on."""
        if self.global_step >= self.args.dgpo_sample_old_policy_after:
            return self.old_policy.swapped_in()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ the loss
    def guidance(self) -> dict[str, Any]:
        """The loss's velocities without classifier-free guidance, as the authors' (``cfg`` off in training,
        whatever the rollout's guidance): a CFG model's guidance scale drops to 1; an embedded guidance (FLUX) stays,
        being an input of the conditional branch."""
        args = self.args
        cfg_by_scale = self.adapter.needs_negative_prompt(args.guidance_scale, 1.0)
        return {
            "guidance_scale": 1.0 if cfg_by_scale else args.guidance_scale,
            "true_cfg_scale": 1.0,
            "uncond_grad": False,
        }

    def trained_steps(self, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
        """Distinct indices of ``0..dgpo_trunc_steps``, the same for every micro-batch of the optimizer step."""
        args = self.args
        generator = torch.Generator().manual_seed(rng_seed(args.seed, global_step, -6))
        indices = dgpo_train_timestep_indices(args.dgpo_trunc_steps, args.dgpo_num_train_timesteps, generator)
        return sorted(indices.tolist())

    def noise_like(self, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One ``eps`` per prompt group (the authors' ``use_shared_noise``), else per image."""
        if not self.args.dgpo_shared_noise:
            return super().noise_like(x0, generator)
        size = self.args.num_generations
        shared = torch.randn((x0.shape[0] // size, *x0.shape[1:]), generator=generator, dtype=torch.float32)
        return shared.repeat_interleave(size, dim=0).to(x0)

    def prepare(self, model: torch.nn.Module, forward: ForwardInputs) -> DGPOPrepared:
        args = self.args
        unwrapped = self.accelerator.unwrap_model(model)
        ref = self.reference_velocities(unwrapped, forward.inputs, forward.times, forward.batch.cond)
        old = None
        if args.dgpo_clip_dsm or args.dgpo_clip_kl:
            with torch.no_grad(), self.old_policy.swapped_in():
                old = self.velocities_at(unwrapped, forward)
        size = forward.x0.shape[0]
        group_ids = torch.arange(size, device=forward.x0.device) // args.num_generations
        return DGPOPrepared(resolved(forward.batch.advantages), group_ids, ref, old)

    def step_loss(
        self, velocity: torch.Tensor, i: int, forward: ForwardInputs, prepared: DGPOPrepared
    ) -> DGPOLossOutput:
        args = self.args
        return dgpo_loss(
            velocity, forward.x0, forward.noises[i], prepared.advantages, prepared.group_ids, prepared.ref[i],
            num_groups=forward.x0.shape[0] // args.num_generations, group_size=args.num_generations,
            dpo_beta=args.dgpo_beta, adv_clip_max=args.adv_clip_max,
            old_velocity=None if prepared.old is None else prepared.old[i], clip_range=args.epsilon,
            clip_dsm=args.dgpo_clip_dsm, clip_kl=args.dgpo_clip_kl,
            kl_ref_velocity=prepared.ref[i] if args.beta > 0 else None, kl_beta=args.beta,
        )  # fmt: skip
