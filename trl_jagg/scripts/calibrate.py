"""``trl-jagg calibrate``: the JAGG-vs-exact gradient cosine of every step group on fresh rollouts of the model to
train, and the ``jagg_frac`` the paper's rule suggests. Nothing is trained.

.. code-block:: bash

    trl-jagg calibrate --config recipe.yaml [--threshold 0.7] [--num_batches 1]

It takes every ``trl-jagg train`` field plus :class:`CalibrationArguments`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trl_jagg.scripts.train import ScriptArguments, build_trainer, check_script_args, recipe_defaults
from trl_jagg.scripts.train import make_parser as make_train_parser
from trl_jagg.scripts.utils import CommandParser

if TYPE_CHECKING:
    from trl_jagg import GRPOJaggConfig

DESCRIPTION = (
    "Measure, on fresh rollouts of the model to train, the cosine between the JAGG and the exact gradient of every "
    "step group, and suggest jagg_frac (the paper's rule). Nothing is trained. Takes every `trl-jagg train` field."
)


@dataclass
class CalibrationArguments:
    """The options of ``trl-jagg calibrate`` on top of the training ones."""

    _argument_group_name = "Calibration (trl-jagg calibrate)"

    threshold: float = field(
        default=0.7,
        metadata={
            "help": "Gradient cosine (JAGG vs exact) a group must reach: the suggested jagg_frac is the share of "
            "leading, high-noise groups at or above it."
        },
    )
    num_batches: int = field(default=1, metadata={"help": "Rollouts the per-group cosines are averaged over."})


CALIBRATION_FILE = "jagg_calibration.json"


def run_calibration(
    script_args: ScriptArguments, training_args: GRPOJaggConfig, calibration_args: CalibrationArguments
) -> dict[str, Any]:
    """Per-group JAGG-vs-exact gradient cosines on fresh rollouts and the suggested ``jagg_frac``
    (:meth:`~trl_jagg.DDPOJaggTrainer.calibrate_jagg`); written to ``output_dir/jagg_calibration.json``."""
    trainer = build_trainer(script_args, training_args)
    report = trainer.calibrate_jagg(threshold=calibration_args.threshold, num_batches=calibration_args.num_batches)
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        path = os.path.join(training_args.output_dir, CALIBRATION_FILE)
        with open(path, "w") as handle:
            json.dump(report, handle, indent=2)
        width = report["jagg_group_size"]
        print(f"JAGG vs exact gradient per group of W = {width} trained steps (high noise first):")
        for index, (cosine, ratio) in enumerate(zip(report["group_cosine"], report["group_norm_ratio"])):
            mark = "JAGG" if cosine >= report["threshold"] else "exact"
            print(f"  group {index}: cosine {cosine:+.3f}  norm ratio {ratio:.3f}  -> {mark}")
        print(
            f"Suggested jagg_frac: {report['jagg_frac']:.2f} (leading groups with cosine >= {report['threshold']}). "
            f"Written to {path}"
        )
    return report


def parse_calibrate_args(argv: Sequence[str]) -> tuple[ScriptArguments, GRPOJaggConfig, CalibrationArguments]:
    """Parse ``trl-jagg calibrate`` arguments: those of ``train`` plus :class:`CalibrationArguments`."""
    script_args, training_args, calibration_args = make_parser().parse_command_line(argv, recipe_defaults)
    check_script_args(script_args)
    return script_args, training_args, calibration_args


def make_parser() -> CommandParser:
    """The parser of ``trl-jagg calibrate``: ``train``'s plus :class:`CalibrationArguments`."""
    return make_train_parser("calibrate", (CalibrationArguments,), DESCRIPTION)


def main(argv: Sequence[str]) -> int:
    """``trl-jagg calibrate ARGV``; returns the exit status."""
    parsed = make_parser().parse_command_line(argv, recipe_defaults)
    if parsed is None:
        return 0
    check_script_args(parsed[0])
    run_calibration(*parsed)
    return 0
