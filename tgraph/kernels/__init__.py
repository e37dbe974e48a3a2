"""Kernels: reference (torch) implementations live with the op registry in ``tgraph.ir.ops``;
this package holds the Triton kernels the CUDA engine launches and the pointwise code generator.
"""
