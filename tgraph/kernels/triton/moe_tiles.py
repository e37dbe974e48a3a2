"""What the expert kernels share: reading a tile of an expert's weight rows, dense or quantized.

The experts' weights reach the kernels as one 2-D operand of ``experts * rows`` rows (a
``[E, rows, K]`` tensor viewed flat, or a :class:`~tgraph.quant.QuantizedWeight` of that logical
shape, its rows expert after expert): expert ``e``'s row ``n`` is row ``e * rows + n``. A
quantized tile is read as codes and dequantized in registers (``w = s * (v - ZERO) + b``, see
:mod:`tgraph.kernels.triton.quant_tiles`), then rounded to the activations' dtype, as the
``moe`` op's reference rounds a dequantized expert; only the codes cross the memory bus.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.kernels.triton.quant_tiles import (
    KIND_IDS,
    code_zero,
    dequantize_tile,
    load_codes,
    load_scales,
)
from tgraph.quant import QuantizedWeight, is_quantized

__all__ = ["ExpertWeight", "expert_dot", "expert_tile", "expert_weight", "packed_experts_ok"]


@triton.jit
def expert_tile(w_ptr, s_ptr, b_ptr, rows, mask_n, k0, K, stride_w, stride_s,
                QUANT: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                ZERO: tl.constexpr, OFFSETS: tl.constexpr, QROWS: tl.constexpr,
                QCOLS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DTYPE: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` tile of weight ``rows`` (flat row indices) from column ``k0``
    in ``DTYPE``; masked rows and columns from ``K`` read as 0. A quantized tile must lie in
    one scale block along K (the launch picks ``BLOCK_K`` so)."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    if QUANT:
        v = load_codes(w_rows, k0, K, mask_n, BLOCK_N, BLOCK_K, KIND, 0, NATIVE_FP8, tl.float32)
        s, b = load_scales(s_ptr, b_ptr, rows, mask_n, k0, stride_s, QROWS, QCOLS, OFFSETS)
        w = dequantize_tile(v, s, b, ZERO, OFFSETS).to(DTYPE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k < K)[None, :],
                    other=0.0).to(DTYPE)
    return w


@triton.jit
def expert_dot(w_ptr, s_ptr, b_ptr, rows, mask_n, k0, K, stride_w, stride_s, xv,
               KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, ZERO: tl.constexpr,
               OFFSETS: tl.constexpr, QROWS: tl.constexpr, QCOLS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N]`` fp32 products of quantized weight ``rows`` with the fp32 activations
    ``xv [BLOCK_K]`` from column ``k0``, on the codes: the tile's scale (and offset) folded
    once per row, ``s * (v . x - ZERO * sum(x)) + b * sum(x)``, not once per weight."""
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    v = load_codes(w_rows, k0, K, mask_n, BLOCK_N, BLOCK_K, KIND, 0, NATIVE_FP8, tl.float32)
    part = tl.sum(v * xv[None, :], axis=1)
    s, b = load_scales(s_ptr, b_ptr, rows, mask_n, k0, stride_s, QROWS, QCOLS, OFFSETS)
    sx = tl.sum(xv, axis=0)
    if ZERO != 0.0:
        part = part - ZERO * sx
    out = s * part
    if OFFSETS:
        out += b * sx
    return out


@dataclass(frozen=True)
class ExpertWeight:
    """One experts operand made ready for :func:`expert_tile`: pointers, strides, constexprs.

    Attributes:
        data: the flat ``[E * rows, K]`` weight or codes (fp8 codes as uint8 bits where the
            interpreter decodes them).
        scale: fp32 scales (``data`` itself when dense: never read).
        offset: fp32 offsets (``scale`` when there are none: never read).
        stride_w: ``data``'s row stride (elements; bytes for int4 codes).
        stride_s: ``scale``'s row stride.
        block_k: the largest K tile (a power of two) that stays in one scale block.
        constexprs: ``QUANT, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS`` for the launch.
    """

    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    stride_w: int
    stride_s: int
    block_k: int
    constexprs: dict


def packed_experts_ok(w: object) -> bool:
    """Whether the kernels read quantized experts ``w`` packed: no column permutation, and
    scale blocks along K of at least 16 columns (one scale per row of a K tile)."""
    if not is_quantized(w):
        return True
    cols = w.scheme.block[1]
    return w.perm is None and (cols >= w.shape[1] or cols % 16 == 0)


def expert_weight(w: torch.Tensor | QuantizedWeight, flat_rows: int, block_k: int
                  ) -> ExpertWeight:
    """``w`` (``[E, rows, K]`` dense, or quantized ``[E * rows, K]``) as flat rows for the
    kernels, with a K tile of at most ``block_k``."""
    if not is_quantized(w):
        data = w.reshape(flat_rows, w.shape[-1])
        consts = dict(QUANT=False, KIND=0, NATIVE_FP8=False, ZERO=0.0, OFFSETS=False, QROWS=1,
                      QCOLS=1)
        return ExpertWeight(data, data, data, data.stride(0), 0, block_k, consts)
    scheme = w.scheme
    rows, cols = scheme.block
    n, k = w.shape
    native_fp8 = w.qdata.is_cuda and not envs.TRITON_INTERPRET
    data = w.qdata.view(torch.uint8) if scheme.kind == "fp8" and not native_fp8 else w.qdata
    if cols < k:
        block_k = min(block_k, cols & -cols)
    consts = dict(QUANT=True, KIND=KIND_IDS[scheme.kind], NATIVE_FP8=native_fp8,
                  ZERO=code_zero(scheme.kind, scheme.offsets, 0.0), OFFSETS=scheme.offsets,
                  # One block spanning the dim: the same constexpr for every shape.
                  QROWS=rows if rows < n else 1 << 30, QCOLS=cols if cols < k else 1 << 30)
    offset = w.offset if w.offset is not None else w.scale
    return ExpertWeight(data, w.scale, offset, data.stride(0), w.scale.stride(0), block_k, consts)
