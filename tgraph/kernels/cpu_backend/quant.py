"""Quantized linears on the CPU through torch's packed kernels, packed once per weight.

- ``int4`` (any group size torch's kernel takes, symmetric or with offsets, e.g. GGUF ``Q4_0``,
  ``Q4_1``, ``Q4_K``, GPTQ/AWQ W4A16): ``aten._weight_int4pack_mm_for_cpu`` on the codes repacked
  by ``aten._convert_weight_to_int4pack_for_cpu``. The kernel computes ``(q - 8) * s + z`` per
  group, so an offset ``b`` becomes ``z = b + 8 s`` (where the reference computes ``s * q + b``).
- ``int8`` with one scale per output channel (W8A16): ``aten._weight_int8pack_mm`` on the codes as
  they are (offsets add ``sum(x) * b``).
- Both kernels run fast only on bf16 activations and scales (fp32 takes a much slower path), so
  activations, scales and zeros are rounded to bf16 and the bf16 output widened: at most ~3 x
  2^-9 of an output's scale (``tgraph.tuning.CpuTuning.bf16_quant_activations``).
- ``int8`` with group scales (GGUF ``Q8_0``), when ``CpuTuning.int8_group_kernel`` asks for it:
  ``aten._weight_int8pack_mm`` once per group of K (its scales are one per output channel), on
  the codes laid out group by group, the bf16 partial products summed in fp32: the codes' bytes
  resident instead of a 4x larger dense copy, at the bf16 path's error.
- Everything else (``int8`` with group scales by default, ``fp8``, int4 groups the kernel
  refuses, non-fp32 activations) and the exact mode (``bf16_quant_activations=False``): the
  weight dequantized once, at first use, into a dense copy that is cached. That is exact but
  holds the dense bytes; the reference path (``impl="reference"``) dequantizes per call. Where
  the compiled CPU kernels take such a weight (int4 / int8 codes in groups of a multiple of 16,
  a few rows; :mod:`tgraph.kernels.cpu_backend.native`), they read its codes instead: the dense
  copy's bits, without the copy.

Packed forms are cached per weight (keyed by the codes tensor, dropped with it), never per step.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from tgraph.quant import QuantizedWeight, unpack_int4

__all__ = ["INT4_GROUP_SIZES", "PackedLinear", "packed_how", "packed_linear"]

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu takes
# The packed kernels' vectorised path takes bf16 activations and scales (fp32 does not).
_ACT = torch.bfloat16
_INT8_MM = torch.ops.aten._weight_int8pack_mm.default


def packed_how(w: QuantizedWeight, dtype: torch.dtype, bf16: bool = True,
               int8_groups: bool = False) -> str:
    """Which form :class:`PackedLinear` gives ``w`` (its ``how``), without packing anything."""
    scheme, k = w.scheme, w.shape[1]
    group = scheme.block[1]
    packable = bf16 and dtype == torch.float32
    if packable and scheme.kind == "int4" and group in INT4_GROUP_SIZES and k % group == 0:
        return "int4pack"
    if packable and scheme.kind == "int8" and group == k:
        return "int8pack"
    if packable and int8_groups and scheme.kind == "int8" and scheme.block[0] == 1 \
            and w.offset is None and k % group == 0:
        return "int8groups"
    return "dense"


class PackedLinear:
    """A quantized weight in the form a CPU kernel reads, and ``run(x2, out2)``: ``out2 = x2 @
    w.T`` for fp32 ``x2 [M, K]``.

    Attributes:
        how: ``"int4pack"``, ``"int8pack"``, ``"int8groups"`` or ``"dense"`` (what ``str`` and
            tests report).
    """

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype, bf16: bool = True,
                 int8_groups: bool = False) -> None:
        self.perm = self.source_perm = w.perm
        self.n, self.k = w.shape
        self.dtype = dtype
        group = w.scheme.block[1]
        self.how = packed_how(w, dtype, bf16, int8_groups)
        if self.how == "int4pack":
            codes = unpack_int4(w.qdata).to(torch.int32)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.group = group
            s = w.scale.t()  # (K / G, N)
            z = torch.zeros_like(s) if w.offset is None else w.offset.t() + 8.0 * s
            self.scales_zeros = torch.stack((s, z), dim=-1).to(_ACT).contiguous()
        elif self.how == "int8pack":
            self.packed = w.qdata.contiguous()
            self.scales = w.scale.reshape(self.n).to(_ACT).contiguous()
            self.offsets = None if w.offset is None else w.offset.reshape(self.n).contiguous()
        elif self.how == "int8groups":
            self.group = group
            # (K / G, N, G): each group's codes a contiguous [N, G] matrix, its scales [N]
            self.packed = w.qdata.view(self.n, -1, group).transpose(0, 1).contiguous()
            self.scales = w.scale.t().to(_ACT).contiguous()
            self.per_group = list(zip(self.packed.unbind(0), self.scales.unbind(0)))
        else:
            self.packed = w.dequantize(dtype)
            self.perm = None  # dequantize() put the columns back in place

    def run(self, x2: torch.Tensor, out2: torch.Tensor) -> None:
        """``out2 = x2 @ w.T`` (``x2``: ``[M, K]`` in the packed dtype)."""
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.how == "dense":
            torch.mm(x2, self.packed.t(), out=out2)
            return
        xa = x2.to(_ACT)
        if self.how == "int4pack":
            out2.copy_(torch.ops.aten._weight_int4pack_mm_for_cpu(
                xa, self.packed, self.group, self.scales_zeros))
            return
        if self.how == "int8groups":
            parts = zip(xa.view(xa.shape[0], -1, self.group).unbind(1), self.per_group)
            x_g, (codes, scales) = next(parts)
            out2.copy_(_INT8_MM(x_g, codes, scales))
            for x_g, (codes, scales) in parts:
                out2.add_(_INT8_MM(x_g, codes, scales))
            return
        out2.copy_(_INT8_MM(xa, self.packed, self.scales))
        if self.offsets is not None:
            out2.addr_(x2.sum(1), self.offsets)


# (id(codes tensor), dtype, bf16, int8 groups, rows) -> (a weak reference to the codes, packed
# form); an entry leaves with its codes.
_CACHE: dict[tuple, tuple[weakref.ref, PackedLinear]] = {}


def _forget(key: tuple) -> None:
    _CACHE.pop(key, None)


def packed_linear(w: QuantizedWeight, dtype: torch.dtype, bf16: bool = True,
                  int8_groups: bool = False, rows: tuple[int, int] | None = None
                  ) -> PackedLinear:
    """``w`` packed for the CPU kernels at activation dtype ``dtype`` (made on first use).

    Args:
        w: the quantized weight.
        dtype: the activations' dtype.
        bf16: take the packed kernels' bf16 path (``CpuTuning.bf16_quant_activations``); false
            gives the exact dense copy.
        int8_groups: run int8 weights with group scales packed too
            (``CpuTuning.int8_group_kernel``; with ``bf16`` only).
        rows: ``(start, length)``: only those rows of ``w``, packed and kept on their own (one
            expert of stacked experts).
    """
    key = (id(w.qdata), dtype, bf16, int8_groups, rows)
    shape = tuple(w.shape) if rows is None else (rows[1], w.shape[1])
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w.qdata and hit[1].source_perm is w.perm \
            and (hit[1].n, hit[1].k) == shape:
        return hit[1]
    packed = PackedLinear(w if rows is None else w.narrow(0, *rows), dtype, bf16, int8_groups)
    if hit is None:
        weakref.finalize(w.qdata, _forget, key)
    _CACHE[key] = (weakref.ref(w.qdata), packed)
    return packed


def cached_forms() -> list[Any]:
    """The packed forms alive now (for tests)."""
    return [entry[1] for entry in _CACHE.values()]
