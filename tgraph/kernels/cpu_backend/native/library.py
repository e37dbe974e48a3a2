"""The built library's kernels as binds: each takes a CPU kernel's tensors, checks that the
compiled kernel takes them (fp32, rows with a contiguous last dim, no overlap it cannot take),
and returns the thunk that calls it, or ``None``: the caller keeps its torch path.

Everything a call needs (pointers, sizes, strides, the thread count) is computed once at bind
time into one argument tuple; the thunk reads its tensors' memory when it runs, and holds the
tensors whose memory it reads (see :mod:`tgraph.kernels.cpu_backend.common`).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tgraph.kernels.cpu_backend.native import build as builder
from tgraph.kernels.triton.checks import memory_overlaps
from tgraph.quant import QuantizedWeight

__all__ = ["NativeCall", "NativeLibrary", "library"]

logger = logging.getLogger("tgraph.kernels")

_F32 = torch.float32
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "tg_linear": [_P, _L, _L, _L, _P, _L, _L, _P, _P, _L, _P, _L, _L, _I],
    "tg_norm_linear": [_P, _L, _L, _L, _P, _F, _I, _P, _P, _L, _L, _P, _I, _P, _L, _L, _I],
    "tg_linear_q": [_P, _L, _L, _L, _P, _L, _I, _P, _P, _L, _L, _P, _P, _L, _P, _L, _L, _I],
    "tg_rms_norm": [_P, _L, _P, _L, _P, _L, _L, _L, _P, _F, _I, _P, _L, _I],
    "tg_sum_squares": [_P, _L, _I],
    "tg_swiglu": [_P, _L, _L, _L, _P, _L, _I],
    "tg_rope_cache_attention": [_P, _L, _P, _L, _P, _L, _P, _P, _L, _L, _I, _P, _P, _L, _P, _P,
                                _L, _P, _L, _P, _P, _L, _L, _L, _L, _F, _L, _L, _I],
}
_MAX_GROUP = 128  # kernels.c's MAX_GROUP: query heads per kv head it takes
_NORM_MAX_K = 1 << 15  # from a row this long torch may split its sum over threads
_LANES = (16, 8, 4, 32)  # the widths of torch's float vectors the norm can mirror


class NativeCall:
    """A bound call of one compiled kernel: ``call()`` runs it on the arguments fixed at bind
    time; it holds the tensors whose memory those arguments point into."""

    __slots__ = ("_args", "_fn", "_held")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 held: tuple[torch.Tensor | None, ...]) -> None:
        self._fn, self._args, self._held = fn, args, held

    def __call__(self) -> None:
        self._fn(*self._args)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_ok(t: torch.Tensor) -> bool:
    """fp32 ``[M, N]`` rows with a contiguous last dim on the CPU."""
    return t.dtype == _F32 and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1


def _vector_ok(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.dtype == _F32 and t.device.type == "cpu" and t.dim() == 1
                         and t.shape[0] == n and (n == 1 or t.stride(0) == 1))


def _weight_ok(w: Any) -> bool:
    """fp32 ``[N, K]`` rows, contiguous along K, each row after the last (a LoRA bank's view of
    its ``[W | B columns]`` storage is one)."""
    return isinstance(w, torch.Tensor) and _rows_ok(w) and w.stride(0) >= w.shape[1]


def _same_or_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are the same memory element for element, or do not overlap."""
    same = a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
    return same or not memory_overlaps(a, b)


def _quant_ok(w: QuantizedWeight) -> bool:
    """int4 / int8 codes on the CPU in stored column order, contiguous fp32 scales (and offsets)
    per group of a multiple of 16 columns (or per channel), K a multiple of 16."""
    (n, k), (rows, cols) = w.shape, w.scheme.block
    group = min(cols, k)
    if w.scheme.kind not in ("int4", "int8") or rows != 1 or w.perm is not None \
            or w.qdata.device.type != "cpu" or k % 16 or group % 16 or k % group \
            or w.qdata.stride(1) != 1:
        return False
    return all(t is None or (t.dtype == _F32 and t.is_contiguous()
                             and tuple(t.shape) == (n, k // group))
               for t in (w.scale, w.offset))


def _linear_io_ok(out2: torch.Tensor, x2: torch.Tensor, w_shape: tuple[int, int],
                  bias: torch.Tensor | None, res2: torch.Tensor | None) -> bool:
    """The activations, output, bias and residual a linear's kernels take for a ``w_shape``
    weight: fp32 rows, ``out2`` apart from ``x2`` and ``bias``, ``res2`` apart or ``out2``."""
    if not (_rows_ok(out2) and _rows_ok(x2) and _vector_ok(bias, w_shape[0])):
        return False
    (m, k), (n, wk) = x2.shape, w_shape
    if m == 0 or wk != k or tuple(out2.shape) != (m, n) or memory_overlaps(out2, x2) \
            or (bias is not None and memory_overlaps(out2, bias)):
        return False
    return res2 is None or (_rows_ok(res2) and tuple(res2.shape) == (m, n)
                            and _same_or_apart(out2, res2))


def _int32_ok(t: torch.Tensor, rows: int) -> bool:
    return t.dtype == torch.int32 and t.device.type == "cpu" and t.shape[0] == rows \
        and t.stride(-1) == 1


class NativeLibrary:
    """The compiled kernels of one built library (:func:`library` gives the process's).

    Attributes:
        path: the library file.
        norm_lanes: the width of the float vectors torch's CPU sum adds with here, which the
            native norms mirror to give the reference's bits; ``None`` when no width gives its
            bits (the norms, and ``norm_linear``, then keep torch).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
            self._fns[name] = fn
        self._fns["tg_sum_squares"].restype = ctypes.c_float
        self._lib = lib
        self.norm_lanes = self._torch_lanes()

    def _torch_lanes(self) -> int | None:
        """The width at which the kernel's sum of squares has torch's bits on rows of many
        lengths (full vectors, leftover vectors of each count, scalar tails, cascade levels)."""
        g = torch.Generator().manual_seed(0)
        rows = [torch.randn(4, k, generator=g) * 3 for k in (1, 3, 5, 7, 9, 15, 17, 33, 63, 100,
                                                              576, 1031, 4099, 20000)]
        want = [torch.sum(r * r, -1).tolist() for r in rows]
        fn = self._fns["tg_sum_squares"]
        for lanes in _LANES:
            if all(fn(r.data_ptr() + i * r.stride(0) * 4, r.shape[1], lanes) == w[i]
                   for r, w in zip(rows, want) for i in range(r.shape[0])):
                return lanes
        logger.info("tgraph: no vector width gives torch's sums of squares; the CPU backend's "
                    "norms stay torch's")
        return None

    def bind_linear(self, out2: torch.Tensor, x2: torch.Tensor, w: Any,
                    bias: torch.Tensor | None, res2: torch.Tensor | None, threads: int,
                    prefetch_bytes: int = 1024) -> NativeCall | None:
        """``out2 = x2 @ w.T (+ bias) (+ res2)`` for ``x2 [M, K]``, ``w [N, K]`` (each row
        contiguous), ``out2`` and ``res2`` ``[M, N]``; ``res2`` may be ``out2`` itself. Each
        weight row is prefetched ``prefetch_bytes`` ahead of its loads
        (``CpuTuning.native_prefetch_bytes``)."""
        if not (_weight_ok(w) and _linear_io_ok(out2, x2, tuple(w.shape), bias, res2)) \
                or memory_overlaps(out2, w):
            return None
        (m, k), n = x2.shape, w.shape[0]
        args = (x2.data_ptr(), x2.stride(0), m, k, w.data_ptr(), w.stride(0), n, _ptr(bias),
                _ptr(res2), 0 if res2 is None else res2.stride(0), out2.data_ptr(),
                out2.stride(0), prefetch_bytes // 4, threads)
        return NativeCall(self._fns["tg_linear"], args, (out2, x2, w, bias, res2))

    @staticmethod
    def takes_quantized(w: QuantizedWeight) -> bool:
        """Whether :meth:`bind_linear_q` takes ``w``'s layout (its activations checked apart)."""
        return _quant_ok(w)

    def bind_linear_q(self, out2: torch.Tensor, x2: torch.Tensor, w: QuantizedWeight,
                      bias: torch.Tensor | None, res2: torch.Tensor | None, threads: int,
                      prefetch_bytes: int = 1024) -> NativeCall | None:
        """:meth:`bind_linear` on a quantized weight kept packed: int4 or int8 codes with fp32
        scales (and offsets) per group of a multiple of 16 columns along K (or per channel),
        stored columns in order, K a multiple of 16. Each weight is dequantized as it is read,
        as :meth:`QuantizedWeight.dequantize` computes it, so the result has the bits of
        :meth:`bind_linear` on the dequantized weight."""
        if not (isinstance(w, QuantizedWeight) and _quant_ok(w)
                and _linear_io_ok(out2, x2, w.shape, bias, res2)):
            return None
        (m, k), n = x2.shape, w.shape[0]
        group = min(w.scheme.block[1], k)
        args = (x2.data_ptr(), x2.stride(0), m, k, w.qdata.data_ptr(), w.qdata.stride(0),
                w.scheme.bits, w.scale.data_ptr(), _ptr(w.offset), group, n, _ptr(bias),
                _ptr(res2), 0 if res2 is None else res2.stride(0), out2.data_ptr(),
                out2.stride(0), prefetch_bytes // 4, threads)
        return NativeCall(self._fns["tg_linear_q"], args,
                          (out2, x2, w.qdata, w.scale, w.offset, bias, res2))

    def bind_rms_norm(self, out2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor | None,
                      eps: float, threads: int, res2: torch.Tensor | None = None,
                      summed2: torch.Tensor | None = None) -> NativeCall | None:
        """``out2 = rms_norm(x2) * weight`` for ``[M, K]`` rows with the reference's bits (the
        norm :meth:`bind_norm_linear` computes too); with ``res2``, ``summed2 = x2 + res2``
        first and its norm. Tensors may share memory only element for element (``out2`` may be
        ``x2``)."""
        rows = [t for t in (out2, x2, res2, summed2) if t is not None]
        if self.norm_lanes is None or not 0 < x2.shape[-1] < _NORM_MAX_K \
                or (res2 is None) != (summed2 is None) or not all(_rows_ok(t) for t in rows) \
                or any(tuple(t.shape) != tuple(x2.shape) for t in rows) \
                or not _vector_ok(weight, x2.shape[1]) \
                or not all(_same_or_apart(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]):
            return None
        m, k = x2.shape
        args = (x2.data_ptr(), x2.stride(0), _ptr(res2), 0 if res2 is None else res2.stride(0),
                _ptr(summed2), 0 if summed2 is None else summed2.stride(0), m, k, _ptr(weight),
                eps, self.norm_lanes, out2.data_ptr(), out2.stride(0), threads)
        return NativeCall(self._fns["tg_rms_norm"], args, (out2, x2, weight, res2, summed2))

    def bind_swiglu(self, out2: torch.Tensor, gate_up2: torch.Tensor,
                    threads: int) -> NativeCall | None:
        """``out2 = silu(gate) * up`` of ``gate_up2 = [gate | up]`` rows, the SwiGLU
        :meth:`bind_norm_linear` computes (the same bits)."""
        if not (_rows_ok(out2) and _rows_ok(gate_up2)) or gate_up2.shape[1] % 2 \
                or tuple(out2.shape) != (gate_up2.shape[0], gate_up2.shape[1] // 2) \
                or memory_overlaps(out2, gate_up2):
            return None
        args = (gate_up2.data_ptr(), gate_up2.stride(0), out2.shape[0], out2.shape[1],
                out2.data_ptr(), out2.stride(0), threads)
        return NativeCall(self._fns["tg_swiglu"], args, (out2, gate_up2))

    def bind_norm_linear(self, out2: torch.Tensor, x2: torch.Tensor,
                         norm_weight: torch.Tensor | None, eps: float, w: Any,
                         bias: torch.Tensor | None, swiglu: bool, threads: int,
                         prefetch_bytes: int = 1024) -> NativeCall | None:
        """``out2 = rms_norm(x2) @ w.T (+ bias)``, with ``swiglu`` then ``silu(gate) * up`` of
        the ``[gate | up]`` columns (``w [2I, K]``, ``out2 [M, I]``); the normed rows (the
        reference's bits, see :meth:`bind_rms_norm`) go to a scratch the call holds.
        ``prefetch_bytes`` as for :meth:`bind_linear`."""
        if self.norm_lanes is None or not (
                _rows_ok(out2) and _rows_ok(x2) and _weight_ok(w) and 0 < x2.shape[1] < _NORM_MAX_K
                and _vector_ok(norm_weight, x2.shape[1]) and _vector_ok(bias, w.shape[0])):
            return None
        (m, k), n = x2.shape, w.shape[0]
        width = n // 2 if swiglu else n
        if m == 0 or w.shape[1] != k or (swiglu and n % 2) or tuple(out2.shape) != (m, width) \
                or memory_overlaps(out2, w) or (bias is not None and memory_overlaps(out2, bias)):
            return None
        normed = torch.empty(m, k, dtype=_F32)  # out2 may be x2's memory: written after the norm
        args = (x2.data_ptr(), x2.stride(0), m, k, _ptr(norm_weight), eps, self.norm_lanes,
                normed.data_ptr(),
                w.data_ptr(), w.stride(0), n, _ptr(bias), int(swiglu), out2.data_ptr(),
                out2.stride(0),
                prefetch_bytes // 4, threads)
        return NativeCall(self._fns["tg_norm_linear"], args,
                          (out2, x2, norm_weight, normed, w, bias))

    def bind_rope_cache_attention(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  slots_mapping: torch.Tensor, block_table: torch.Tensor,
                                  seq_len: torch.Tensor, interleaved: bool, scale: float | None,
                                  sliding_window: int | None, serial_scores: int,
                                  threads: int) -> NativeCall | None:
        """Decode (one query per sequence): rope of ``q`` and ``k``, ``k``/``v`` stored at
        ``slots_mapping``, ``out [tokens, hq, d]`` = attention over each sequence's
        ``seq_len`` keys through ``block_table``; see ``kernels.c``."""
        tokens, hq, d = q.shape
        if not all(t.dtype == _F32 and t.device.type == "cpu"
                   for t in (out, q, k, v, cos, sin, k_cache, v_cache)):
            return None
        if not (out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
                and k_cache.shape == v_cache.shape and k_cache.dim() == 4):
            return None
        _, block_size, hk, cache_d = k_cache.shape
        heads_ok = all(t.dim() == 3 and t.shape[0] == tokens and t.shape[2] == d
                       and t.stride(2) == 1 and t.stride(1) == d for t in (q, k, v))
        if not heads_ok or k.shape[1] != hk or v.shape[1] != hk or cache_d != d \
                or hq % hk or hq // hk > _MAX_GROUP or tuple(out.shape) != (tokens, hq, d):
            return None
        half = cos.shape[-1]
        if cos.dim() != 2 or sin.shape != cos.shape or cos.shape[0] != tokens or 2 * half > d \
                or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
            return None
        if not (_int32_ok(slots_mapping, tokens) and _int32_ok(seq_len, tokens)
                and block_table.dim() == 2 and _int32_ok(block_table, tokens)):
            return None
        if any(memory_overlaps(out, t) for t in (q, k, v, k_cache, v_cache)):
            return None
        q_rot = torch.empty(tokens, hq, d, dtype=_F32)
        scale = d ** -0.5 if scale is None else scale
        args = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                cos.data_ptr(), sin.data_ptr(), cos.stride(0), half, int(interleaved),
                k_cache.data_ptr(), v_cache.data_ptr(), block_size, slots_mapping.data_ptr(),
                block_table.data_ptr(), block_table.stride(0), seq_len.data_ptr(),
                block_table.shape[1] * block_size, q_rot.data_ptr(), out.data_ptr(), tokens, hq,
                hk, d, scale, sliding_window or 0, serial_scores, threads)
        return NativeCall(self._fns["tg_rope_cache_attention"], args,
                          (out, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table,
                           seq_len, q_rot))


@functools.cache
def library() -> NativeLibrary | None:
    """This process's native kernels, built (or found in the cache) and loaded at the first
    call; ``None`` when that failed (logged once): callers keep their torch paths."""
    path = builder.build()
    if path is None:
        return None
    try:
        return NativeLibrary(path)
    except (OSError, AttributeError) as err:
        logger.warning("tgraph: loading the native CPU kernels from %s failed (%s); the CPU "
                       "backend runs torch's kernels", path, err)
        return None
