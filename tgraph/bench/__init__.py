"""Benchmarks run on a GPU: ``python -m tgraph.bench kernels`` and
``python -m tgraph.bench models``."""
