"""Device code of the small-M linear on quantized weights (:mod:`tgraph.kernels.triton.gemv`):
tiles of codes and scales, and the step that multiplies them (tensor cores folding the scales
per tile, or one row on CUDA cores); one row of int4 codes has its own step, on int32 words
(:mod:`tgraph.kernels.triton.gemv_int4_row`), and so do 2-64 rows of int4 and fp8 codes
(:mod:`tgraph.kernels.triton.gemv_words_mma`).

The main kernel, :func:`~tgraph.kernels.triton.gemv_kernels.small_m_linear_kernel`, calls these
under its ``QKIND`` constexpr; the layouts are :mod:`tgraph.kernels.triton.quant_tiles`'.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tgraph.kernels.triton.gemv_tiles import fold_columns, load_x_tile, mac
from tgraph.kernels.triton.quant_tiles import (
    dequantize_groups,
    fold_part,
    load_codes,
    load_scale_tile,
    load_scales,
)

__all__ = ["ROW_FOLD", "k_step_q", "load_q_tile"]


@triton.jit
def load_q_tile(w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, QKIND: tl.constexpr, QROWS: tl.constexpr,
                 QCOLS: tl.constexpr, QNG: tl.constexpr, QOFFSETS: tl.constexpr,
                 QBASE_BITS: tl.constexpr, NATIVE_FP8: tl.constexpr, DTYPE: tl.constexpr):
    """A quantized weight's tile at ``k0``: codes and scales (and the "up" rows' when ``GATED``;
    else the same again), see :mod:`tgraph.kernels.triton.quant_tiles`. ``BLOCK_M == 1``: the
    tile spans ``QNG`` scale blocks, scales ``[BLOCK_N, QNG]``; else one, scales per row."""
    v = load_codes(w_rows, k0, k_end, mask_n, BLOCK_N, BLOCK_K, QKIND, QBASE_BITS, NATIVE_FP8,
                   DTYPE)
    if BLOCK_M == 1:
        s, b = load_scale_tile(qs_ptr, qb_ptr, offs_n, mask_n, k0, k_end, stride_qs, QROWS, QCOLS,
                               QNG, QOFFSETS)
    else:
        s, b = load_scales(qs_ptr, qb_ptr, offs_n, mask_n, k0, stride_qs, QROWS, QCOLS, QOFFSETS)
    if GATED:
        v_u = load_codes(u_rows, k0, k_end, mask_n, BLOCK_N, BLOCK_K, QKIND, QBASE_BITS,
                         NATIVE_FP8, DTYPE)
        if BLOCK_M == 1:
            s_u, b_u = load_scale_tile(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, k_end,
                                       stride_qs, QROWS, QCOLS, QNG, QOFFSETS)
        else:
            s_u, b_u = load_scales(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, stride_qs,
                                   QROWS, QCOLS, QOFFSETS)
    else:
        v_u, s_u, b_u = v, s, b
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return v, v_u, s, b, s_u, b_u, offs_k, offs_k < k_end


# A one-row tile of one-byte codes is summed in runs of 16 columns (one thread's 16-byte load).
ROW_FOLD: tl.constexpr = tl.constexpr(16)


@triton.jit
def k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr, offs_k, mask_m, mask_k,
              BLOCK_M: tl.constexpr, NORM: tl.constexpr, HAS_G: tl.constexpr,
              GATED: tl.constexpr, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
              QZERO: tl.constexpr, QOFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, QNG: tl.constexpr):
    """One K tile on a quantized weight. ``BLOCK_M == 1``: the tile dequantized in fp32 and
    multiplied elementwise (CUDA cores, as the bf16 GEMV of one row); else the products on the
    codes on tensor cores, folded with the tile's scales."""
    xv, part = load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G)
    sq += part
    # One return at the end: Triton compiles no return inside a branch.
    if BLOCK_M == 1:
        acc += fold_columns(dequantize_groups(v, s, b, QZERO, QOFFSETS, BLOCK_N, BLOCK_K, QNG)
                            * xv, BLOCK_N, BLOCK_K, ROW_FOLD)
        if GATED:
            acc_u += fold_columns(dequantize_groups(v_u, s_u, b_u, QZERO, QOFFSETS, BLOCK_N,
                                                    BLOCK_K, QNG) * xv, BLOCK_N, BLOCK_K,
                                  ROW_FOLD)
    else:
        xd = xv.to(v.dtype)
        # The row sums of exactly the values the products see (x rounded to the MMA's dtype).
        sx = tl.sum(xd.to(tl.float32), axis=1)
        acc = fold_part(acc, mac(tl.zeros_like(acc), v, xd, BLOCK_M, F32_DOT, SWAP_AB), s, b,
                        sx, QZERO, QOFFSETS, SWAP_AB)
        if GATED:
            acc_u = fold_part(acc_u, mac(tl.zeros_like(acc_u), v_u, xd, BLOCK_M, F32_DOT,
                                          SWAP_AB), s_u, b_u, sx, QZERO, QOFFSETS, SWAP_AB)
    return acc, acc_u, sq
