"""The Triton backend's kernel wrappers: each adapts a node's inputs to a Triton kernel (or
cuBLAS, torch.distributed or torch SDPA, where those serve best) and writes into the buffers the
engine planned. Each module lists its wrappers in ``KERNELS``; :mod:`tgraph.kernels.backends`
registers them.
"""
