"""AWM's update stage (``objective="awm"``): Advantage Weighted Matching (Xue et al., arXiv 2509.25050) on the
rollout's clean samples, through the JAGG engine.

At each trained timestep (the authors' strata of rollout indices, :func:`~trl_jagg.core.awm.awm_train_timestep_indices`)
the samples are noised along the forward process and :func:`~trl_jagg.core.awm.awm_loss` weights their flow-matching
log-probability by the advantage. The update is on-policy, as the authors' configs run it (one optimizer step per
rollout, the ratio 1 in value; the config refuses more): no old velocity is computed. The KL terms take the base
model's velocity (``beta``) and the KL-EMA's (``awm_ema_kl_beta``), a copy of the trained weights that follows them
after each rollout with the ramped decay :func:`~trl_jagg.core.awm.linear_ramp_decay`. docs/peers/awm.md says how it
follows the authors' code and Flow-Factory's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trl_jagg.core.awm import AWMLossOutput, awm_loss, awm_train_timestep_indices, linear_ramp_decay
from trl_jagg.objectives.forward import ForwardInputs, ForwardProcessStage
from trl_jagg.objectives.update import StageInputs
from trl_jagg.trainer.batch import resolved, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy


@dataclass
class AWMPrepared:
    """A micro-batch's no-grad inputs of the AWM loss."""

    advantages: torch.Tensor
    ref: list[torch.Tensor] | None
    ema: list[torch.Tensor] | None


class AWMUpdateStage(ForwardProcessStage):
    """AWM's update of one micro-batch (:class:`~trl_jagg.objectives.update.UpdateStage` says what it gets). Its
    state is the KL-EMA copy of the trained weights."""

    stat_prefix = "awm/"
    stat_names = ("policy_loss", "kl", "ema_kl", "ratio", "clip_fraction")

    def setup(self, inputs: StageInputs) -> None:
        """The KL-EMA copy of the trained weights."""
        args = self.args
        decay = functools.partial(linear_ramp_decay, ceiling=args.awm_kl_ema_decay, rate=args.awm_kl_ema_ramp_rate)
        self.kl_ema = OldPolicy(inputs.trainable_parameters, decay, objective="awm", accelerator=self.accelerator)

    # ------------------------------------------------------------------ the KL-EMA
    def followed_weights(self) -> OldPolicy:
        """The KL-EMA, following the trained weights after each rollout's update (train_sd3_awm.py L1409-1418)."""
        return self.kl_ema

    # ------------------------------------------------------------------ the loss
    def trained_steps(self, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
        """One rollout index per stratum, shared by the micro-batch's images (an empty stratum's index can repeat
        its neighbour's: trained once)."""
        args = self.args
        generator = torch.Generator().manual_seed(rng_seed(args.seed, global_step, -5, micro_step))
        indices = awm_train_timestep_indices(
            num_steps, args.awm_num_train_timesteps, args.awm_timestep_fraction, args.awm_timestep_strategy,
            generator=generator,
        )  # fmt: skip
        return sorted(set(indices.tolist()))

    def prepare(self, model: torch.nn.Module, forward: ForwardInputs) -> AWMPrepared:
        args = self.args
        unwrapped = self.accelerator.unwrap_model(model)
        ref = ema = None
        if args.beta > 0:
            ref = self.reference_velocities(unwrapped, forward.inputs, forward.times, forward.batch.cond)
        if args.awm_ema_kl_beta > 0:
            with torch.no_grad(), self.kl_ema.swapped_in():
                ema = self.velocities_at(unwrapped, forward)
        return AWMPrepared(resolved(forward.batch.advantages), ref, ema)

    def step_loss(
        self, velocity: torch.Tensor, i: int, forward: ForwardInputs, prepared: AWMPrepared
    ) -> AWMLossOutput:
        args = self.args
        return awm_loss(
            velocity, forward.x0, forward.noises[i], forward.t(i), prepared.advantages,
            clip_range=args.epsilon, clip_range_high=args.epsilon_high, adv_clip_max=args.adv_clip_max,
            advantage_max=args.awm_advantage_max, weighting=args.awm_weighting, ghuber_power=args.awm_ghuber_power,
            ref_velocity=None if prepared.ref is None else prepared.ref[i], kl_beta=args.beta,
            ema_velocity=None if prepared.ema is None else prepared.ema[i], ema_kl_beta=args.awm_ema_kl_beta,
        )  # fmt: skip
