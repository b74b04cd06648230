"""DiffusionNFT's update stage (``objective="nft"``): the negative-aware flow-matching loss of one micro-batch,
through the JAGG engine.

The rollout (deterministic ODE, sampled by the old policy) leaves its clean latents ``x0`` and advantages. For each
trained timestep ``t`` (a random ``train_timestep_fraction`` of the rollout's schedule, as the reference code draws
them) the sample is noised along the forward process; the old policy's velocity (and the reference model's, for the
KL term) come from no-grad backbone calls, the trained policy's from a call with graph, and
:func:`~trl_jagg.core.nft.nft_loss` combines them. JAGG across timesteps: :mod:`trl_jagg.objectives.forward`
(``trl-jagg bench nft-jagg`` reports it against the per-timestep noise of the reference code).
"""

from __future__ import annotations

import contextlib
import functools
import random
from dataclasses import dataclass

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.nft import NFTLossOutput, nft_loss, old_policy_decay, optimality_probability
from trl_jagg.objectives.forward import ForwardInputs, ForwardProcessStage
from trl_jagg.objectives.update import StageInputs
from trl_jagg.trainer.batch import resolved, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy


def nft_timesteps(args: GRPOJaggConfig, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
    """The rollout steps whose timesteps micro-batch ``micro_step`` trains: ``max(1, int(N *
    train_timestep_fraction))`` of the ``N``, drawn at random (identical on every process), high noise first."""
    count = max(1, int(num_steps * args.train_timestep_fraction))
    draw = random.Random(rng_seed(args.seed, global_step, -3, micro_step))
    return sorted(draw.sample(range(num_steps), count))


@dataclass
class NFTPrepared:
    """A micro-batch's no-grad inputs of the NFT loss."""

    old: list[torch.Tensor]
    ref: list[torch.Tensor] | None
    optimality: torch.Tensor


class NFTUpdateStage(ForwardProcessStage):
    """DiffusionNFT's update of one micro-batch (:class:`~trl_jagg.objectives.update.UpdateStage` says what it
    gets). Its state is the old policy (``v_old``), which samples the rollouts and follows the trained weights."""

    stat_prefix = "nft/"
    stat_names = ("policy_loss", "kl", "old_deviation")

    def setup(self, inputs: StageInputs) -> None:
        """The old policy."""
        args = self.args
        decay = functools.partial(old_policy_decay, decay_type=args.nft_decay_type)
        self.old_policy = OldPolicy(inputs.trainable_parameters, decay, objective="nft", accelerator=self.accelerator)

    # ------------------------------------------------------------------ the old policy
    def followed_weights(self) -> OldPolicy:
        return self.old_policy

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        """The old policy samples the rollouts."""
        return self.old_policy.swapped_in()

    # ------------------------------------------------------------------ the loss
    def trained_steps(self, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
        return nft_timesteps(self.args, num_steps, micro_step=micro_step, global_step=global_step)

    def prepare(self, model: torch.nn.Module, forward: ForwardInputs) -> NFTPrepared:
        args = self.args
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad(), self.old_policy.swapped_in():
            old = self.velocities_at(unwrapped, forward)
        ref = None
        if args.beta > 0:
            ref = self.reference_velocities(unwrapped, forward.inputs, forward.times, forward.batch.cond)
        return NFTPrepared(old, ref, optimality_probability(resolved(forward.batch.advantages), args.adv_clip_max))

    def step_loss(
        self, velocity: torch.Tensor, i: int, forward: ForwardInputs, prepared: NFTPrepared
    ) -> NFTLossOutput:
        args = self.args
        return nft_loss(
            velocity, prepared.old[i], forward.x0, forward.inputs[i], forward.t(i), prepared.optimality,
            nft_beta=args.nft_beta, adv_clip_max=args.adv_clip_max,
            ref_velocity=None if prepared.ref is None else prepared.ref[i], kl_beta=args.beta,
        )  # fmt: skip

    def extra_metrics(self, forward: ForwardInputs, prepared: NFTPrepared) -> dict[str, float]:
        return {"nft/optimality_mean": float(prepared.optimality.float().mean())}
