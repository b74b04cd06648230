"""DiffusionNFT's update stage (``objective="nft"``): the negative-aware flow-matching loss of one micro-batch,
through the JAGG engine.

The rollout (deterministic ODE, sampled by the old policy) leaves its clean latents ``x0`` and advantages. For each
trained timestep ``t`` (a random ``train_timestep_fraction`` of the rollout's schedule, as the reference code draws
them) the sample is noised along the forward process, ``x_t = (1 - t) x0 + t eps``; the old policy's velocity (and
the reference model's, for the KL term) come from no-grad backbone calls, the trained policy's from a call with
graph, and :func:`~trl_jagg.core.nft.nft_loss` combines them.

**JAGG across timesteps** (``use_jagg``): the trained timesteps of a sample, high noise first, are grouped by
``jagg_group_size`` as the GRPO steps are, and a group shares one ``eps`` per sample, so its inputs ``x_t`` lie on
one line in ``t``. The engine then forwards the group's two endpoint timesteps with graph, the others without, and
takes one joint backward with the interpolated Jacobian (``docs/jagg.md``): exact at ``W = 2`` and for a velocity
linear in ``(x, t)``, against NFT with the same shared noise. Without JAGG every timestep is its own group and draws
its own ``eps`` (the reference code's ``randn_like`` per timestep): the same expected gradient, another estimator, so
JAGG is never exact against it (``trl-jagg bench nft-jagg`` reports both).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.jagg import EngineResult, plan_groups
from trl_jagg.core.nft import forward_noised, nft_loss, optimality_probability
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.objectives.update import StageInputs, TrainedStepFunctions, UpdateStage
from trl_jagg.trainer.batch import RolloutBatch, resolved, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy

NFT_STATS = ("policy_loss", "kl", "old_deviation")


def nft_timesteps(args: GRPOJaggConfig, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
    """The rollout steps whose timesteps micro-batch ``micro_step`` trains: ``max(1, int(N *
    train_timestep_fraction))`` of the ``N``, drawn at random (identical on every process), high noise first."""
    count = max(1, int(num_steps * args.train_timestep_fraction))
    draw = random.Random(rng_seed(args.seed, global_step, -3, micro_step))
    return sorted(draw.sample(range(num_steps), count))


class NFTUpdateStage(UpdateStage):
    """DiffusionNFT's update of one micro-batch (:class:`~trl_jagg.objectives.update.UpdateStage` says what it
    gets). Its state is the old policy (``v_old``), which samples the rollouts and follows the trained weights."""

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        metrics: dict[str, list[float]],
        inputs: StageInputs,
    ):
        super().__init__(adapter, args, accelerator, metrics, inputs)
        self.old_policy = OldPolicy(inputs.trainable_parameters, args.nft_decay_type, accelerator=accelerator)

    # ------------------------------------------------------------------ the old policy
    def before_rollout(self, global_step: int) -> None:
        """The old policy follows the trained weights after each rollout's updates."""
        self.old_policy.follow(global_step)

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        """The old policy samples the rollouts."""
        return self.old_policy.swapped_in()

    def save_state(self, directory: str, *, checkpoint_step: int, write: bool) -> None:
        self.old_policy.save(directory, checkpoint_step=checkpoint_step, write=write)

    def load_state(self, checkpoint: str) -> None:
        self.old_policy.load(checkpoint)

    # ------------------------------------------------------------------ one micro-batch
    def run(
        self, model: torch.nn.Module, batch: RolloutBatch, *, micro_step: int, global_step: int,
        accumulation_steps: int,
    ) -> EngineResult:  # fmt: skip
        """Noised inputs, old / reference velocities, loss and backward of micro-batch ``batch``; the gradients are
        accumulated into ``model``'s parameters, scaled for ``accumulation_steps`` micro-batches per step."""
        args = self.args
        x0, cond = batch.latents[:, -1], batch.cond
        size = x0.shape[0]
        steps = nft_timesteps(args, batch.latents.shape[1] - 1, micro_step=micro_step, global_step=global_step)
        sigmas = [float(batch.sigma_values[k]) for k in steps]
        groups = plan_groups(
            sigmas,
            args.jagg_group_size if args.use_jagg else 1,
            args.jagg_frac if args.use_jagg else 0.0,
            args.jagg_mode if args.use_jagg else "exact",
        )
        # One eps per sample and group: the group's inputs x_t lie on one line in t (JAGG's linear regime).
        generator = torch.Generator().manual_seed(rng_seed(args.seed, global_step, -4, micro_step))
        inputs: list[torch.Tensor] = [torch.empty(0)] * len(steps)
        for group in groups:
            noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0)
            for i in group.steps:
                inputs[i] = forward_noised(x0, noise, torch.full((size,), sigmas[i], device=x0.device))
        times = [batch.timesteps[k].expand(size) for k in steps]
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad(), self.old_policy.swapped_in():
            old = self.backbone_velocities(unwrapped, inputs, times, cond)
        ref = self.reference_velocities(unwrapped, inputs, times, cond) if args.beta > 0 else None
        optimality = optimality_probability(resolved(batch.advantages), args.adv_clip_max)

        def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:
            out = nft_loss(
                v, old[i], x0, inputs[i], torch.full((size,), sigmas[i], device=x0.device), optimality,
                nft_beta=args.nft_beta, adv_clip_max=args.adv_clip_max,
                ref_velocity=None if ref is None else ref[i], kl_beta=args.beta,
            )  # fmt: skip
            for name in NFT_STATS:
                functions.stats[name][i] = getattr(out, name)
            return out.loss

        functions = TrainedStepFunctions(
            velocity_fn=lambda i: self.backbone_velocities(model, [inputs[i]], [times[i]], cond)[0],
            loss_fn=loss_fn,
            no_grad_velocities_fn=lambda idx: self.backbone_velocities(
                model, [inputs[i] for i in idx], [times[i] for i in idx], cond
            ),
            trained=steps,
        )
        result = self.run_engine(model, groups, functions, accumulation_steps=accumulation_steps)
        self.record(
            result,
            {f"nft/{name}": functions.stats[name] for name in NFT_STATS},
            extra={"nft/optimality_mean": float(optimality.float().mean())},
        )
        return result
