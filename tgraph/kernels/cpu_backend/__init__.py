"""The CPU backend: torch's CPU kernels (MKL/oneDNN GEMMs, packed int4/int8 matmuls) writing
into the engine's planned arena buffers, see :mod:`tgraph.kernels.cpu_backend.core`."""
