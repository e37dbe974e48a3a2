"""The CPU backend: torch's CPU kernels (MKL/oneDNN GEMMs, packed int4/int8 matmuls, fused CPU
attention) writing into the engine's planned arena buffers: norms and linears in
:mod:`tgraph.kernels.cpu_backend.core`, rope, the KV-cache write and attention in
:mod:`tgraph.kernels.cpu_backend.attention`, each kernel bound once per signature by the engine's
step programs (:mod:`tgraph.kernels.cpu_backend.common`)."""
