"""The update stage: the GRPO update of one micro-batch through the JAGG engine.

The trainer calls :meth:`UpdateStage.run` once per micro-batch and gets the loss and the engine's counts back:
which steps are trained, their grouping (``jagg_frac``, ``"auto"`` routing by gradient probes), the rollout's cached
velocities, the KL reference's means, the backbone calls and the backward units (DDP ``no_sync``, DeepSpeed's
deferred step) all live here.
"""

from __future__ import annotations

import contextlib
import functools
import random
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.grpo import guard_log_ratio, kl_to_reference, ppo_step_loss
from trl_jagg.core.jagg import (
    EngineResult,
    JaggEngine,
    StepGroup,
    gradient_diagnostic,
    leading_jagg_fraction,
    plan_groups,
)
from trl_jagg.core.sampling import sampler_step
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.trainer.backward import backward, backward_unit
from trl_jagg.trainer.batch import resolved, rng_seed, velocity_key
from trl_jagg.trainer.guards import any_process, largest_over_processes
from trl_jagg.trainer.placement import adapters_disabled, reshard

STEP_STATS = ("policy_loss", "kl", "ratio_mean", "clip_fraction", "approx_kl")


def trained_steps(
    args: GRPOJaggConfig, batch: dict[str, Any], *, micro_step: int, global_step: int,
    trainable: Callable[[int], bool] = lambda k: True,
) -> list[int]:  # fmt: skip
    """Which denoising steps the update of micro-batch ``micro_step`` trains, identical on every process: of the
    steps ``trainable`` accepts (Wan2.2 training one expert: those it denoises), so that a random draw never comes
    up empty when some step is trainable (every micro-batch then takes a backward, the synced one included)."""
    num_steps = args.num_inference_steps
    if args.train_timesteps == "all":
        steps = range(num_steps)
    elif args.train_timesteps == "all_but_last":
        steps = range(num_steps - 1)
    elif args.train_timesteps == "sde_window":
        steps = batch["stochastic_steps"]
    else:
        # DanceGRPO never trains the last step (its Gaussian is the narrowest): `random_but_last`.
        candidates = [k for k in range(num_steps - (args.train_timesteps == "random_but_last")) if trainable(k)]
        count = min(len(candidates), max(1, round(args.train_timestep_fraction * len(candidates))))
        return sorted(random.Random(rng_seed(args.seed, global_step, -2, micro_step)).sample(candidates, count))
    return [k for k in steps if trainable(k)]


@dataclass
class StepFunctions:
    """What the engine needs for one micro-batch: the trained steps, the backbone call and the per-step loss of the
    ``i``-th trained step, the batched no-grad backbone call, and the per-step diagnostics the loss fills."""

    trained: list[int]
    velocity_fn: Callable[[int], torch.Tensor]
    loss_fn: Callable[[int, torch.Tensor], torch.Tensor]
    no_grad_velocities_fn: Callable[[Sequence[int]], list[torch.Tensor]]
    stats: dict[str, dict[int, torch.Tensor]]
    """Per diagnostic, its value at each trained step (by index): a step's loss taken again (its velocity
    recomputed after the velocity cache's check) replaces the first."""
    probe_loss_fn: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    """``loss_fn`` without recording diagnostics (the velocity cache's check probes the loss at velocities no step
    trains with)."""


class UpdateStage:
    """The update of one micro-batch; writes its diagnostics (means over processes) into ``metrics``.

    Args:
        adapter: the model family's adapter (the guided backbone call).
        args: the run's configuration.
        accelerator: the Trainer's accelerator (backward, gradient sync, reductions).
        metrics: the trainer's metric lists, averaged at each log.
        ref_transformer: a frozen copy of the base backbone for the KL term of full fine-tuning (``None`` with
            LoRA, whose reference is the backbone with its adapters disabled, or when ``beta`` is 0).
        has_dropout: whether the backbone has active dropout (a recomputed velocity then differs from the rollout's,
            so the velocity cache is not used in training mode).
    """

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        metrics: dict[str, list[float]],
        *,
        ref_transformer: torch.nn.Module | None,
        has_dropout: bool,
    ):
        self.adapter = adapter
        self.args = args
        self.accelerator = accelerator
        self.metrics = metrics
        self.ref_transformer = ref_transformer
        self.has_dropout = has_dropout
        if args.cfg_gradient == "conditional" and not adapter.needs_negative_prompt(
            args.guidance_scale, args.true_cfg_scale
        ):
            warnings.warn(
                f"GRPOJaggConfig.cfg_gradient='conditional' does nothing: {adapter.pipeline_class.__name__} runs no "
                f"unconditional branch at guidance_scale={args.guidance_scale}, true_cfg_scale={args.true_cfg_scale}. "
                "Drop it, or turn classifier-free guidance on.",
                UserWarning,
                stacklevel=2,
            )
        # `jagg_frac="auto"`: the routed fraction and the optimizer step of the probe that set it.
        self.routed_frac: float | None = None
        self.last_probe_step: int | None = None

    # ------------------------------------------------------------------ backbone calls
    def velocities(self, transformer: torch.nn.Module, batch: dict[str, Any], steps: Sequence[int]) -> list:
        """The guided velocities of denoising steps ``steps`` of the micro-batch, under the ambient grad mode.

        Several steps run as one backbone call over their concatenated micro-batches, up to ``no_grad_batch_steps``
        steps a call (the memory cap); the results are those of one call per step up to float rounding."""
        args = self.args
        latents, timesteps, cond = batch["latents"], batch["timesteps"], batch["cond"]
        size = latents.shape[0]
        guidance = {
            "guidance_scale": args.guidance_scale,
            "true_cfg_scale": args.true_cfg_scale,
            "uncond_grad": args.cfg_gradient == "both",
        }
        per_call = args.no_grad_batch_steps or len(steps)
        velocities = []
        for begin in range(0, len(steps), per_call):
            chunk = list(steps[begin : begin + per_call])
            if len(chunk) == 1:
                k = chunk[0]
                x, t, c = latents[:, k], timesteps[k].expand(size), cond
            else:
                x = latents[:, chunk].transpose(0, 1).flatten(0, 1)  # step-major: step j is rows j*size..
                t = timesteps[chunk].repeat_interleave(size)
                c = cond.select(torch.arange(size, device=latents.device).repeat(len(chunk)))
            v = self.adapter.predict_velocity(transformer, x, t, c, **guidance)
            velocities.extend(v.unflatten(0, (len(chunk), size)).unbind(0))
        return velocities

    @torch.no_grad()
    def reference_means(
        self, transformer: torch.nn.Module, batch: dict[str, Any], trained: list[int]
    ) -> dict[int, torch.Tensor]:
        """Means of the reference model's step Gaussians (base weights) for the KL term, the backbone calls of all
        trained steps batched (see :meth:`velocities`); ``transformer`` is the unwrapped trained backbone."""
        args = self.args
        context = contextlib.nullcontext()
        if self.ref_transformer is not None:
            transformer = self.ref_transformer
        else:
            context = adapters_disabled(transformer)
        with context:
            velocities = self.velocities(transformer, batch, trained)
        reshard(transformer)
        sigmas = batch["sigmas"]
        return {
            k: sampler_step(
                v,
                batch["latents"][:, k],
                sigmas[k],
                sigmas[k + 1],
                sampler=args.sampler,
                noise_level=args.noise_level,
                sigma_max=sigmas[1],
            ).mean  # fmt: skip
            for k, v in zip(trained, velocities)
        }

    def kept_reference_means(
        self, transformer: torch.nn.Module, batch: dict[str, Any], trained: list[int]
    ) -> dict[int, torch.Tensor]:
        """:meth:`reference_means` of ``trained``, each step's computed once per micro-batch: they depend only on the
        rollout's states and the frozen reference, so they are kept in ``batch["reference_means"]`` for the later
        updates of the same micro-batch (``num_iterations > 1``, other random trained steps), identical values."""
        kept = batch.setdefault("reference_means", {})
        missing = [k for k in trained if k not in kept]
        if missing:
            kept.update(self.reference_means(transformer, batch, missing))
        return {k: kept[k] for k in trained}

    def cached_velocities(
        self, model: torch.nn.Module, batch: dict[str, Any], trained: list[int], global_step: int
    ) -> tuple[dict[int, torch.Tensor], bool]:
        """The rollout's velocities of the trained steps (keyed by trained index) that the backbone computed on this
        update's forward path (dtype, autocast, this micro-batch's shape), the others left out (the engine
        recomputes them), and whether the engine must correct them (``jagg_cache_mode="checked"`` or
        ``"corrected"`` after an optimizer step since the rollout). ``"recompute"`` uses none after that step,
        ``"stale"`` all as they are."""
        args = self.args
        if not args.jagg_cache_velocities or "velocities" not in batch or (model.training and self.has_dropout):
            return {}, False
        off_policy = global_step != batch["velocity_step"]
        if off_policy and args.jagg_cache_mode == "recompute":
            return {}, False
        # The engine's velocity of one step runs the backbone on the micro-batch's latents of that step.
        key = velocity_key(self.adapter.dtype, self.accelerator.device.type, tuple(batch["latents"][:, 0].shape))
        keys = batch["velocity_keys"]
        cache = {i: batch["velocities"][:, k] for i, k in enumerate(trained) if keys[k] == key}
        return cache, off_policy and args.jagg_cache_mode in ("checked", "corrected")

    # ------------------------------------------------------------------ the engine's inputs
    def step_functions(self, model: torch.nn.Module, batch: dict[str, Any], trained: list[int]) -> StepFunctions:
        """The engine's inputs for micro-batch ``batch`` trained on steps ``trained``, ``model`` being the backbone
        (wrapped by DDP or not) whose forward the backward runs through."""
        args = self.args
        latents, old_log_probs, advantages = batch["latents"], batch["log_probs"], batch["advantages"]
        sigmas = batch["sigmas"]
        unwrapped = self.accelerator.unwrap_model(model)
        ref_means = self.kept_reference_means(unwrapped, batch, trained) if args.beta > 0 else {}
        stats: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)

        def step_at(k: int, v: torch.Tensor):
            return sampler_step(
                v, latents[:, k], sigmas[k], sigmas[k + 1], sampler=args.sampler, noise_level=args.noise_level,
                sigma_max=sigmas[1], prev_sample=latents[:, k + 1],
            )  # fmt: skip

        def loss_fn(i: int, v: torch.Tensor, record: bool = True) -> torch.Tensor:
            k = trained[i]
            step = step_at(k, v)
            kl = None
            if k in ref_means:
                kl = kl_to_reference(step.mean, ref_means[k], step.std if args.kl_std == "step" else step.noise_scale)
            log_ratio = None
            if args.ratio_normalization:  # GRPO-Guard: the rollout's mean from the velocity it recorded
                with torch.no_grad():
                    old_mean = step_at(k, batch["velocities"][:, k]).mean
                log_ratio = guard_log_ratio(step.log_prob, old_log_probs[:, k], step.mean, old_mean, step.std)
            # Resolved here, after the KL reference and the step's forward (overlap_rewards: they overlap the wait).
            out = ppo_step_loss(
                step.log_prob, old_log_probs[:, k], resolved(advantages), args.clip_range, kl=kl, beta=args.beta,
                clip_range_high=args.epsilon_high, log_ratio=log_ratio,
                policy_weight=1.0 / (sigmas[k] - sigmas[k + 1]) if args.step_gradient_reweighting else 1.0,
            )  # fmt: skip
            if record:
                for key in STEP_STATS:
                    stats[key][i] = getattr(out, key)
            return out.loss

        return StepFunctions(
            trained=trained,
            velocity_fn=lambda i: self.velocities(model, batch, [trained[i]])[0],
            loss_fn=loss_fn,
            no_grad_velocities_fn=lambda steps: self.velocities(model, batch, [trained[i] for i in steps]),
            stats=stats,
            probe_loss_fn=functools.partial(loss_fn, record=False),
        )

    def steps_to_train(self, batch: dict[str, Any], *, micro_step: int, global_step: int) -> list[int]:
        """:func:`trained_steps` of those a trained expert denoises (Wan2.2 training one of its two experts: no
        trained weight acts on the frozen one's steps, so they would add a zero gradient for a backbone call)."""
        times = batch["timesteps"].tolist()
        return trained_steps(
            self.args, batch, micro_step=micro_step, global_step=global_step,
            trainable=lambda k: self.adapter.expert_of(times[k]) in self.adapter.trained_experts,
        )  # fmt: skip

    def plan(
        self, batch: dict[str, Any], trained: list[int], *, use_jagg: bool, jagg_frac: float = 1.0
    ) -> list[StepGroup]:
        """The trained steps grouped and routed (exact or JAGG) from their flow times. A group never straddles an
        expert switch (Wan2.2): JAGG interpolates one network's Jacobian, so a group starts at each switch."""
        args = self.args
        times = batch["timesteps"].tolist()
        experts = [self.adapter.expert_of(times[k]) for k in trained]
        return plan_groups(
            [batch["sigma_values"][k] for k in trained],
            args.jagg_group_size if use_jagg else 1,
            jagg_frac if use_jagg else 0.0,
            args.jagg_mode if use_jagg else "exact",
            breaks=[i for i in range(1, len(trained)) if experts[i] != experts[i - 1]],
        )

    # ------------------------------------------------------------------ routing
    def auto_jagg_frac(
        self, model: torch.nn.Module, batch: dict[str, Any], fns: StepFunctions, global_step: int
    ) -> float:
        """``jagg_frac="auto"``: every ``jagg_probe_steps`` optimizer steps, the JAGG-vs-exact gradient cosine of
        every full group on this micro-batch; the leading groups with cosine >= ``jagg_cos_threshold`` are routed
        to JAGG until the next probe. Cosines are averaged over processes, so every process routes alike. A probe due
        on a zero-gradient micro-batch (all advantages 0, no KL) moves to the next micro-batch; meanwhile the last
        routing holds (exact backward before the first probe)."""
        args = self.args
        due = self.last_probe_step is None or global_step - self.last_probe_step >= args.jagg_probe_steps
        # Without a KL term, a micro-batch whose advantages are all 0 (constant rewards) has a zero gradient: its
        # cosines would read 1.0 and route every group to JAGG. The probe waits for a micro-batch with a gradient.
        if due and args.beta == 0 and not any_process(self.accelerator, bool(resolved(batch["advantages"]).any())):
            self.metrics["jagg/probe_deferred"].append(1.0)
            return self.routed_frac if self.routed_frac is not None else 0.0
        if due:
            # The unwrapped module: autograd.grad through a DDP wrapper would leave its reducer waiting.
            unwrapped = self.accelerator.unwrap_model(model)
            params = [p for p in unwrapped.parameters() if p.requires_grad]
            groups = self.plan(batch, fns.trained, use_jagg=True)
            diagnostics = gradient_diagnostic(
                [g for g in groups if g.is_joint],
                lambda i: self.velocities(unwrapped, batch, [fns.trained[i]])[0],
                fns.loss_fn,
                params,
                mode=args.jagg_mode,
            )
            for values in fns.stats.values():
                values.clear()  # the probe's loss evaluations are not the update's diagnostics
            cosines = [d.cosine for d in diagnostics]
            if cosines:
                device = self.accelerator.device
                cosines = self.accelerator.reduce(torch.tensor(cosines, device=device), "mean").tolist()
            self.routed_frac = leading_jagg_fraction(cosines, len(groups), args.jagg_cos_threshold)
            self.last_probe_step = global_step
            for i, c in enumerate(cosines):
                self.metrics[f"jagg/probe_cosine/group_{i}"].append(c)
            self.metrics["jagg/auto_frac"].append(self.routed_frac)
        return self.routed_frac

    def calibrate(
        self, model: torch.nn.Module, rollouts: Sequence[dict[str, Any]], threshold: float, *, micro_step: int,
        global_step: int,
    ) -> dict[str, Any]:  # fmt: skip
        """The JAGG-vs-exact gradient cosine and norm ratio of every full group, averaged over ``rollouts``, and the
        ``jagg_frac`` of the paper's rule (the share of leading groups whose cosine is >= ``threshold``). Every
        full group is evaluated as if routed to JAGG; no gradient is applied."""
        params = [p for p in model.parameters() if p.requires_grad]
        per_group: list[list[float]] = []
        norm_ratios: list[list[float]] = []
        for batch in rollouts:
            trained = self.steps_to_train(batch, micro_step=micro_step, global_step=global_step)
            fns = self.step_functions(model, batch, trained)
            groups = self.plan(batch, trained, use_jagg=True)
            diagnostics = gradient_diagnostic(
                [g for g in groups if g.is_joint], fns.velocity_fn, fns.loss_fn, params, mode=self.args.jagg_mode
            )
            per_group.append([d.cosine for d in diagnostics])
            norm_ratios.append([d.norm_ratio for d in diagnostics])
        cosines = torch.tensor(per_group).mean(dim=0).tolist()
        return {
            "group_cosine": cosines,
            "group_norm_ratio": torch.tensor(norm_ratios).mean(dim=0).tolist(),
            "threshold": threshold,
            "jagg_frac": leading_jagg_fraction(cosines, len(groups), threshold),
            "jagg_group_size": self.args.jagg_group_size,
        }

    def largest_over_processes(self, value: float) -> float:
        """``value``'s largest over the processes (every process calls it at the same point)."""
        return largest_over_processes(self.accelerator, value)

    # ------------------------------------------------------------------ one micro-batch
    def run(
        self, model: torch.nn.Module, batch: dict[str, Any], *, micro_step: int, global_step: int,
        accumulation_steps: int,
    ) -> EngineResult:  # fmt: skip
        """Forward, loss and backward of micro-batch ``batch`` (the ``micro_step``-th of the run) at optimizer step
        ``global_step``; the gradients are accumulated into ``model``'s parameters, scaled for
        ``accumulation_steps`` micro-batches per optimizer step."""
        if "dropped_frac" in batch:
            self.metrics["zero_advantage/dropped_frac"].append(batch["dropped_frac"])
            if batch["latents"].shape[0] == 0:  # every sample had a zero advantage (single process only)
                return EngineResult()
        args = self.args
        trained = self.steps_to_train(batch, micro_step=micro_step, global_step=global_step)
        if not trained:  # every trained step is a frozen expert's (Wan2.2's train_experts): nothing to update
            return EngineResult()
        fns = self.step_functions(model, batch, trained)
        jagg_frac = args.jagg_frac
        if args.use_jagg and jagg_frac == "auto":
            jagg_frac = self.auto_jagg_frac(model, batch, fns, global_step)
        cache, correct = self.cached_velocities(model, batch, trained, global_step) if args.use_jagg else ({}, False)
        engine = JaggEngine(
            fns.velocity_fn,
            fns.loss_fn,
            functools.partial(backward, self.accelerator),
            sync_context=lambda is_last: backward_unit(self.accelerator, model, is_last),
            loss_weight=1.0 / (len(trained) * accumulation_steps),
            cached_velocities=cache,
            no_grad_velocities_fn=fns.no_grad_velocities_fn,
            endpoint_backward=args.jagg_endpoint_backward,
            correct_cached=correct,
            cache_tolerance=args.jagg_cache_tolerance if args.jagg_cache_mode == "checked" else None,
            probe_loss_fn=fns.probe_loss_fn,
            agree=self.largest_over_processes if self.accelerator.num_processes > 1 else None,
        )
        result = engine.run(self.plan(batch, trained, use_jagg=args.use_jagg, jagg_frac=jagg_frac))

        # The per-step diagnostics stay on the device until here: one sync per update, not five per step. The loss
        # and diagnostics are per process: log every process's mean, averaged (as TRL's GRPOTrainer does).
        names = ["loss", *fns.stats]
        local = [torch.tensor(result.loss, device=self.accelerator.device, dtype=torch.float32)]
        local += [torch.stack(list(fns.stats[n].values())).float().mean() for n in fns.stats]
        means = self.accelerator.gather(torch.stack(local)[None]).mean(dim=0).tolist()
        for name, value in zip(names, means):
            self.metrics[name if name != "ratio_mean" else "ratio"].append(value)
        self.metrics["jagg/groups_jagg"].append(result.num_jagg_groups)
        self.metrics["jagg/groups_exact"].append(result.num_exact_groups)
        self.metrics["jagg/backward_calls"].append(result.num_backward)
        self.metrics["jagg/cached_velocities"].append(result.num_cached)
        self.metrics["jagg/corrected_velocities"].append(result.num_corrected)
        if correct and args.jagg_cache_mode == "checked":
            self.metrics["jagg/cache_rejected"].append(result.num_rejected)
            self.metrics["jagg/cache_sensitivity"].append(result.cache_sensitivity)
        self.metrics["jagg/no_grad_forwards"].append(result.num_no_grad_forwards)
        return result
