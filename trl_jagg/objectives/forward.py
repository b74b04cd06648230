"""What the forward-process objectives share (DiffusionNFT, AWM, DGPO): they train on the rollout's clean samples
``x0``, noised again along the forward process ``x_t = (1 - t) x0 + t eps`` at some of the rollout's timesteps,
and keep no trajectory.

:class:`ForwardProcessStage` runs one micro-batch: the objective picks the trained timesteps
(:meth:`~ForwardProcessStage.trained_steps`), the noise is drawn, the objective computes what its loss needs without
a graph (:meth:`~ForwardProcessStage.prepare`: old-policy, reference or EMA velocities) and the loss of one timestep
(:meth:`~ForwardProcessStage.step_loss`); the engine call and the metrics are :class:`UpdateStage`'s.

**JAGG across timesteps** (``use_jagg``): the trained timesteps of a sample, high noise first, are grouped by
``jagg_group_size`` as the GRPO steps are, and a group shares one ``eps`` per sample, so its inputs ``x_t`` lie on
one line in ``t``. The engine then forwards the group's two endpoint timesteps with graph, the others without, and
takes one joint backward with the interpolated Jacobian (``docs/jagg.md``): exact at ``W = 2`` and for a velocity
linear in ``(x, t)``, against the same loss with the same shared noise. Without JAGG every timestep is its own group
and draws its own ``eps``: the same expected gradient, another estimator, so JAGG is never exact against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.core.jagg import EngineResult, plan_groups
from trl_jagg.core.nft import forward_noised
from trl_jagg.objectives.update import TrainedStepFunctions, UpdateStage
from trl_jagg.trainer.batch import RolloutBatch, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy


@dataclass
class ForwardInputs:
    """One micro-batch's forward-process inputs, for the objective's :meth:`~ForwardProcessStage.prepare` and
    :meth:`~ForwardProcessStage.step_loss` (index ``i``: the ``i``-th trained timestep).

    Attributes:
        batch: the micro-batch.
        x0: its clean samples ``(B, ...)``.
        steps: the trained rollout steps, high noise first.
        sigmas: their flow times ``t``.
        noises: the ``eps`` of each trained timestep (shared within a JAGG group).
        inputs: the noised latents ``x_t`` of each.
        times: the backbone timesteps of each, ``(B,)``.
    """

    batch: RolloutBatch
    x0: torch.Tensor
    steps: list[int]
    sigmas: list[float]
    noises: list[torch.Tensor]
    inputs: list[torch.Tensor]
    times: list[torch.Tensor]

    def t(self, i: int) -> torch.Tensor:
        """The flow time of trained timestep ``i`` for every sample, ``(B,)``."""
        return torch.full((self.x0.shape[0],), self.sigmas[i], device=self.x0.device)


class ForwardProcessStage(UpdateStage):
    """The update of a forward-process objective (see the module docstring). Subclasses set :attr:`stat_prefix` and
    :attr:`stat_names` and write :meth:`trained_steps`, :meth:`prepare` and :meth:`step_loss`."""

    stat_prefix: str = ""
    """Prefix of the logged diagnostics (``"nft/"``)."""
    stat_names: tuple[str, ...] = ()
    """The attributes of :meth:`step_loss`'s output logged per trained timestep (``loss`` is its total)."""

    def followed_weights(self) -> OldPolicy:
        """The objective's state: the copy of the trained weights that follows them before each rollout
        (DiffusionNFT's and DGPO's old policy, AWM's KL-EMA), checkpointed with the run."""
        raise NotImplementedError

    def before_rollout(self, global_step: int) -> None:
        """The copy follows the trained weights after each rollout's updates (once per optimizer step)."""
        self.followed_weights().follow(global_step)

    def save_state(self, directory: str, *, checkpoint_step: int, write: bool) -> None:
        self.followed_weights().save(directory, checkpoint_step=checkpoint_step, write=write)

    def load_state(self, checkpoint: str) -> None:
        self.followed_weights().load(checkpoint)

    def trained_steps(self, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
        """The rollout steps (of ``num_steps``) whose timesteps micro-batch ``micro_step`` trains, identical on
        every process, high noise first."""
        raise NotImplementedError

    def prepare(self, model: torch.nn.Module, forward: ForwardInputs) -> Any:
        """What the losses need without a graph (old, reference, EMA velocities), computed once per micro-batch."""
        raise NotImplementedError

    def step_loss(self, velocity: torch.Tensor, i: int, forward: ForwardInputs, prepared: Any) -> Any:
        """The loss output of trained timestep ``i`` at the trained policy's ``velocity`` (with ``loss`` and the
        :attr:`stat_names`)."""
        raise NotImplementedError

    def extra_metrics(self, forward: ForwardInputs, prepared: Any) -> dict[str, float]:
        """Per-micro-batch metrics beside the per-timestep ones."""
        return {}

    def noise_like(self, x0: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One draw of ``eps`` for the micro-batch: independent per sample."""
        return torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0)

    def forward_inputs(self, batch: RolloutBatch, *, micro_step: int, global_step: int) -> tuple:
        """The micro-batch's trained timesteps, their JAGG groups and their noised inputs."""
        args = self.args
        x0 = batch.latents[:, -1]
        size = x0.shape[0]
        steps = self.trained_steps(batch.latents.shape[1] - 1, micro_step=micro_step, global_step=global_step)
        sigmas = [float(batch.sigma_values[k]) for k in steps]
        groups = plan_groups(
            sigmas,
            args.jagg_group_size if args.use_jagg else 1,
            args.jagg_frac if args.use_jagg else 0.0,
            args.jagg_mode if args.use_jagg else "exact",
        )
        # One eps per sample and group: the group's inputs x_t lie on one line in t (JAGG's linear regime).
        generator = torch.Generator().manual_seed(rng_seed(args.seed, global_step, -4, micro_step))
        noises: list[torch.Tensor] = [torch.empty(0)] * len(steps)
        inputs: list[torch.Tensor] = [torch.empty(0)] * len(steps)
        for group in groups:
            noise = self.noise_like(x0, generator)
            for i in group.steps:
                noises[i] = noise
                inputs[i] = forward_noised(x0, noise, torch.full((size,), sigmas[i], device=x0.device))
        times = [batch.timesteps[k].expand(size) for k in steps]
        return ForwardInputs(batch, x0, steps, sigmas, noises, inputs, times), groups

    def velocities_at(
        self, transformer: torch.nn.Module, forward: ForwardInputs, indices: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """The guided velocities of ``transformer`` at the trained timesteps ``indices`` (all by default)."""
        indices = range(len(forward.steps)) if indices is None else indices
        return self.backbone_velocities(
            transformer, [forward.inputs[i] for i in indices], [forward.times[i] for i in indices], forward.batch.cond
        )

    def run(
        self, model: torch.nn.Module, batch: RolloutBatch, *, micro_step: int, global_step: int,
        accumulation_steps: int,
    ) -> EngineResult:  # fmt: skip
        """Noised inputs, the objective's no-grad velocities, loss and backward of micro-batch ``batch``; the
        gradients are accumulated into ``model``'s parameters, scaled for ``accumulation_steps`` micro-batches."""
        forward, groups = self.forward_inputs(batch, micro_step=micro_step, global_step=global_step)
        prepared = self.prepare(model, forward)

        def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:
            out = self.step_loss(v, i, forward, prepared)
            for name in self.stat_names:
                functions.stats[name][i] = getattr(out, name)
            return out.loss

        functions = TrainedStepFunctions(
            velocity_fn=lambda i: self.velocities_at(model, forward, [i])[0],
            loss_fn=loss_fn,
            no_grad_velocities_fn=lambda indices: self.velocities_at(model, forward, indices),
            trained=forward.steps,
        )
        result = self.run_engine(model, groups, functions, accumulation_steps=accumulation_steps)
        self.record(
            result,
            {f"{self.stat_prefix}{name}": functions.stats[name] for name in self.stat_names},
            extra=self.extra_metrics(forward, prepared),
        )
        return result
