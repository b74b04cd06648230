"""``trl-jagg train --accelerate_config NAME``: relaunch the command under ``accelerate launch`` (in-process, as
``trl`` does), with TRL's launch-config names and the multi-node launch options."""

from __future__ import annotations

import os
from collections.abc import Sequence

from trl_jagg.scripts.usage import UsageError, one_line

LAUNCHED_ENV = "TRL_JAGG_ACCELERATE_LAUNCHED"
"""Set in the processes ``--accelerate_config`` starts, so that they train instead of relaunching."""


TRL_ACCELERATE_NAMES = {"zero2": "deepspeed_zero2", "zero3": "deepspeed_zero3"}
"""TRL's names of its shipped launch configs (``trl/accelerate_configs``) -> the shipped config here that does the
same; ``single_gpu``, ``multi_gpu`` and ``fsdp2`` are spelt alike."""

TRL_ACCELERATE_UNSHIPPED = {
    "zero1": "no ZeRO-1 config is shipped (the tested DeepSpeed stages are 2 and 3): use zero2, or pass the path of "
    "your own accelerate config file.",
    "fsdp1": "FSDP here is FSDP2: use fsdp2, or pass the path of your own accelerate config file.",
}
"""TRL's launch configs without a counterpart here, with what to use."""


def resolve_accelerate_config(name: str) -> str:
    """The file ``--accelerate_config name`` names: a path, else a launch configuration shipped in the package
    (``trl_jagg/configs/accelerate/<name>.yaml``, also ``examples/accelerate_configs/`` in a checkout)."""
    if os.path.isfile(name):
        return _checked_accelerate_config(name)
    from trl_jagg.configs import config_dir, config_names

    if name in TRL_ACCELERATE_UNSHIPPED:
        raise UsageError(f"accelerate_config {name!r} (TRL's name): {TRL_ACCELERATE_UNSHIPPED[name]}")
    name = TRL_ACCELERATE_NAMES.get(name, name)
    path = config_dir("accelerate") / f"{name}.yaml"
    if path.is_file():
        return _checked_accelerate_config(str(path))
    raise UsageError(
        f"accelerate_config {name!r} is neither a file nor a shipped accelerate config "
        f"({', '.join(config_names('accelerate'))}). Give a path to an accelerate config file or one of those names."
    )


def _checked_accelerate_config(path: str) -> str:
    """``path``, once accelerate reads it as a launch config (before relaunching, whose error would be a
    traceback in the launched processes)."""
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        load_config_from_file(path)
    except Exception as error:  # YAML/JSON syntax, a non-mapping, unknown keys: accelerate raises each differently
        raise UsageError(
            f"accelerate_config {path} is not an accelerate config ({type(error).__name__}: {one_line(error)}). "
            f"Write one with `accelerate config --config_file {path}`, or use a shipped config's name."
        ) from None
    return path


LAUNCH_OPTIONS = (
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "rdzv_backend",
)
"""``accelerate launch`` options that ``trl-jagg train --accelerate_config`` passes on (they override the config
file): the process count, and the machines of a multi-node job."""


def split_launch_options(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(launch, rest)``: the :data:`LAUNCH_OPTIONS` flags of ``argv`` (``--name value`` pairs) and the other
    tokens, without ``--accelerate_config``."""
    launch: list[str] = []
    rest: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name == "accelerate_config" or name in LAUNCH_OPTIONS:
            value = value if eq else next(tokens, "")
            if name in LAUNCH_OPTIONS:
                launch += [f"--{name}", value]
        else:
            rest.append(token)
    return launch, rest


def accelerate_launch_args(argv: Sequence[str], config_file: str) -> list[str]:
    """The ``accelerate launch`` arguments that run ``trl-jagg train argv`` (without ``--accelerate_config``) with
    ``config_file``: ``--config_file <file> [launch options] -m trl_jagg.scripts.cli train ...``."""
    launch, rest = split_launch_options(argv)
    return ["--config_file", config_file, *launch, "-m", "trl_jagg.scripts.cli", "train", *rest]


def launch_with_accelerate(argv: Sequence[str], accelerate_config: str) -> int:
    """Run ``trl-jagg train argv`` under ``accelerate launch`` with the named config (in-process, as ``trl`` does)."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    config_file = resolve_accelerate_config(accelerate_config)
    launch_args = launch_command_parser().parse_args(accelerate_launch_args(argv, config_file))
    print(
        f"Launching with accelerate ({config_file}): accelerate launch {' '.join(accelerate_launch_args(argv, config_file))}"
    )
    os.environ[LAUNCHED_ENV] = "1"  # inherited by the launched processes
    launch_command(launch_args)
    return 0
