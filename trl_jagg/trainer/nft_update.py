"""The DiffusionNFT update stage (``objective="nft"``): the negative-aware flow-matching loss of one micro-batch,
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

import functools
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.jagg import EngineResult, JaggEngine, plan_groups
from trl_jagg.core.nft import forward_noised, nft_loss, optimality_probability
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.trainer.backward import backward, backward_unit
from trl_jagg.trainer.batch import resolved, rng_seed
from trl_jagg.trainer.old_policy import OldPolicy
from trl_jagg.trainer.placement import adapters_disabled

NFT_STATS = ("policy_loss", "kl", "old_deviation")


def nft_timesteps(args: GRPOJaggConfig, num_steps: int, *, micro_step: int, global_step: int) -> list[int]:
    """The rollout steps whose timesteps micro-batch ``micro_step`` trains: ``max(1, int(N *
    train_timestep_fraction))`` of the ``N``, drawn at random (identical on every process), high noise first."""
    count = max(1, int(num_steps * args.train_timestep_fraction))
    draw = random.Random(rng_seed(args.seed, global_step, -3, micro_step))
    return sorted(draw.sample(range(num_steps), count))


class NFTUpdateStage:
    """The NFT update of one micro-batch; writes its diagnostics (means over processes) into ``metrics``.

    Args:
        adapter: the model family's adapter (the guided backbone call).
        args: the run's configuration.
        accelerator: the Trainer's accelerator (backward, gradient sync, reductions).
        metrics: the trainer's metric lists, averaged at each log.
        old_policy: the sampling policy's weights (``v_old``).
        ref_transformer: a frozen copy of the base backbone for the KL term of full fine-tuning (``None`` with
            LoRA, whose reference is the backbone with its adapters disabled, or when ``beta`` is 0).
    """

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        metrics: dict[str, list[float]],
        *,
        old_policy: OldPolicy,
        ref_transformer: torch.nn.Module | None,
    ):
        self.adapter = adapter
        self.args = args
        self.accelerator = accelerator
        self.metrics = metrics
        self.old_policy = old_policy
        self.ref_transformer = ref_transformer

    def velocities(
        self,
        transformer: torch.nn.Module,
        inputs: Sequence[torch.Tensor],
        timesteps: Sequence[torch.Tensor],
        cond: Any,
    ) -> list[torch.Tensor]:
        """The guided velocities at the latents ``inputs[j]`` and backbone timesteps ``timesteps[j]`` (``(B,)``),
        under the ambient grad mode; several run as one backbone call, up to ``no_grad_batch_steps`` a call."""
        args = self.args
        size = inputs[0].shape[0]
        guidance = {
            "guidance_scale": args.guidance_scale,
            "true_cfg_scale": args.true_cfg_scale,
            "uncond_grad": args.cfg_gradient == "both",
        }
        per_call = args.no_grad_batch_steps or len(inputs)
        velocities: list[torch.Tensor] = []
        for begin in range(0, len(inputs), per_call):
            end = min(begin + per_call, len(inputs))
            x, t = torch.cat(list(inputs[begin:end])), torch.cat(list(timesteps[begin:end]))
            c = cond if end - begin == 1 else cond.select(torch.arange(size, device=x.device).repeat(end - begin))
            v = self.adapter.predict_velocity(transformer, x, t, c, **guidance)
            velocities.extend(v.split(size))
        return velocities

    def run(
        self, model: torch.nn.Module, batch: dict[str, Any], *, micro_step: int, global_step: int,
        accumulation_steps: int,
    ) -> EngineResult:  # fmt: skip
        """Noised inputs, old / reference velocities, loss and backward of micro-batch ``batch``; the gradients are
        accumulated into ``model``'s parameters, scaled for ``accumulation_steps`` micro-batches per step."""
        args = self.args
        x0, cond = batch["latents"][:, -1], batch["cond"]
        size = x0.shape[0]
        steps = nft_timesteps(args, batch["latents"].shape[1] - 1, micro_step=micro_step, global_step=global_step)
        sigmas = [float(batch["sigma_values"][k]) for k in steps]
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
        times = [batch["timesteps"][k].expand(size) for k in steps]
        unwrapped = self.accelerator.unwrap_model(model)
        with torch.no_grad(), self.old_policy.swapped_in():
            old = self.velocities(unwrapped, inputs, times, cond)
        ref = self.reference_velocities(unwrapped, inputs, times, cond) if args.beta > 0 else None
        optimality = optimality_probability(resolved(batch["advantages"]), args.adv_clip_max)
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)

        def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:
            out = nft_loss(
                v, old[i], x0, inputs[i], torch.full((size,), sigmas[i], device=x0.device), optimality,
                nft_beta=args.nft_beta, adv_clip_max=args.adv_clip_max,
                ref_velocity=None if ref is None else ref[i], kl_beta=args.beta,
            )  # fmt: skip
            stats["policy_loss"].append(out.policy_loss)
            stats["kl"].append(out.kl)
            stats["old_deviation"].append(out.old_deviation)
            return out.loss

        engine = JaggEngine(
            lambda i: self.velocities(model, [inputs[i]], [times[i]], cond)[0],
            loss_fn,
            functools.partial(backward, self.accelerator),
            sync_context=lambda is_last: backward_unit(self.accelerator, model, is_last),
            loss_weight=1.0 / (len(steps) * accumulation_steps),
            no_grad_velocities_fn=lambda idx: self.velocities(
                model, [inputs[i] for i in idx], [times[i] for i in idx], cond
            ),
            endpoint_backward=args.jagg_endpoint_backward,
        )
        result = engine.run(groups)
        names = ["loss", *(f"nft/{n}" for n in NFT_STATS)]
        local = [torch.tensor(result.loss, device=self.accelerator.device, dtype=torch.float32)]
        local += [torch.stack(stats[n]).float().mean() for n in NFT_STATS]
        means = self.accelerator.gather(torch.stack(local)[None]).mean(dim=0).tolist()
        for name, value in zip(names, means):
            self.metrics[name].append(value)
        self.metrics["nft/optimality_mean"].append(float(optimality.float().mean()))
        self.metrics["jagg/groups_jagg"].append(result.num_jagg_groups)
        self.metrics["jagg/groups_exact"].append(result.num_exact_groups)
        self.metrics["jagg/backward_calls"].append(result.num_backward)
        self.metrics["jagg/no_grad_forwards"].append(result.num_no_grad_forwards)
        return result

    @torch.no_grad()
    def reference_velocities(
        self, transformer: torch.nn.Module, inputs: Sequence[torch.Tensor], times: Sequence[torch.Tensor], cond: Any
    ) -> list[torch.Tensor]:
        """The base model's velocities for the KL term: the frozen copy (full fine-tuning) or the backbone with its
        adapters disabled (LoRA)."""
        if self.ref_transformer is not None:
            return self.velocities(self.ref_transformer, inputs, times, cond)
        with adapters_disabled(transformer):
            return self.velocities(transformer, inputs, times, cond)
