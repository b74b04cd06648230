"""Engine-level JAGG benchmark: update-stage time exact vs JAGG and gradient cosine per group, on a tiny DiT.

Usage (the options of ``trl-jagg bench``)::

    python benchmarks/bench_engine.py --output_dir runs/bench --group_sizes 2 4 8 --repeats 5

Writes ``engine_benchmark.json`` and ``engine_benchmark.png`` into ``--output_dir`` and prints a table.
"""

from __future__ import annotations

import sys

from trl_jagg.scripts.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
