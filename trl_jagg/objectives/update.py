"""What every objective's update stage shares: the guided backbone calls, the reference model, the JAGG engine with
the run's settings, the metrics of one micro-batch, and the hooks of an objective's own state.

An objective's stage (``trl_jagg/objectives/<name>.py``) subclasses :class:`UpdateStage` and writes
:meth:`UpdateStage.run`: which timesteps it trains, their inputs and its loss; the engine call and the metrics come
from here. The trainer calls the state hooks (:meth:`~UpdateStage.before_rollout`,
:meth:`~UpdateStage.sampling_weights`, :meth:`~UpdateStage.save_state`, :meth:`~UpdateStage.load_state`) whatever
the objective: they do nothing for an objective without state.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_jagg.config.grpo_jagg_config import GRPOJaggConfig
from trl_jagg.core.jagg import EngineResult, JaggEngine, StepFunctions, StepGroup
from trl_jagg.models import FlowMatchingAdapter
from trl_jagg.trainer.backward import backward, backward_unit
from trl_jagg.trainer.batch import RolloutBatch
from trl_jagg.trainer.guards import largest_over_processes
from trl_jagg.trainer.placement import adapters_disabled, reshard


@dataclass(frozen=True)
class TrainedStepFunctions(StepFunctions):
    """The engine's functions for one micro-batch, with the trained steps they index and the per-step diagnostics
    the loss fills."""

    trained: list[int] = field(default_factory=list)
    """The trained steps (rollout step numbers), in the order the functions index them."""
    stats: dict[str, dict[int, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    """Per diagnostic, its value at each trained step (by index): a step's loss taken again (its velocity
    recomputed after the velocity cache's check) replaces the first."""


@dataclass
class StageInputs:
    """What the trainer hands every update stage beside the adapter, config, accelerator and metrics.

    Attributes:
        ref_transformer: a frozen copy of the base backbone for the KL term of full fine-tuning (``None`` with
            LoRA, whose reference is the backbone with its adapters disabled, or when ``beta`` is 0).
        has_dropout: whether the backbone has active dropout (a recomputed velocity then differs from the
            rollout's).
        trainable_parameters: returns the trainable parameters, in a fixed order (an old policy copies them).
    """

    ref_transformer: torch.nn.Module | None
    has_dropout: bool
    trainable_parameters: Callable[[], list[torch.nn.Parameter]]


class UpdateStage:
    """The update of one micro-batch; writes its diagnostics (means over processes) into ``metrics``.

    Args:
        adapter: the model family's adapter (the guided backbone call).
        args: the run's configuration.
        accelerator: the Trainer's accelerator (backward, gradient sync, reductions).
        metrics: the trainer's metric lists, averaged at each log.
        inputs: the reference backbone, the dropout flag and the trainable parameters.
    """

    def __init__(
        self,
        adapter: FlowMatchingAdapter,
        args: GRPOJaggConfig,
        accelerator: Any,
        metrics: dict[str, list[float]],
        inputs: StageInputs,
    ):
        self.adapter = adapter
        self.args = args
        self.accelerator = accelerator
        self.metrics = metrics
        self.ref_transformer = inputs.ref_transformer
        self.engine = self.build_engine()
        self.setup(inputs)

    def setup(self, inputs: StageInputs) -> None:
        """The objective's own state and checks, once the stage is built (nothing here)."""

    def engine_settings(self) -> tuple[str, float | None]:
        """The run's settings the engine takes: the endpoint backward and the velocity cache's tolerance."""
        args = self.args
        return args.jagg_endpoint_backward, args.jagg_cache_tolerance if args.jagg_cache_mode == "checked" else None

    def build_engine(self) -> JaggEngine:
        """The JAGG engine with the run's settings (built once; again only where those settings change, as a
        benchmark comparing endpoint backwards on one trainer changes them)."""
        self.built_settings = self.engine_settings()
        endpoint_backward, cache_tolerance = self.built_settings
        return JaggEngine(
            functools.partial(backward, self.accelerator),
            endpoint_backward=endpoint_backward,
            cache_tolerance=cache_tolerance,
            # Looked up at each call, so that a test or benchmark wrapping the agreement sees every one.
            agree=(lambda value: self.largest_over_processes(value)) if self.accelerator.num_processes > 1 else None,
        )

    # ------------------------------------------------------------------ the objective's state
    def before_rollout(self, global_step: int) -> None:
        """Called before each rollout, at optimizer step ``global_step``."""

    def sampling_weights(self) -> contextlib.AbstractContextManager:
        """The weights the rollout samples with, in place for the duration of the block (the trained ones here)."""
        return contextlib.nullcontext()

    def save_state(self, directory: str, *, checkpoint_step: int, write: bool) -> None:
        """Save the objective's state into checkpoint ``directory`` (every process calls it; ``write`` on the
        main one)."""

    def load_state(self, checkpoint: str) -> None:
        """Load the objective's state from ``checkpoint``."""

    def calibrate(self, model: torch.nn.Module, rollouts: Sequence[RolloutBatch], threshold: float, **_: Any) -> Any:
        """The JAGG routing calibration (``calibrate_jagg``), for the objectives that route by gradient probes."""
        raise ValueError(
            f"calibrate_jagg calibrates GRPO's routing (jagg_frac='auto'); objective={self.args.objective!r} plans "
            "its groups without probes. Use objective='grpo' to calibrate."
        )

    # ------------------------------------------------------------------ backbone calls
    def backbone_velocities(
        self,
        transformer: torch.nn.Module,
        inputs: Sequence[torch.Tensor],
        timesteps: Sequence[torch.Tensor],
        cond: Any,
    ) -> list[torch.Tensor]:
        """The guided velocities at the latents ``inputs[j]`` and backbone timesteps ``timesteps[j]`` (``(B,)``),
        under the ambient grad mode. Several run as one backbone call over their concatenation, up to
        ``no_grad_batch_steps`` a call (the memory cap); the results are those of one call each up to float
        rounding."""
        args = self.args
        size = inputs[0].shape[0]
        guidance = self.guidance()
        per_call = args.no_grad_batch_steps or len(inputs)
        velocities: list[torch.Tensor] = []
        for begin in range(0, len(inputs), per_call):
            end = min(begin + per_call, len(inputs))
            if end - begin == 1:
                x, t, c = inputs[begin], timesteps[begin], cond
            else:  # input-major: input j is rows j * size ..
                x, t = torch.cat(list(inputs[begin:end])), torch.cat(list(timesteps[begin:end]))
                c = cond.select(torch.arange(size, device=x.device).repeat(end - begin))
            velocities.extend(self.adapter.predict_velocity(transformer, x, t, c, **guidance).split(size))
        return velocities

    def guidance(self) -> dict[str, Any]:
        """The guidance of the update's backbone calls: the rollout's (classifier-free guidance included)."""
        args = self.args
        return {
            "guidance_scale": args.guidance_scale,
            "true_cfg_scale": args.true_cfg_scale,
            "uncond_grad": args.cfg_gradient == "both",
        }

    @torch.no_grad()
    def reference_velocities(
        self,
        transformer: torch.nn.Module,
        inputs: Sequence[torch.Tensor],
        timesteps: Sequence[torch.Tensor],
        cond: Any,
    ) -> list[torch.Tensor]:
        """The base model's velocities for the KL term: the frozen copy (full fine-tuning) or the backbone with its
        adapters disabled (LoRA); ``transformer`` is the unwrapped trained backbone."""
        with self.reference_backbone(transformer) as reference:
            velocities = self.backbone_velocities(reference, inputs, timesteps, cond)
            reshard(reference)  # the frozen copy, or the trained backbone: FSDP2 keeps a root unsharded after forward
        return velocities

    @contextlib.contextmanager
    def reference_backbone(self, transformer: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The reference model: the frozen copy, or ``transformer`` with its adapters disabled."""
        if self.ref_transformer is not None:
            yield self.ref_transformer
        else:
            with adapters_disabled(transformer):
                yield transformer

    # ------------------------------------------------------------------ the engine and the metrics
    def run_engine(
        self,
        model: torch.nn.Module,
        groups: Sequence[StepGroup],
        functions: TrainedStepFunctions,
        *,
        accumulation_steps: int,
        cached_velocities: Mapping[int, torch.Tensor] | None = None,
        correct_cached: bool = False,
    ) -> EngineResult:
        """The engine's forward and backward of the micro-batch's ``groups``, the loss averaged over its trained
        steps and ``accumulation_steps`` micro-batches, one backward unit each (DDP ``no_sync``, DeepSpeed)."""
        if self.engine_settings() != self.built_settings:
            self.engine = self.build_engine()
        return self.engine.run(
            groups,
            functions,
            loss_weight=1.0 / (len(functions.trained) * accumulation_steps),
            sync_context=lambda is_last: backward_unit(self.accelerator, model, is_last),
            cached_velocities=cached_velocities,
            correct_cached=correct_cached,
        )

    def record(
        self,
        result: EngineResult,
        stats: Mapping[str, dict[int, torch.Tensor]],
        *,
        extra: Mapping[str, float] | None = None,
        counters: Mapping[str, float] | None = None,
    ) -> None:
        """Log the micro-batch's loss and per-step ``stats`` (each process's mean, averaged over processes, as TRL's
        GRPOTrainer does; one device sync per update), then ``extra``, the engine's counts and ``counters``."""
        local = [torch.tensor(result.loss, device=self.accelerator.device, dtype=torch.float32)]
        local += [torch.stack(list(values.values())).float().mean() for values in stats.values()]
        means = self.accelerator.gather(torch.stack(local)[None]).mean(dim=0).tolist()
        for name, value in zip(["loss", *stats], means):
            self.metrics[name].append(value)
        for name, value in (extra or {}).items():
            self.metrics[name].append(value)
        self.metrics["jagg/groups_jagg"].append(result.num_jagg_groups)
        self.metrics["jagg/groups_exact"].append(result.num_exact_groups)
        self.metrics["jagg/backward_calls"].append(result.num_backward)
        for name, value in (counters or {}).items():
            self.metrics[name].append(value)
        self.metrics["jagg/no_grad_forwards"].append(result.num_no_grad_forwards)

    def largest_over_processes(self, value: float) -> float:
        """``value``'s largest over the processes (every process calls it at the same point)."""
        return largest_over_processes(self.accelerator, value)
