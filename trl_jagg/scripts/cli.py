"""The ``trl-jagg`` command line: a thin dispatcher to the commands in :mod:`trl_jagg.scripts`.

.. code-block:: bash

    trl-jagg train --config recipe.yaml [--any_config_field value ...]
    trl-jagg train --accelerate_config multi_gpu --config recipe.yaml    # relaunched through `accelerate launch`
    accelerate launch -m trl_jagg.scripts.cli train --config recipe.yaml       # the same, launched by hand
    trl-jagg demo --output_dir runs/demo [--compare]                     # the CPU demo that visibly learns
    trl-jagg bench [trainer] --output_dir runs/bench [...]               # JAGG vs exact update-stage timings
    trl-jagg calibrate --config recipe.yaml [--threshold 0.7]            # JAGG vs exact gradient cosine per group
    trl-jagg env                                                         # versions for a bug report
    trl-jagg plan --recipe dancegrpo-flux --num_processes 8 --gpu_memory_gb 80   # memory and time, before a GPU

Each command is a module ``trl_jagg.scripts.<command>`` with ``main(argv) -> int``, imported only when run, so
``trl-jagg --help`` is instant. A :class:`~trl_jagg.scripts.utils.UsageError` becomes
``trl-jagg <command>: error: ...`` and exit status 2; any other error raised by trl_jagg itself (a bad dataset, a
NaN, a broken checkpoint, a failing reward server) becomes one such line and exit status 1, with the traceback only
under ``--debug`` (anywhere on the command line) or ``TRL_JAGG_DEBUG=1``. Errors raised elsewhere (your reward
function, a library) keep their traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from trl_jagg import MODEL_FAMILIES
from trl_jagg.scripts import DOCS_URL, PROG
from trl_jagg.scripts.usage import UsageError, suggest

COMMANDS: dict[str, str] = {
    "train": "GRPO or DiffusionNFT fine-tuning with JAGG, from a YAML config and flags (accelerate launch-able)",
    "demo": "train a tiny model on CPU and plot its rising reward (a few minutes)",
    "bench": "time the update stage with JAGG vs exact backward (`bench trainer`: through the trainer)",
    "calibrate": "measure JAGG-vs-exact gradient cosines per group and suggest jagg_frac",
    "env": "print the versions and the machine, for a bug report",
    "plan": "will the run fit? per-GPU memory by component, the fix, the time of a step (meta device, no GPU)",
}
"""Command name -> one-line help; the command's code is ``trl_jagg.scripts.<name>.main``."""

DEBUG_ENV = "TRL_JAGG_DEBUG"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # trl_jagg/, this file being in scripts/


def _top_help() -> str:
    return "\n".join(
        [
            f"usage: {PROG} <command> [options]",
            "",
            f"GRPO and DiffusionNFT fine-tuning of flow-matching models with JAGG group gradients: {MODEL_FAMILIES}.",
            "",
            "commands:",
            *(f"  {name:<10} {text}" for name, text in COMMANDS.items()),
            "",
            f"Run `{PROG} <command> --help` for the options of a command. Docs: {DOCS_URL}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trl-jagg`` console script; returns the exit status (2 for usage errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [token for token in argv if token != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from trl_jagg import __version__

        print(f"{PROG} {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: error: unknown command '{command}'.{suggest(command, COMMANDS)}", file=sys.stderr)
        print(_top_help(), file=sys.stderr)
        return 2
    try:
        return importlib.import_module(f"trl_jagg.scripts.{command}").main(rest)
    except UsageError as error:
        print(f"{PROG} {command}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if debug or not _raised_by_trl_jagg(error):
            raise
        print(f"{PROG} {command}: error: {_one_line(error)} (traceback: --debug or {DEBUG_ENV}=1)", file=sys.stderr)
        return 1


def _raised_by_trl_jagg(error: BaseException) -> bool:
    """Whether ``error`` was raised in trl_jagg's own code: its messages say what, where and the fix."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR + os.sep)


def _one_line(error: BaseException) -> str:
    text = " ".join([str(error), *getattr(error, "__notes__", [])])
    return f"{type(error).__name__}: {' '.join(text.split())}"


if __name__ == "__main__":
    sys.exit(main())
