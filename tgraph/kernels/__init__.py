"""Kernels: the Triton kernels the CUDA engine launches (``triton/``), their wrappers that adapt
a node to a launch (``triton_backend/``), the pointwise code generator, and the kernel registry
(``registry.py``) that every backend fills from one place (``backends.py``). Reference (torch)
implementations live with the op registry in :mod:`tgraph.ir.ops`; launch settings in
:mod:`tgraph.tuning`.
"""
