"""Device code of the one-row small-M linear on fp8 e4m3 codes with 16-bit activations
(:mod:`tgraph.kernels.triton.gemv`): packed fp16 products on int32 words of codes.

Codes are read as int32 words of four and taken eight at a time (two words, a "unit"), against
the unit's eight activations as four fp16x2 pairs. Per unit: four ``cvt.rn.f16x2.e4m3x2`` make
the codes exact fp16 pairs, one ``mul`` and three ``fma.rn.f16x2`` sum the products in two
chains of four (columns ``0, 2, 4, 6`` and ``1, 3, 5, 7``), and the two halves are added in
fp32: 1.4 instructions a code (the fp32 loop on one-byte codes: docs/performance.md).

fp16 has 11 significant bits, but its range is short: a chain of four products of e4m3 codes
(at most 448) must stay below 65504. So each unit's activations are scaled by a power of two
that puts their largest magnitude into ``[16, 32)`` (exact; bf16 values keep their 8 bits), and
the unit's sum is scaled back as it is folded with the weight's scales in fp32. Rounding: each
chain rounds its products and partial sums to fp16, four times, so a unit's sum is within
``4 * 2**-11`` of ``sum |q x|`` (scaled) of the exact one, where an fp32 loop would be within
``2**-22``; the output's own bf16 rounding is ``2**-9``.

The main kernel, :func:`~tgraph.kernels.triton.gemv_kernels.small_m_linear_kernel`, calls
:func:`fp8_row_step` for ``QKIND == 2`` with ``BLOCK_M == 1`` and ``QWORDS``, on words from
:func:`~tgraph.kernels.triton.gemv_int4_row.load_words`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tgraph.kernels.triton.gemv_int4_row import load_x_eights
from tgraph.kernels.triton.quant_tiles import fp8_e4m3_value, load_scale_tile

__all__ = ["fp8_row_step"]


def _unit_dot_ptx() -> str:
    """PTX for ``sum(code * x)`` over a unit of eight e4m3 codes (``$1``: columns 0-3, ``$2``:
    4-7, a byte each) against four fp16x2 pairs of activations (``$3``-``$6``: columns ``2 i``
    and ``2 i + 1``), returned as fp32."""
    lines = [".reg .b16 a, b, c, d, lo16, hi16;", ".reg .b32 c0, c1, c2, c3, acc;",
             ".reg .f32 lo, hi;",
             "mov.b32 {a, b}, $1;", "mov.b32 {c, d}, $2;",
             "cvt.rn.f16x2.e4m3x2 c0, a;", "cvt.rn.f16x2.e4m3x2 c1, b;",
             "cvt.rn.f16x2.e4m3x2 c2, c;", "cvt.rn.f16x2.e4m3x2 c3, d;",
             "mul.rn.f16x2 acc, c0, $3;", "fma.rn.f16x2 acc, c1, $4, acc;",
             "fma.rn.f16x2 acc, c2, $5, acc;", "fma.rn.f16x2 acc, c3, $6, acc;",
             "mov.b32 {lo16, hi16}, acc;", "cvt.f32.f16 lo, lo16;", "cvt.f32.f16 hi, hi16;",
             "add.f32 $0, lo, hi;"]
    return "{\n" + "\n".join(lines) + "\n}"


_UNIT_DOT_ASM: tl.constexpr = tl.constexpr(_unit_dot_ptx())


@triton.jit
def _half_bits(v):
    """fp32 ``v`` rounded to fp16 (to nearest even), as int32 bits in the low half."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _half(v):
    """fp32 ``v`` rounded to fp16, back in fp32 (the interpreter's model of an fp16 result)."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _chain(words, x_lo, x_hi, byte: tl.constexpr, acc):
    """One fp16 FMA step of the interpreter's model: code ``byte`` of ``words`` times ``x_lo``
    (even byte) or ``x_hi`` (odd), added to ``acc`` and rounded once, as ``fma.rn.f16x2`` does."""
    code = fp8_e4m3_value((words >> (8 * byte)) & 0xFF)
    x = x_lo if byte % 2 == 0 else x_hi
    return _half(code * x + acc)


@triton.jit
def _unit_dot(w_lo, w_hi, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """``sum(code * x)`` per unit of eight codes in two fp16 chains (see :func:`_unit_dot_ptx`;
    ``x0``-``x7`` are the unit's scaled activations, fp16 values in fp32)."""
    if ASM:
        p0 = _half_bits(x0) | (_half_bits(x1) << 16)
        p1 = _half_bits(x2) | (_half_bits(x3) << 16)
        p2 = _half_bits(x4) | (_half_bits(x5) << 16)
        p3 = _half_bits(x6) | (_half_bits(x7) << 16)
        shape: tl.constexpr = w_lo.shape
        t = tl.inline_asm_elementwise(
            _UNIT_DOT_ASM, "=f,r,r,r,r,r,r",
            [w_lo, w_hi, tl.broadcast_to(p0, shape), tl.broadcast_to(p1, shape),
             tl.broadcast_to(p2, shape), tl.broadcast_to(p3, shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        zero = tl.zeros(w_lo.shape, tl.float32)
        even = _chain(w_lo, _half(x0), _half(x1), 0, zero)
        odd = _chain(w_lo, _half(x0), _half(x1), 1, zero)
        even = _chain(w_lo, _half(x2), _half(x3), 2, even)
        odd = _chain(w_lo, _half(x2), _half(x3), 3, odd)
        even = _chain(w_hi, _half(x4), _half(x5), 0, even)
        odd = _chain(w_hi, _half(x4), _half(x5), 1, odd)
        even = _chain(w_hi, _half(x6), _half(x7), 2, even)
        odd = _chain(w_hi, _half(x6), _half(x7), 3, odd)
        t = even + odd
    return t


@triton.jit
def _x_units(x_rows, g_ptr, offs_u, mask_u, U: tl.constexpr, NORM: tl.constexpr,
             HAS_G: tl.constexpr):
    """The row's activations under ``U`` units of eight codes (:func:`load_x_eights`), each unit
    scaled by the power of two that puts its largest magnitude into ``[16, 32)`` and split into
    its eight ``[1, U]`` columns; then the units' inverse powers ``[1, U]`` and the sum of
    squares."""
    xv, sq = load_x_eights(x_rows, g_ptr, offs_u, mask_u, HAS_G)
    top = tl.max(tl.abs(xv), axis=1)
    # 2**e with e = 131 - biased exponent of top (an all-zero unit: e clamped, its x stay 0)
    e = tl.minimum(tl.maximum(131 - ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF), -100), 100)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    xv = xv * up[:, None]
    halves = tl.reshape(xv, [U, 2, 4])
    lo, hi = tl.split(tl.permute(halves, (0, 2, 1)))  # columns 0-3 | 4-7
    a, b = tl.split(tl.reshape(lo, [U, 2, 2]))  # 0, 2 | 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    c, d = tl.split(tl.reshape(hi, [U, 2, 2]))
    x4, x6 = tl.split(c)
    x5, x7 = tl.split(d)
    if not NORM:
        sq = 0.0
    return (x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :],
            x6[None, :], x7[None, :], down[None, :], sq)


@triton.jit
def _fold_units(acc, t, s, down, BLOCK_N: tl.constexpr, U: tl.constexpr, QNG: tl.constexpr):
    """``acc += s * down * t`` per unit, each of the ``QNG`` scale blocks' ``s`` broadcast over
    its units."""
    t = tl.reshape(t * down, [BLOCK_N, QNG, U // QNG]) * s[:, :, None]
    return acc + tl.reshape(t, [BLOCK_N, U])


@triton.jit
def fp8_row_step(acc, acc_u, sq, words, words_u, qs_ptr, offs_n, gate_rows, mask_n, k0, k_end,
                 stride_qs, x_rows, g_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GATED: tl.constexpr, NORM: tl.constexpr, HAS_G: tl.constexpr,
                 QROWS: tl.constexpr, QCOLS: tl.constexpr, QNG: tl.constexpr,
                 ASM: tl.constexpr):
    """One K tile of one row on fp8 codes read as int32 ``words`` (``[BLOCK_N, BLOCK_K / 4]``;
    ``words_u`` the "up" rows'): each unit of eight codes against its activations in fp16
    chains, folded per unit; ``acc`` is ``[BLOCK_N, BLOCK_K / 8]``."""
    U: tl.constexpr = BLOCK_K // 8
    offs_u = k0 // 8 + tl.arange(0, U)
    mask_u = offs_u < k_end // 8
    x0, x1, x2, x3, x4, x5, x6, x7, down, part = _x_units(x_rows, g_ptr, offs_u, mask_u, U,
                                                          NORM, HAS_G)
    sq += part
    s, b = load_scale_tile(qs_ptr, qs_ptr, offs_n, mask_n, k0, k_end, stride_qs, QROWS, QCOLS,
                           QNG, False)
    w_lo, w_hi = tl.split(tl.reshape(words, [BLOCK_N, U, 2]))
    acc = _fold_units(acc, _unit_dot(w_lo, w_hi, x0, x1, x2, x3, x4, x5, x6, x7, ASM), s, down,
                      BLOCK_N, U, QNG)
    if GATED:  # the "up" rows against the same activations
        s_u, b_u = load_scale_tile(qs_ptr, qs_ptr, offs_n + gate_rows, mask_n, k0, k_end,
                                   stride_qs, QROWS, QCOLS, QNG, False)
        u_lo, u_hi = tl.split(tl.reshape(words_u, [BLOCK_N, U, 2]))
        acc_u = _fold_units(acc_u, _unit_dot(u_lo, u_hi, x0, x1, x2, x3, x4, x5, x6, x7, ASM),
                            s_u, down, BLOCK_N, U, QNG)
    return acc, acc_u, sq
