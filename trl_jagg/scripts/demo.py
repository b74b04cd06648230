"""``trl-jagg demo``: fine-tune the shipped tiny Flux model on CPU with GRPO + JAGG and watch the reward rise.

.. code-block:: bash

    trl-jagg demo --output_dir runs/demo [--compare] [--steps 100]

The options are the fields of :class:`DemoArguments`, the parameters of :func:`trl_jagg.demo.run_demo`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from trl_jagg.demo.run import DEFAULT_STEPS, DEMO_ASSET_DIR
from trl_jagg.scripts.utils import CommandParser

DESCRIPTION = (
    "Fine-tune a tiny Flux-architecture pipeline on CPU with GRPO + JAGG and a prompt-colour reward; writes the "
    "metrics, the reward curve (JAGG vs exact with --compare), a before/after grid and the trained weights to "
    "--output_dir, and prints where they are."
)


@dataclass
class DemoArguments:
    """The options of ``trl-jagg demo`` (the parameters of :func:`~trl_jagg.demo.run_demo`)."""

    _argument_group_name = "Demo"

    output_dir: str = field(
        default="runs/demo", metadata={"help": "Where the metrics, plots, LoRA weights and summary are written."}
    )
    compare: bool = field(
        default=False,
        metadata={"help": "Also train with exact per-step gradients (use_jagg=False, same seed) and plot both runs."},
    )
    steps: int = field(
        default=DEFAULT_STEPS, metadata={"help": "Optimizer steps per run (each: 72 sampled images, one update)."}
    )
    seed: int = field(default=0, metadata={"help": "Seed of the LoRA initialisation, the rollouts and the samples."})
    model: str = field(
        default=DEMO_ASSET_DIR,
        metadata={"help": "The pipeline to fine-tune, a local directory or a Hub id (default: the shipped model)."},
    )
    threads: int = field(
        default=1, metadata={"help": "torch CPU threads while the demo runs (1 is fastest for these tiny kernels)."}
    )
    timing_repeats: int = field(
        default=5,
        metadata={
            "help": "Exact and JAGG updates timed in alternating pairs after training, for the summary's speedup "
            "(0 skips it)."
        },
    )


def make_parser() -> CommandParser:
    return CommandParser((DemoArguments,), "demo", DESCRIPTION, usage="trl-jagg demo [--output_dir DIR] [--compare]")


def main(argv: Sequence[str]) -> int:
    """``trl-jagg demo ARGV``: run the demo (it prints where its files are and the reward it reached)."""
    parsed = make_parser().parse_command_line(argv)
    if parsed is None:
        return 0
    from trl_jagg.demo.run import run_demo

    run_demo(**asdict(parsed[0]))
    return 0
