"""The Triton kernels of the small-M linear (decode GEMV): the main kernel with its fused norm,
SwiGLU, split-K fixup and TMA weight reads, and the split-K reduce kernel.

The design, the launch heuristics and the public entry point with its checks are in
:mod:`tgraph.kernels.triton.gemv` (:func:`~tgraph.kernels.triton.gemv.small_m_linear`); this module
holds only device code, so the launch side reads on its own.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_wait
from tgraph.kernels.triton.quant_tiles import (
    dequantize_groups,
    fold_part,
    load_codes,
    load_scale_tile,
    load_scales,
)


@triton.jit
def _load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M: tl.constexpr, NORM: tl.constexpr,
                 HAS_G: tl.constexpr):
    """One ``[BLOCK_M, BLOCK_K]`` tile of ``x`` and its rows' sums of squares (when ``NORM``).

    With ``NORM`` the tile comes back in fp32 and multiplied by the norm weight ``g``; the rows'
    ``1 / rms`` is applied to the accumulator after the loop (it factors out of the dot product).
    """
    xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    # One return: the compiler wants one signature (the branches are resolved at compile time).
    if NORM:
        xf = xv.to(tl.float32)
        sq = tl.sum(xf * xf, axis=1)
        if HAS_G:
            xf = xf * tl.load(g_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :]
        tile = xf
    else:
        sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        tile = xv
    return tile, sq


@triton.jit
def _mac(acc, w, xv, BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += x_tile . w_tile`` for one K tile, by M bucket (see the module docstring)."""
    if BLOCK_M == 1:
        # acc is [BLOCK_N, BLOCK_K]: elementwise FMA, reduced over K once after the loop.
        return acc + w.to(tl.float32) * xv.to(tl.float32)
    elif SWAP_AB:
        # acc is [BLOCK_N, BLOCK_M]: the weight tile on the MMA's M side.
        if F32_DOT:
            return tl.dot(w.to(tl.float32), tl.trans(xv.to(tl.float32)), acc,
                          input_precision="ieee")
        return tl.dot(w, tl.trans(xv.to(w.dtype)), acc)
    elif F32_DOT:
        # Full-precision fp32 products (not TF32); see _use_f32_dot.
        return tl.dot(xv.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(xv.to(w.dtype), tl.trans(w), acc)


@triton.jit
def _load_w_tile(w_rows, u_rows, w_desc, n0, u0, k0, k_end, mask_n, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, W_DESC: tl.constexpr):
    """The weight tile at ``k0`` (and the "up" rows' tile when ``GATED``; else the same tile).

    ``W_DESC``: read by TMA through ``w_desc`` at rows ``n0`` (and ``u0``), where rows and
    columns past the weight read as zeros; rows past N of the gate half read up rows instead,
    which only feed output columns that are never stored.
    """
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_end
    if W_DESC:
        w = w_desc.load([n0, k0])
        if GATED:
            w_u = w_desc.load([u0, k0])
        else:
            w_u = w
    else:
        mask_w = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=mask_w, other=0.0)
        if GATED:
            w_u = tl.load(u_rows + offs_k[None, :], mask=mask_w, other=0.0)
        else:
            w_u = w
    return w, w_u, offs_k, mask_k


@triton.jit
def _k_step(acc, acc_u, sq, w, w_u, x_rows, g_ptr, offs_k, mask_m, mask_k,
            BLOCK_M: tl.constexpr, NORM: tl.constexpr, HAS_G: tl.constexpr,
            GATED: tl.constexpr, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K tile of the main loop: the activations' tile, its sums of squares, the products."""
    xv, part = _load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G)
    sq += part
    acc = _mac(acc, w, xv, BLOCK_M, F32_DOT, SWAP_AB)
    if GATED:
        acc_u = _mac(acc_u, w_u, xv, BLOCK_M, F32_DOT, SWAP_AB)
    return acc, acc_u, sq


@triton.jit
def _load_q_tile(w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
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


@triton.jit
def _k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr, offs_k, mask_m, mask_k,
              BLOCK_M: tl.constexpr, NORM: tl.constexpr, HAS_G: tl.constexpr,
              GATED: tl.constexpr, F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
              QZERO: tl.constexpr, QOFFSETS: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, QNG: tl.constexpr):
    """One K tile on a quantized weight. ``BLOCK_M == 1``: the tile dequantized in fp32 and
    multiplied elementwise (CUDA cores, as the bf16 GEMV of one row); else the products on the
    codes on tensor cores, folded with the tile's scales."""
    xv, part = _load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G)
    sq += part
    # One return at the end: Triton compiles no return inside a branch.
    if BLOCK_M == 1:
        acc = _mac(acc, dequantize_groups(v, s, b, QZERO, QOFFSETS, BLOCK_N, BLOCK_K, QNG), xv,
                   BLOCK_M, F32_DOT, SWAP_AB)
        if GATED:
            acc_u = _mac(acc_u, dequantize_groups(v_u, s_u, b_u, QZERO, QOFFSETS, BLOCK_N,
                                                  BLOCK_K, QNG), xv, BLOCK_M, F32_DOT, SWAP_AB)
    else:
        xd = xv.to(v.dtype)
        # The row sums of exactly the values the products see (x rounded to the MMA's dtype).
        sx = tl.sum(xd.to(tl.float32), axis=1)
        acc = fold_part(acc, _mac(tl.zeros_like(acc), v, xd, BLOCK_M, F32_DOT, SWAP_AB), s, b,
                        sx, QZERO, QOFFSETS, SWAP_AB)
        if GATED:
            acc_u = fold_part(acc_u, _mac(tl.zeros_like(acc_u), v_u, xd, BLOCK_M, F32_DOT,
                                          SWAP_AB), s_u, b_u, sx, QZERO, QOFFSETS, SWAP_AB)
    return acc, acc_u, sq


# The eight codes of an int32 word of int4 bytes, each as the fp32 bits of 2**23 + q: one PRMT
# per code puts a byte of the masked nibbles under the exponent byte 0x4B.
_UNPACK_WORD_ASM: tl.constexpr = tl.constexpr("""
{
.reg .b32 lo, hi, magic;
mov.b32 magic, 0x4B000000;
and.b32 lo, $8, 0x0F0F0F0F;
shr.u32 hi, $8, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 $0, lo, magic, 0x7540;
prmt.b32 $1, lo, magic, 0x7541;
prmt.b32 $2, lo, magic, 0x7542;
prmt.b32 $3, lo, magic, 0x7543;
prmt.b32 $4, hi, magic, 0x7540;
prmt.b32 $5, hi, magic, 0x7541;
prmt.b32 $6, hi, magic, 0x7542;
prmt.b32 $7, hi, magic, 0x7543;
}
""")


@triton.jit
def _unpack_words(words, ASM: tl.constexpr):
    """Each int32 word of int4 bytes as eight fp32 tensors ``2**23 + q``: the low nibbles of
    bytes 0-3 (columns 0, 2, 4, 6 of the word's eight), then the high ones (1, 3, 5, 7).
    ``ASM``: by PTX (two integer operations per code fewer); else by Triton's integer ops (the
    interpreter)."""
    if ASM:
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            _UNPACK_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                   tl.int32), is_pure=True, pack=1)
    else:
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        c0 = (lo & 0xFF) | 0x4B000000
        c1 = ((lo >> 8) & 0xFF) | 0x4B000000
        c2 = ((lo >> 16) & 0xFF) | 0x4B000000
        c3 = ((lo >> 24) & 0xFF) | 0x4B000000
        c4 = (hi & 0xFF) | 0x4B000000
        c5 = ((hi >> 8) & 0xFF) | 0x4B000000
        c6 = ((hi >> 16) & 0xFF) | 0x4B000000
        c7 = ((hi >> 24) & 0xFF) | 0x4B000000
    return (c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True),
            c2.to(tl.float32, bitcast=True), c3.to(tl.float32, bitcast=True),
            c4.to(tl.float32, bitcast=True), c5.to(tl.float32, bitcast=True),
            c6.to(tl.float32, bitcast=True), c7.to(tl.float32, bitcast=True))


@triton.jit
def _x_word_columns(x_rows, g_ptr, offs_w, mask_w, W: tl.constexpr, NORM: tl.constexpr,
                    HAS_G: tl.constexpr):
    """The activations of one row under ``W`` words of codes: loaded as one contiguous ``[W, 8]``
    tile (times the norm weight, with its sum of squares) and split in registers into the eight
    ``[1, W]`` columns in the order of :func:`_unpack_words` (0, 2, 4, 6, 1, 3, 5, 7)."""
    cols = 8 * offs_w[:, None] + tl.arange(0, 8)[None, :]
    xv = tl.load(x_rows + cols, mask=mask_w[:, None], other=0.0).to(tl.float32)
    sq = tl.sum(tl.sum(xv * xv, axis=1), axis=0)
    if HAS_G:
        xv = xv * tl.load(g_ptr + cols, mask=mask_w[:, None], other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(xv, [W, 4, 2]))  # columns 0 2 4 6 | 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, [W, 2, 2]))
    o15, o37 = tl.split(tl.reshape(odd, [W, 2, 2]))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    if not NORM:
        sq = 0.0
    return (x0[None, :], x2[None, :], x4[None, :], x6[None, :], x1[None, :], x3[None, :],
            x5[None, :], x7[None, :], sq)


@triton.jit
def _word_column(acc, acc_u, v, v_u, s, b, s_u, b_u, xv, BLOCK_N: tl.constexpr,
                 W: tl.constexpr, GATED: tl.constexpr, QNG: tl.constexpr,
                 QOFFSETS: tl.constexpr, QZERO: tl.constexpr):
    """One of a word's eight code columns against its column of x."""
    acc += dequantize_groups(v, s, b, QZERO, QOFFSETS, BLOCK_N, W, QNG) * xv
    if GATED:
        acc_u += dequantize_groups(v_u, s_u, b_u, QZERO, QOFFSETS, BLOCK_N, W, QNG) * xv
    return acc, acc_u


@triton.jit
def _load_words(w_rows, u_rows, k0, k_end, mask_n, BLOCK_K: tl.constexpr, GATED: tl.constexpr):
    """The int32 words of codes of the K tile at ``k0`` (and of the "up" rows); past ``k_end``
    they read as zeros."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = mask_n[:, None] & (offs_w < k_end // 8)[None, :]
    words = tl.load(w_rows + offs_w[None, :], mask=mask, other=0)
    if GATED:
        words_u = tl.load(u_rows + offs_w[None, :], mask=mask, other=0)
    else:
        words_u = words
    return words, words_u


@triton.jit
def _int4_row_step(acc, acc_u, sq, words, words_u, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n,
                   k0, k_end, stride_qs, x_rows, g_ptr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                   HAS_G: tl.constexpr, QROWS: tl.constexpr, QCOLS: tl.constexpr,
                   QNG: tl.constexpr, QOFFSETS: tl.constexpr, QZERO: tl.constexpr,
                   ASM: tl.constexpr):
    """One K tile of one row on int4 codes read as int32 ``words`` (eight codes each; ``words_u``
    the "up" rows'): the eight code columns of the words, each against its column of x (with
    the fused norm's sums of squares); ``acc`` is ``[BLOCK_N, BLOCK_K / 8]``."""
    W: tl.constexpr = BLOCK_K // 8
    offs_w = k0 // 8 + tl.arange(0, W)
    mask_w = offs_w < k_end // 8
    c0, c1, c2, c3, c4, c5, c6, c7 = _unpack_words(words, ASM)
    s, b = load_scale_tile(qs_ptr, qb_ptr, offs_n, mask_n, k0, k_end, stride_qs, QROWS, QCOLS,
                           QNG, QOFFSETS)
    if GATED:
        u0, u1, u2, u3, u4, u5, u6, u7 = _unpack_words(words_u, ASM)
        s_u, b_u = load_scale_tile(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, k_end,
                                   stride_qs, QROWS, QCOLS, QNG, QOFFSETS)
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = c0, c1, c2, c3, c4, c5, c6, c7
        s_u, b_u = s, b
    x0, x1, x2, x3, x4, x5, x6, x7, part = _x_word_columns(x_rows, g_ptr, offs_w, mask_w, W,
                                                          NORM, HAS_G)
    sq += part
    acc, acc_u = _word_column(acc, acc_u, c0, u0, s, b, s_u, b_u, x0, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c1, u1, s, b, s_u, b_u, x1, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c2, u2, s, b, s_u, b_u, x2, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c3, u3, s, b, s_u, b_u, x3, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c4, u4, s, b, s_u, b_u, x4, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c5, u5, s, b, s_u, b_u, x5, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c6, u6, s, b, s_u, b_u, x6, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    acc, acc_u = _word_column(acc, acc_u, c7, u7, s, b, s_u, b_u, x7, BLOCK_N, W, GATED, QNG,
                              QOFFSETS, QZERO)
    return acc, acc_u, sq


@triton.jit
def small_m_linear_kernel(
    x_ptr, w_ptr, w_desc, g_ptr, bias_ptr, res_ptr, out_ptr, ws_ptr, count_ptr, qs_ptr, qb_ptr,
    M, N, K, k_per_split, gate_rows, eps,
    stride_xm, stride_wn, stride_rm, stride_om, stride_qs,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    NORM: tl.constexpr, HAS_G: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
    FIXUP: tl.constexpr = False, W_DESC: tl.constexpr = False,
    QKIND: tl.constexpr = -1, QROWS: tl.constexpr = 1, QCOLS: tl.constexpr = 1,
    QOFFSETS: tl.constexpr = False, QZERO: tl.constexpr = 0.0, QBASE_BITS: tl.constexpr = 0,
    NATIVE_FP8: tl.constexpr = False, QDTYPE: tl.constexpr = tl.float32, QNG: tl.constexpr = 1,
):
    """Output columns ``[pid_n * BLOCK_N, +BLOCK_N)`` of ``BLOCK_M`` rows over one K split.

    ``NORM``: ``x`` is RMS-normalised on the fly (times ``g`` when ``HAS_G``); the sums of squares
    come from the main loop. With ``WRITE_PARTIAL`` (split K) the partial sums stay unscaled and
    the program of column block 0 stores its split's sums of squares after the ``[split, M,
    width]`` partials, for the reduce to apply ``1 / rms``.
    ``GATED``: the program also computes the same columns of the "up" half (weight rows
    ``gate_rows + n``) and the output is ``silu(gate) * up`` (N counts the output columns).
    ``W_DESC``: weight tiles are read by TMA through the tensor descriptor ``w_desc`` (whose
    block is ``[BLOCK_N, BLOCK_K]``) instead of through pointers.
    ``QKIND >= 0``: ``w_ptr`` is a quantized weight's packed codes (``stride_wn`` elements per row;
    int4 codes of one row are read as int32 words)
    with fp32 scales at ``qs_ptr`` (and offsets at ``qb_ptr``), ``stride_qs`` per scale row, one
    scale block per ``(QROWS, QCOLS)`` weights; every K tile lies in one block (the launch sees
    to it), except that a one-row (``BLOCK_M == 1``) tile spans ``QNG`` whole blocks. Tensor
    cores multiply the codes (``QDTYPE``) and fold the scales once per tile; one row runs the
    dequantized tile on CUDA cores (:mod:`tgraph.kernels.triton.quant_tiles`).
    ``FIXUP`` (with ``WRITE_PARTIAL``): the split that finishes last for its output tile sums the
    tile's partials (and, with ``NORM``, the splits' sums of squares) and writes ``out`` (see
    :func:`_fixup_tile`).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: a vocabulary projection can exceed 2**31 weight elements.
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + gate_rows.to(tl.int64) * stride_wn  # the "up" rows when GATED
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm

    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    if BLOCK_M == 1 and QKIND == 0:  # int4, one row: one column per int32 word of codes
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    elif SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros_like(acc)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)

    # First K tile: its weights do not depend on any earlier kernel, so they are loaded before
    # the PDL wait and stream while the previous kernel drains (see tgraph.kernels.triton.pdl).
    n0 = pid_n * BLOCK_N
    u0 = n0 + gate_rows
    if QKIND == 0 and BLOCK_M == 1:
        words, words_u = _load_words(w_rows, u_rows, k_start, k_end, mask_n, BLOCK_K, GATED)
        pdl_wait(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            # A plain linear loads the next tile's words before this tile's math (two tiles in
            # flight); a gated one already has two and loses occupancy to a third and fourth.
            if not GATED:
                next_words, next_u = _load_words(w_rows, u_rows, k0 + BLOCK_K, k_end, mask_n,
                                                 BLOCK_K, GATED)
            acc, acc_u, sq = _int4_row_step(
                acc, acc_u, sq, words, words_u, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0,
                k_end, stride_qs, x_rows, g_ptr, BLOCK_N, BLOCK_K, GATED, NORM, HAS_G,
                QROWS, QCOLS, QNG, QOFFSETS, QZERO, NATIVE_FP8)
            if GATED:
                next_words, next_u = _load_words(w_rows, u_rows, k0 + BLOCK_K, k_end, mask_n,
                                                 BLOCK_K, GATED)
            words, words_u = next_words, next_u
    elif QKIND >= 0:
        v, v_u, s, b, s_u, b_u, offs_k, mask_k = _load_q_tile(
            w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k_start, k_end, stride_qs,
            BLOCK_M, BLOCK_N, BLOCK_K, GATED, QKIND, QROWS, QCOLS, QNG, QOFFSETS, QBASE_BITS,
            NATIVE_FP8, QDTYPE)
        pdl_wait(PDL)
        acc, acc_u, sq = _k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr, offs_k,
                                   mask_m, mask_k, BLOCK_M, NORM, HAS_G, GATED, F32_DOT, SWAP_AB,
                                   QZERO, QOFFSETS, BLOCK_N, BLOCK_K, QNG)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            v, v_u, s, b, s_u, b_u, offs_k, mask_k = _load_q_tile(
                w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
                BLOCK_M, BLOCK_N, BLOCK_K, GATED, QKIND, QROWS, QCOLS, QNG, QOFFSETS, QBASE_BITS,
                NATIVE_FP8, QDTYPE)
            acc, acc_u, sq = _k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr,
                                       offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G, GATED,
                                       F32_DOT, SWAP_AB, QZERO, QOFFSETS, BLOCK_N, BLOCK_K, QNG)
    else:
        w, w_u, offs_k, mask_k = _load_w_tile(w_rows, u_rows, w_desc, n0, u0, k_start, k_end,
                                              mask_n, BLOCK_K, GATED, W_DESC)
        pdl_wait(PDL)
        acc, acc_u, sq = _k_step(acc, acc_u, sq, w, w_u, x_rows, g_ptr, offs_k, mask_m, mask_k,
                                 BLOCK_M, NORM, HAS_G, GATED, F32_DOT, SWAP_AB)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            w, w_u, offs_k, mask_k = _load_w_tile(w_rows, u_rows, w_desc, n0, u0, k0, k_end,
                                                  mask_n, BLOCK_K, GATED, W_DESC)
            acc, acc_u, sq = _k_step(acc, acc_u, sq, w, w_u, x_rows, g_ptr, offs_k, mask_m,
                                     mask_k, BLOCK_M, NORM, HAS_G, GATED, F32_DOT, SWAP_AB)

    if BLOCK_M == 1:
        acc = tl.sum(acc, axis=1)[None, :]
        acc_u = tl.sum(acc_u, axis=1)[None, :]
    elif SWAP_AB:
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if WRITE_PARTIAL:
        # Workspace [split, M, N] (GATED: [split, M, 2N], gate columns then up columns), then
        # (NORM) the sums of squares [split, M].
        width = 2 * N if GATED else N
        ws = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * width + offs_n[None, :]
        tl.store(ws, acc, mask=mask_mn)
        if GATED:
            tl.store(ws + N, acc_u, mask=mask_mn)
        if NORM:
            # NOTE: with FIXUP every column block stores its split's sums of squares, so that the
            # last split of any tile finds all of them: the blocks of one split compute them from
            # the same K range of x in the same order, so they store the same bits to one place.
            if FIXUP or pid_n == 0:
                sq_ptrs = ws_ptr + tl.num_programs(1) * M * width + pid_k * M + offs_m
                tl.store(sq_ptrs, sq, mask=mask_m)
        if FIXUP:
            _fixup_tile(ws_ptr, count_ptr, bias_ptr, res_ptr, out_ptr, M, N, K, gate_rows, eps,
                        stride_rm, stride_om, offs_m, offs_n, mask_m, mask_n, mask_mn,
                        HAS_BIAS, HAS_RES, GATED, NORM, BLOCK_M, BLOCK_N)
    else:
        if NORM:
            rstd = tl.math.rsqrt(sq / K + eps)
            acc = acc * rstd[:, None]
            acc_u = acc_u * rstd[:, None]
        out = _epilogue(acc, acc_u, bias_ptr, res_ptr, offs_m, offs_n, mask_n, mask_mn, gate_rows,
                        stride_rm, HAS_BIAS, HAS_RES, GATED)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_mn)


@triton.jit
def _fixup_tile(ws_ptr, count_ptr, bias_ptr, res_ptr, out_ptr, M, N, K, gate_rows, eps,
                stride_rm, stride_om, offs_m, offs_n, mask_m, mask_n, mask_mn,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr,
                NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K without a second launch: after its partial is stored, a split takes a ticket from
    its output tile's arrival counter; the split that arrives last sums the tile's partials in
    split order (the order, and so the bits, of :func:`split_k_reduce_kernel`), applies
    ``1 / rms`` from the splits' sums of squares (``NORM``) and the epilogue, writes ``out`` and
    puts the counter back to 0 for the next launch."""
    splits = tl.num_programs(1)
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    # Every thread's partial is stored before the ticket is taken; the release orders them
    # before the increment, the last split's acquire orders its reads after all of them.
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == splits - 1:
        width = 2 * N if GATED else N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, splits):
            part = ws_ptr + (s * M + offs_m.to(tl.int64))[:, None] * width + offs_n[None, :]
            # .cg: read at L2, where the other splits' stores are, never a stale L1 line.
            acc += tl.load(part, mask=mask_mn, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_u += tl.load(part + N, mask=mask_mn, other=0.0, cache_modifier=".cg")
        if NORM:
            sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in range(0, splits):
                sq += tl.load(ws_ptr + splits * M * width + s * M + offs_m, mask=mask_m, other=0.0,
                              cache_modifier=".cg")
            rstd = tl.math.rsqrt(sq / K + eps)
            acc = acc * rstd[:, None]
            acc_u = acc_u * rstd[:, None]
        out = _epilogue(acc, acc_u, bias_ptr, res_ptr, offs_m, offs_n, mask_n, mask_mn,
                        gate_rows, stride_rm, HAS_BIAS, HAS_RES, GATED)
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_mn)
        tl.store(count_ptr + tile, 0)


@triton.jit
def _epilogue(acc, acc_u, bias_ptr, res_ptr, offs_m, offs_n, mask_n, mask_mn, gate_rows, stride_rm,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr):
    """Bias, the gate (``silu(gate) * up``) and the residual, on fp32 ``[BLOCK_M, BLOCK_N]``."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(bias_ptr + gate_rows + offs_n, mask=mask_n,
                             other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_u
    if HAS_RES:
        res = res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :]
        acc += tl.load(res, mask=mask_mn, other=0.0).to(tl.float32)
    return acc


@triton.jit
def split_k_reduce_kernel(
    ws_ptr, bias_ptr, res_ptr, out_ptr,
    M, N, K, split_k, gate_rows, eps,
    stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    width = 2 * N if GATED else N
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    # Fixed summation order over the splits: deterministic results.
    for s in range(0, split_k):
        row = ws_ptr + (s * M + m) * width + offs_n[None, :]
        acc += tl.load(row, mask=mask_n[None, :], other=0.0)
        if GATED:
            acc_u += tl.load(row + N, mask=mask_n[None, :], other=0.0)
    if NORM:  # 1 / rms of the row from the splits' sums of squares, same fixed order
        sq = tl.zeros((1,), dtype=tl.float32)
        for s in range(0, split_k):
            sq += tl.load(ws_ptr + split_k * M * width + s * M + m + tl.arange(0, 1))
        rstd = tl.math.rsqrt(sq / K + eps)
        acc = acc * rstd[:, None]
        acc_u = acc_u * rstd[:, None]
    offs_m = m + tl.arange(0, 1)
    out = _epilogue(acc, acc_u, bias_ptr, res_ptr, offs_m, offs_n, mask_n, mask_n[None, :],
                    gate_rows, stride_rm, HAS_BIAS, HAS_RES, GATED)
    tl.store(out_ptr + m * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_n[None, :])
