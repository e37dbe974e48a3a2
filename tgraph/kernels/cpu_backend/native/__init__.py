"""Compiled CPU kernels of the decode hot path (fp32, a few rows): a C file
(``kernels.c``: AVX-512 where the compiler targets it, portable loops elsewhere) built once per
machine by the system C compiler into the cache (:mod:`tgraph.kernels.cpu_backend.native.build`)
and called through ctypes (:mod:`tgraph.kernels.cpu_backend.native.library`).

- ``linear`` for a few rows: every weight row read once for all of them (+ bias, + residual);
- ``norm_linear``: the RMSNorm of the rows then the linear, with SwiGLU on a ``[gate | up]``
  weight written directly;
- ``rope_cache_attention`` at decode: rope, the cache write and attention over the block table;
- ``linear`` on a quantized weight no packed torch kernel takes exactly (int4 / int8 codes in
  groups of a multiple of 16), at any row count: the codes dequantized as they are read, the
  dense copy's bits without the copy.

Each layer half is one or two calls instead of ~20 torch calls. The CPU backend's kernels use
them when :func:`library` loads, ``CpuTuning.native_kernels`` is on and the arguments qualify;
anything else (no compiler, a failed build, other dtypes or layouts, prefill) keeps torch.
"""
from __future__ import annotations

from tgraph.kernels.cpu_backend.native.library import NativeCall, NativeLibrary, library

__all__ = ["NativeCall", "NativeLibrary", "library"]
