"""Benchmarks: the engine (``engine``), the trainer (``trainer``) on CPU, and FLUX.1-dev size on one GPU (``gpu``)."""
