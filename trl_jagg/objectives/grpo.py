"""GRPO's update stage (``objective="grpo"``): the PPO-clipped policy gradient of one micro-batch's denoising steps
through the JAGG engine.

The trainer calls :meth:`GRPOUpdateStage.run` once per micro-batch and gets the loss and the engine's counts back:
which steps are trained, their grouping (``jagg_frac``, ``"auto"`` routing by gradient probes), the rollout's cached
velocities and the KL reference's means live here; the backbone calls, the engine and the metrics are
:class:`~trl_jagg.objectives.update.UpdateStage`'s.
"""

from __future__ import annotations

import functools
import random
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.grpo import guard_log_ratio, kl_to_reference, ppo_step_loss
from trl_jagg.core.jagg import EngineResult, StepGroup, gradient_diagnostic, leading_jagg_fraction, plan_groups
from trl_jagg.core.sampling import sampler_step
from trl_jagg.objectives.update import StageInputs, TrainedStepFunctions, UpdateStage
from trl_jagg.trainer.batch import RolloutBatch, resolved, rng_seed, velocity_key
from trl_jagg.trainer.guards import any_process

STEP_STATS = ("policy_loss", "kl", "ratio_mean", "clip_fraction", "approx_kl")
STAT_NAMES = {"ratio_mean": "ratio"}
"""The logged name of a step statistic where it differs."""


def trained_steps(
    args: GRPOJaggConfig, batch: RolloutBatch, *, micro_step: int, global_step: int,
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
        steps = batch.stochastic_steps
    else:
        # DanceGRPO never trains the last step (its Gaussian is the narrowest): `random_but_last`.
        candidates = [k for k in range(num_steps - (args.train_timesteps == "random_but_last")) if trainable(k)]
        count = min(len(candidates), max(1, round(args.train_timestep_fraction * len(candidates))))
        return sorted(random.Random(rng_seed(args.seed, global_step, -2, micro_step)).sample(candidates, count))
    return [k for k in steps if trainable(k)]


class GRPOUpdateStage(UpdateStage):
    """GRPO's update of one micro-batch (:class:`~trl_jagg.objectives.update.UpdateStage` says what it gets)."""

    def setup(self, inputs: StageInputs) -> None:
        """The dropout flag, the routing state, the reference cache; warns of a CFG gradient setting without CFG."""
        args, adapter = self.args, self.adapter
        self.has_dropout = inputs.has_dropout
        if args.cfg_gradient == "conditional" and not adapter.needs_negative_prompt(
            args.guidance_scale, args.true_cfg_scale
        ):
            warnings.warn(
                f"GRPOJaggConfig.cfg_gradient='conditional' does nothing: {adapter.pipeline_class.__name__} runs no "
                f"unconditional branch at guidance_scale={args.guidance_scale}, true_cfg_scale={args.true_cfg_scale}. "
                "Drop it, or turn classifier-free guidance on.",
                UserWarning,
                stacklevel=3,  # the trainer's construction: this stage's setup, built by it
            )
        # `jagg_frac="auto"`: the routed fraction and the optimizer step of the probe that set it.
        self.routed_frac: float | None = None
        self.last_probe_step: int | None = None
        # The KL reference's means of each micro-batch's steps (step -> (B, ...)), computed once per micro-batch:
        # they depend only on the rollout's states and the frozen reference. Dropped with the micro-batch.
        self.reference_cache: weakref.WeakKeyDictionary[RolloutBatch, dict[int, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    # ------------------------------------------------------------------ backbone calls
    @staticmethod
    def step_inputs(batch: RolloutBatch, steps: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The backbone inputs of denoising steps ``steps``: the rollout's latents at each and its timestep, ``(B,)``."""
        return [batch.latents[:, k] for k in steps], [batch.timesteps[k].expand(batch.size) for k in steps]

    def velocities(self, transformer: torch.nn.Module, batch: RolloutBatch, steps: Sequence[int]) -> list:
        """The guided velocities of denoising steps ``steps`` of the micro-batch at the rollout's states, under the
        ambient grad mode (:meth:`~trl_jagg.objectives.update.UpdateStage.backbone_velocities`)."""
        return self.backbone_velocities(transformer, *self.step_inputs(batch, steps), batch.cond)

    @torch.no_grad()
    def reference_means(
        self, transformer: torch.nn.Module, batch: RolloutBatch, trained: list[int]
    ) -> dict[int, torch.Tensor]:
        """Means of the reference model's step Gaussians (base weights) for the KL term, the backbone calls of all
        trained steps batched; ``transformer`` is the unwrapped trained backbone."""
        args, sigmas = self.args, batch.sigmas
        velocities = self.reference_velocities(transformer, *self.step_inputs(batch, trained), batch.cond)
        return {
            k: sampler_step(
                v,
                batch.latents[:, k],
                sigmas[k],
                sigmas[k + 1],
                sampler=args.sampler,
                noise_level=args.noise_level,
                sigma_max=sigmas[1],
            ).mean  # fmt: skip
            for k, v in zip(trained, velocities)
        }

    def kept_reference_means(
        self, transformer: torch.nn.Module, batch: RolloutBatch, trained: list[int]
    ) -> dict[int, torch.Tensor]:
        """:meth:`reference_means` of ``trained``, each step's computed once per micro-batch and kept in
        :attr:`reference_cache` for the later updates of the same micro-batch (``num_iterations > 1``, other random
        trained steps): identical values."""
        kept = self.reference_cache.setdefault(batch, {})
        missing = [k for k in trained if k not in kept]
        if missing:
            kept.update(self.reference_means(transformer, batch, missing))
        return {k: kept[k] for k in trained}

    def cached_velocities(
        self, model: torch.nn.Module, batch: RolloutBatch, trained: list[int], global_step: int
    ) -> tuple[dict[int, torch.Tensor], bool]:
        """The rollout's velocities of the trained steps (keyed by trained index) that the backbone computed on this
        update's forward path (dtype, autocast, this micro-batch's shape), the others left out (the engine
        recomputes them), and whether the engine must correct them (``jagg_cache_mode="checked"`` or
        ``"corrected"`` after an optimizer step since the rollout). ``"recompute"`` uses none after that step,
        ``"stale"`` all as they are."""
        args = self.args
        if not args.jagg_cache_velocities or batch.velocities is None or (model.training and self.has_dropout):
            return {}, False
        off_policy = global_step != batch.velocity_step
        if off_policy and args.jagg_cache_mode == "recompute":
            return {}, False
        # The engine's velocity of one step runs the backbone on the micro-batch's latents of that step.
        key = velocity_key(self.adapter.dtype, self.accelerator.device.type, tuple(batch.latents[:, 0].shape))
        keys = batch.velocity_keys
        cache = {i: batch.velocities[:, k] for i, k in enumerate(trained) if keys[k] == key}
        return cache, off_policy and args.jagg_cache_mode in ("checked", "corrected")

    # ------------------------------------------------------------------ the engine's inputs
    def step_functions(self, model: torch.nn.Module, batch: RolloutBatch, trained: list[int]) -> TrainedStepFunctions:
        """The engine's inputs for micro-batch ``batch`` trained on steps ``trained``, ``model`` being the backbone
        (wrapped by DDP or not) whose forward the backward runs through."""
        args = self.args
        latents, old_log_probs, advantages = batch.latents, batch.log_probs, batch.advantages
        sigmas = batch.sigmas
        unwrapped = self.accelerator.unwrap_model(model)
        ref_means = self.kept_reference_means(unwrapped, batch, trained) if args.beta > 0 else {}

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
                    old_mean = step_at(k, batch.velocities[:, k]).mean
                log_ratio = guard_log_ratio(step.log_prob, old_log_probs[:, k], step.mean, old_mean, step.std)
            # Resolved here, after the KL reference and the step's forward (overlap_rewards: they overlap the wait).
            out = ppo_step_loss(
                step.log_prob, old_log_probs[:, k], resolved(advantages), args.epsilon, kl=kl, beta=args.beta,
                clip_range_high=args.epsilon_high, log_ratio=log_ratio,
                policy_weight=1.0 / (sigmas[k] - sigmas[k + 1]) if args.step_gradient_reweighting else 1.0,
            )  # fmt: skip
            if record:
                for key in STEP_STATS:
                    stats[key][i] = getattr(out, key)
            return out.loss

        functions = TrainedStepFunctions(
            velocity_fn=lambda i: self.velocities(model, batch, [trained[i]])[0],
            loss_fn=loss_fn,
            no_grad_velocities_fn=lambda steps: self.velocities(model, batch, [trained[i] for i in steps]),
            probe_loss_fn=functools.partial(loss_fn, record=False),
            trained=trained,
        )
        stats = functions.stats
        return functions

    def steps_to_train(self, batch: RolloutBatch, *, micro_step: int, global_step: int) -> list[int]:
        """:func:`trained_steps` of those a trained expert denoises (Wan2.2 training one of its two experts: no
        trained weight acts on the frozen one's steps, so they would add a zero gradient for a backbone call)."""
        times = batch.timesteps.tolist()
        return trained_steps(
            self.args, batch, micro_step=micro_step, global_step=global_step,
            trainable=lambda k: self.adapter.expert_of(times[k]) in self.adapter.trained_experts,
        )  # fmt: skip

    def plan(
        self, batch: RolloutBatch, trained: list[int], *, use_jagg: bool, jagg_frac: float = 1.0
    ) -> list[StepGroup]:
        """The trained steps grouped and routed (exact or JAGG) from their flow times. A group never straddles an
        expert switch (Wan2.2): JAGG interpolates one network's Jacobian, so a group starts at each switch."""
        args = self.args
        times = batch.timesteps.tolist()
        experts = [self.adapter.expert_of(times[k]) for k in trained]
        return plan_groups(
            [batch.sigma_values[k] for k in trained],
            args.jagg_group_size if use_jagg else 1,
            jagg_frac if use_jagg else 0.0,
            args.jagg_mode if use_jagg else "exact",
            breaks=[i for i in range(1, len(trained)) if experts[i] != experts[i - 1]],
        )

    # ------------------------------------------------------------------ routing
    def auto_jagg_frac(
        self, model: torch.nn.Module, batch: RolloutBatch, fns: TrainedStepFunctions, global_step: int
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
        if due and args.beta == 0 and not any_process(self.accelerator, bool(resolved(batch.advantages).any())):
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
        self, model: torch.nn.Module, rollouts: Sequence[RolloutBatch], threshold: float, *, micro_step: int,
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

    # ------------------------------------------------------------------ one micro-batch
    def run(
        self, model: torch.nn.Module, batch: RolloutBatch, *, micro_step: int, global_step: int,
        accumulation_steps: int,
    ) -> EngineResult:  # fmt: skip
        """Forward, loss and backward of micro-batch ``batch`` (the ``micro_step``-th of the run) at optimizer step
        ``global_step``; the gradients are accumulated into ``model``'s parameters, scaled for
        ``accumulation_steps`` micro-batches per optimizer step."""
        if batch.dropped_frac is not None:
            self.metrics["zero_advantage/dropped_frac"].append(batch.dropped_frac)
            if batch.size == 0:  # every sample had a zero advantage (single process only)
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
        result = self.run_engine(
            model, self.plan(batch, trained, use_jagg=args.use_jagg, jagg_frac=jagg_frac), fns,
            accumulation_steps=accumulation_steps, cached_velocities=cache, correct_cached=correct,
        )  # fmt: skip
        # The per-step diagnostics stay on the device until here: one sync per update, not five per step.
        counters = {"jagg/cached_velocities": result.num_cached, "jagg/corrected_velocities": result.num_corrected}
        if correct and args.jagg_cache_mode == "checked":
            counters |= {
                "jagg/cache_rejected": result.num_rejected,
                "jagg/cache_sensitivity": result.cache_sensitivity,
            }
        self.record(result, {STAT_NAMES.get(n, n): fns.stats[n] for n in fns.stats}, counters=counters)
        return result
