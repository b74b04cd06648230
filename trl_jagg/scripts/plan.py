"""``trl-jagg plan``: will this run fit, and how long is a step? A resource plan from the real architecture, built
on the ``meta`` device: no GPU, no weights, no download.

.. code-block:: bash

    trl-jagg plan --recipe dancegrpo-flux --num_processes 8 --gpu_memory_gb 80
    trl-jagg plan --config recipe.yaml --use_peft true --gpu_memory_gb 141 --gpu_tflops 989 --mfu 0.35

It takes every ``trl-jagg train`` field (a preset, a YAML config, flags: the same parser) plus
:class:`PlanArguments`; ``model_name_or_path`` is a Hub id the planner ships an architecture for
(``trl_jagg/planning/architectures/``) or a local diffusers folder (its configs are enough).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trl_jagg.scripts.train import make_parser as make_train_parser
from trl_jagg.scripts.train import recipe_defaults
from trl_jagg.scripts.utils import CommandParser, UsageError, flag_value

if TYPE_CHECKING:
    from trl_jagg import GRPOJaggConfig
    from trl_jagg.planning.plan import ResourcePlan
    from trl_jagg.scripts.train import ScriptArguments

DESCRIPTION = (
    "Plan a run before paying for GPUs: per-process memory by component under DDP, FSDP2, ZeRO-2 and ZeRO-3 "
    "(activations measured by running the backbone on the meta device), whether it fits, the cheapest change that "
    "makes it fit, and the predicted time of a step. Takes every `trl-jagg train` field; nothing is downloaded."
)


@dataclass
class PlanArguments:
    """The machines the plan is for (``trl-jagg plan``'s own options)."""

    _argument_group_name = "Plan (trl-jagg plan)"

    num_processes: int = field(default=8, metadata={"help": "Processes (GPUs) the run is launched on."})
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "Memory of one GPU in GB (H100: 80, H200: 141)."})
    gpu_tflops: float = field(
        default=989.0, metadata={"help": "Dense bf16 TFLOP/s of one GPU (H100 SXM and H200: 989; A100: 312)."}
    )
    mfu: float = field(default=0.4, metadata={"help": "Model FLOPs utilisation the predicted time assumes."})
    memory_margin: float = field(
        default=0.1,
        metadata={"help": "Share of each GPU's memory kept free (CUDA context, NCCL, the allocator's fragmentation)."},
    )
    strategy: str | None = field(
        default=None,
        metadata={
            "help": "The sharding whose fit decides the verdict: ddp, zero2, fsdp2 or zero3 (default: what "
            "accelerate_config or fully_shard_backbone imply; ddp without them). The table shows all four."
        },
    )
    json_output: str | None = field(default=None, metadata={"help": "Also write the plan as JSON to this path."})


def make_parser() -> CommandParser:
    """The parser of ``trl-jagg plan``: ``train``'s plus :class:`PlanArguments`."""
    return make_train_parser("plan", (PlanArguments,), DESCRIPTION)


def run_plan(
    script_args: ScriptArguments,
    training_args: GRPOJaggConfig,
    plan_args: PlanArguments,
    *,
    mixed_precision: str | None = None,
) -> ResourcePlan:
    """The :class:`~trl_jagg.planning.plan.ResourcePlan` of the run these arguments describe."""
    from trl_jagg.models import adapter_class
    from trl_jagg.planning.architecture import load_architecture
    from trl_jagg.planning.plan import GPUs, cached_measure, make_plan
    from trl_jagg.planning.settings import lora_arguments, settings_from_config

    if not script_args.model_name_or_path:
        raise UsageError("missing model_name_or_path: set --model_name_or_path or --recipe.")
    try:
        architecture = load_architecture(script_args.model_name_or_path)
        adapter = adapter_class(architecture.pipeline)
        settings = settings_from_config(
            script_args, training_args, guidance_is_cfg=adapter.guidance_is_cfg,
            default_lora_targets=tuple(adapter.lora_target_modules), edits_images=adapter.edits_images,
            makes_videos=adapter.makes_videos, mixed_precision=mixed_precision,
            strategy=plan_args.strategy,
        )  # fmt: skip
        gpus = GPUs(
            num_processes=plan_args.num_processes, memory_gb=plan_args.gpu_memory_gb, tflops=plan_args.gpu_tflops,
            mfu=plan_args.mfu, margin=plan_args.memory_margin,
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from None
    default_lora = lora_arguments(_with_peft(script_args), tuple(adapter.lora_target_modules))
    return make_plan(settings, gpus, cached_measure(architecture), default_lora=default_lora)


def _with_peft(script_args: ScriptArguments) -> ScriptArguments:
    import dataclasses

    return dataclasses.replace(script_args, use_peft=True)


def _recipe_mixed_precision(argv: Sequence[str], config: dict) -> str | None:
    """The preset's GPU precision flag (``bf16``/``fp16``): a plan is for GPUs, where ``train`` would set it."""
    name = flag_value(argv, "--recipe") or config.get("recipe")
    if not name:
        return None
    from trl_jagg.recipes import get_recipe

    return get_recipe(name).mixed_precision


def main(argv: Sequence[str]) -> int:
    """``trl-jagg plan ARGV``: print the plan; returns the exit status (0 whether or not the run fits)."""
    from trl_jagg.planning.report import format_plan, plan_as_dict

    parser = make_parser()
    argv = list(argv)
    parsed = parser.parse_command_line(argv, recipe_defaults)
    if parsed is None:
        return 0
    script_args, training_args, plan_args = parsed
    _, config, _ = parser.read_config(argv)
    plan = run_plan(script_args, training_args, plan_args, mixed_precision=_recipe_mixed_precision(argv, config))
    print(format_plan(plan, title=f"trl-jagg plan ({script_args.recipe or 'config'})"))
    if plan_args.json_output:
        with open(plan_args.json_output, "w") as handle:
            json.dump(plan_as_dict(plan), handle, indent=2)
    return 0
