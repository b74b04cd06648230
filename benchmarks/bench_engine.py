"""Engine-level JAGG benchmark: update-stage time exact vs JAGG and gradient cosine per group, on a tiny DiT.

Usage::

    python benchmarks/bench_engine.py --output_dir runs/bench --group_sizes 2 4 8 --repeats 5

Writes ``engine_benchmark.json`` and ``engine_benchmark.png`` into ``--output_dir`` and prints a table.
"""

from __future__ import annotations

import argparse

from trl_jagg.benchmark import add_benchmark_arguments, run_from_args


def main(argv: list[str] | None = None) -> None:
    """Parse the options and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    run_from_args(add_benchmark_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    main()
