"""The ``trl-jagg`` commands, one module each (TRL's ``trl/scripts/`` pattern): ``train``, ``calibrate``, ``demo``,
``bench``, ``env``. Each has ``make_parser()`` (a :class:`~trl_jagg.scripts.utils.CommandParser` over its argument
dataclasses) and ``main(argv) -> int``; :mod:`trl_jagg.scripts.cli` only dispatches to them."""

PROG = "trl-jagg"
DOCS_URL = "https://github.com/huggingface/trl-jagg/tree/main/docs"
"""Where the docs are published (``Documentation`` in pyproject.toml): a wheel user has no ``docs/`` folder."""
