"""Device code of the one-row small-M linear on int4 codes (:mod:`tgraph.kernels.triton.gemv`):
each int32 word of eight codes against its eight activations. bf16 activations sum a word's
products as two bf16x2 chains (:func:`_word_dot_ptx`, 2.25 instructions a code); fp16 ones as
``0.5 + q / 256`` in one fp32 FMA a code, fp32 ones exactly (:func:`_word_sums`); the words'
sums are scaled per group in fp32.

The main kernel, :func:`~tgraph.kernels.triton.gemv_kernels.small_m_linear_kernel`, calls
:func:`load_words` and :func:`int4_row_step` for ``QKIND == 0`` and ``BLOCK_M == 1``.
"""
from __future__ import annotations

import struct

import triton
import triton.language as tl

from tgraph.kernels.triton.quant_tiles import load_scale_tile

__all__ = ["int4_row_step", "load_words", "load_x_eights"]


def _unpack_word_ptx(magic: int, byte_at: int) -> str:
    """PTX for the eight codes of an int32 word of int4 bytes as fp32 bits: the low nibbles of
    bytes 0-3, then the high ones, each masked nibble's byte put by one PRMT at byte ``byte_at``
    (0 or 2) of ``magic``, whose other bytes fill the rest."""
    lines = [".reg .b32 lo, hi, magic;", f"mov.b32 magic, {magic:#010x};",
             "and.b32 lo, $8, 0x0F0F0F0F;", "shr.u32 hi, $8, 4;", "and.b32 hi, hi, 0x0F0F0F0F;"]
    sources = [("lo", byte) for byte in range(4)] + [("hi", byte) for byte in range(4)]
    for out, (src, byte) in enumerate(sources):
        # PRMT selector: result byte k is source byte 4 + k (magic's own) but at byte_at
        picks = [byte if k == byte_at else 4 + k for k in range(4)]
        selector = sum(pick << (4 * k) for k, pick in enumerate(picks))
        lines.append(f"prmt.b32 ${out}, {src}, magic, {selector:#06x};")
    return "{\n" + "\n".join(lines) + "\n}"


# EXACT: a nibble under the exponent byte 0x4B at byte 0, 2**23 + q; otherwise at byte 2 of
# 0x3F000000, 0.5 + q / 256 (see _word_sums).
_UNPACK_WORD_ASM: tl.constexpr = tl.constexpr(_unpack_word_ptx(0x4B000000, 0))
_UNPACK_WORD_HALF_ASM: tl.constexpr = tl.constexpr(_unpack_word_ptx(0x3F000000, 2))


def _bf16_bits(value: float) -> int:
    """The bits of ``value`` as bf16 (exact for the small integers used here)."""
    return struct.unpack("<I", struct.pack("<f", value))[0] >> 16


def _word_dot_ptx(zero: int) -> str:
    """PTX for ``sum((q - zero) * x)`` over an int32 word of eight int4 codes (nibble ``n`` holds
    column ``n``) against four bf16x2 pairs of activations (``$2``-``$5``: columns ``i`` and
    ``i + 4``), returned as fp32. Per pair: one LOP3 puts nibbles ``i`` and ``i + 4`` under the
    bf16 ``128`` in each half, one FMA makes ``q - zero`` (exact), one FMA accumulates; the
    two halves' sums are added in fp32: 2.25 instructions per code."""
    off = _bf16_bits(-(128.0 + zero))
    lines = [".reg .b32 c0, c1, c2, c3, t, one, off, msk, mag, acc, lo, hi;",
             "mov.b32 one, 0x3F803F80;", f"mov.b32 off, {off << 16 | off:#010x};",
             "mov.b32 msk, 0x000F000F;", "mov.b32 mag, 0x43004300;",
             "lop3.b32 c0, $1, msk, mag, 0xEA;"]  # (a & b) | c
    for i in range(1, 4):
        lines += [f"shr.u32 t, $1, {4 * i};", f"lop3.b32 c{i}, t, msk, mag, 0xEA;"]
    lines += [f"fma.rn.bf16x2 c{i}, c{i}, one, off;" for i in range(4)]
    lines.append("mov.b32 acc, 0x80008000;")  # -0.0: the first FMA returns the product's bits
    lines += [f"fma.rn.bf16x2 acc, c{i}, ${2 + i}, acc;" for i in range(4)]
    lines += ["shl.b32 lo, acc, 16;", "and.b32 hi, acc, 0xFFFF0000;", "add.f32 $0, lo, hi;"]
    return "{\n" + "\n".join(lines) + "\n}"


# Codes centred on 8 whatever the layout: sums of smaller products round less (offsets fold it).
_WORD_DOT_ASM: tl.constexpr = tl.constexpr(_word_dot_ptx(8))


@triton.jit
def _bf16_high_bits(v, ASM: tl.constexpr):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even), as int32 bits with the bf16 in the
    high half; ``ASM``: by the hardware's conversion, else by integer ops (the interpreter's
    conversion truncates)."""
    if ASM:
        bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits


@triton.jit
def _pair_bits(a, b, ASM: tl.constexpr):
    """``a`` (low half) and ``b`` (high half) rounded to bf16, as one int32 of bf16x2 bits."""
    lo = (_bf16_high_bits(a, ASM) >> 16) & 0xFFFF
    return lo | _bf16_high_bits(b, ASM)


@triton.jit
def _bf16_fma(words, shift: tl.constexpr, pair, half: tl.constexpr, acc):
    """``acc + (q - 8) * x`` rounded to bf16 as ``fma.rn.bf16x2`` does (for the interpreter),
    for the nibble at bit ``shift`` of ``words`` and the ``half`` (0 low, 1 high) of the bf16x2
    ``pair``."""
    q = ((words >> shift) & 0xF).to(tl.float32) - 8.0
    if half == 0:
        x = (pair << 16).to(tl.float32, bitcast=True)
    else:
        x = (pair & -65536).to(tl.float32, bitcast=True)
    return _bf16_high_bits(q * x + acc, False).to(tl.float32, bitcast=True)


@triton.jit
def _packed_word_dot(words, p0, p1, p2, p3, ASM: tl.constexpr):
    """``sum((q - 8) * x)`` per int32 word of int4 codes on bf16x2 pairs of activations (see
    :func:`_word_dot_ptx`); the interpreter rounds as the PTX does."""
    if ASM:
        t = tl.inline_asm_elementwise(_WORD_DOT_ASM, "=f,r,r,r,r,r", [words, p0, p1, p2, p3],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        lo = _bf16_fma(words, 0, p0, 0, tl.zeros(words.shape, tl.float32))
        hi = _bf16_fma(words, 16, p0, 1, tl.zeros(words.shape, tl.float32))
        lo = _bf16_fma(words, 4, p1, 0, lo)
        hi = _bf16_fma(words, 20, p1, 1, hi)
        lo = _bf16_fma(words, 8, p2, 0, lo)
        hi = _bf16_fma(words, 24, p2, 1, hi)
        lo = _bf16_fma(words, 12, p3, 0, lo)
        hi = _bf16_fma(words, 28, p3, 1, hi)
        t = lo + hi
    return t


@triton.jit
def _code_bits(nibbles, EXACT: tl.constexpr):
    """The fp32 bits of ``2**23 + q`` (``EXACT``) or ``0.5 + q / 256`` for bytes ``nibbles``."""
    if EXACT:
        bits = nibbles | 0x4B000000
    else:
        bits = (nibbles << 16) | 0x3F000000
    return bits


@triton.jit
def _unpack_words(words, ASM: tl.constexpr, EXACT: tl.constexpr):
    """Each int32 word of int4 bytes as eight fp32 tensors, ``2**23 + q`` (``EXACT``) or
    ``0.5 + q / 256``: the low nibbles of bytes 0-3 (columns 0, 2, 4, 6 of the word's eight),
    then the high ones (1, 3, 5, 7). ``ASM``: by PTX (two integer operations per code fewer);
    else by Triton's integer ops (the interpreter)."""
    if ASM:
        PTX: tl.constexpr = _UNPACK_WORD_ASM if EXACT else _UNPACK_WORD_HALF_ASM
        c0, c1, c2, c3, c4, c5, c6, c7 = tl.inline_asm_elementwise(
            PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32, tl.int32,
                   tl.int32), is_pure=True, pack=1)
    else:
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        c0 = _code_bits(lo & 0xFF, EXACT)
        c1 = _code_bits((lo >> 8) & 0xFF, EXACT)
        c2 = _code_bits((lo >> 16) & 0xFF, EXACT)
        c3 = _code_bits((lo >> 24) & 0xFF, EXACT)
        c4 = _code_bits(hi & 0xFF, EXACT)
        c5 = _code_bits((hi >> 8) & 0xFF, EXACT)
        c6 = _code_bits((hi >> 16) & 0xFF, EXACT)
        c7 = _code_bits((hi >> 24) & 0xFF, EXACT)
    return (c0.to(tl.float32, bitcast=True), c1.to(tl.float32, bitcast=True),
            c2.to(tl.float32, bitcast=True), c3.to(tl.float32, bitcast=True),
            c4.to(tl.float32, bitcast=True), c5.to(tl.float32, bitcast=True),
            c6.to(tl.float32, bitcast=True), c7.to(tl.float32, bitcast=True))


@triton.jit
def load_x_eights(x_rows, g_ptr, offs_w, mask_w, HAS_G: tl.constexpr):
    """One row's activations under the groups of eight codes ``offs_w`` (int4 words, fp8 pairs
    of words): one contiguous fp32 ``[W, 8]`` tile times the norm weight (``HAS_G``), and the
    sum of squares of the activations themselves (for a fused norm)."""
    cols = 8 * offs_w[:, None] + tl.arange(0, 8)[None, :]
    xv = tl.load(x_rows + cols, mask=mask_w[:, None], other=0.0).to(tl.float32)
    sq = tl.sum(tl.sum(xv * xv, axis=1), axis=0)
    if HAS_G:
        xv = xv * tl.load(g_ptr + cols, mask=mask_w[:, None], other=0.0).to(tl.float32)
    return xv, sq


@triton.jit
def _x_word_columns(x_rows, g_ptr, offs_w, mask_w, W: tl.constexpr, NORM: tl.constexpr,
                    HAS_G: tl.constexpr):
    """The activations of one row under ``W`` words of codes (:func:`load_x_eights`) split in
    registers into the eight ``[1, W]`` columns in the order of :func:`_unpack_words` (0, 2, 4,
    6, 1, 3, 5, 7); then the sum of each word's eight (``[1, W]``, for the offsets) and the sum
    of squares."""
    xv, sq = load_x_eights(x_rows, g_ptr, offs_w, mask_w, HAS_G)
    sx = tl.sum(xv, axis=1)
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
            x5[None, :], x7[None, :], sx[None, :], sq)


@triton.jit
def _word_sums(c0, c1, c2, c3, c4, c5, c6, c7, x0, x1, x2, x3, x4, x5, x6, x7,
               EXACT: tl.constexpr, QZERO: tl.constexpr):
    """Each word's eight codes times their activations, summed: ``[BLOCK_N, W]``.

    ``EXACT``: ``sum_j (c_j - ZERO) * x_j`` on ``c = 2**23 + q``, exact products, two operations
    per code. Otherwise one FMA per code: ``sum_j c_j * x_j`` on ``c = 0.5 + q / 256``, whose
    ``256 * (t - sum(x) / 2) = sum(q * x)`` loses ~2**-13 of ``sum(|x|)`` per word to the
    cancellation (see :func:`_fold_words`): far below a 16-bit output's rounding, so only fp32
    activations take the exact form.
    """
    ZERO: tl.constexpr = QZERO if EXACT else 0.0
    t = (c0 - ZERO) * x0
    t += (c1 - ZERO) * x1
    t += (c2 - ZERO) * x2
    t += (c3 - ZERO) * x3
    t += (c4 - ZERO) * x4
    t += (c5 - ZERO) * x5
    t += (c6 - ZERO) * x6
    t += (c7 - ZERO) * x7
    return t


@triton.jit
def _fold_words(acc, t, s, b, sx, BLOCK_N: tl.constexpr, W: tl.constexpr, QNG: tl.constexpr,
                QOFFSETS: tl.constexpr, EXACT: tl.constexpr, QZERO: tl.constexpr):
    """``acc += s * sum((q - z) * x) + b * sum(x)`` per word from its sums ``t`` (see
    :func:`_word_sums`) and ``sx = sum(x)``, each of the ``QNG`` groups' scale (and offset)
    broadcast over its words. Not ``EXACT``: ``sum((q - z) * x) = 256 * t - (128 + z) * sx``
    with ``z = QZERO - 2**23``, folded into the group's two factors."""
    s3 = s[:, :, None]
    sx3 = tl.reshape(sx, [1, QNG, W // QNG])
    t = tl.reshape(t, [BLOCK_N, QNG, W // QNG])
    if EXACT:
        t = t * s3
        if QOFFSETS:
            t += b[:, :, None] * sx3
    else:
        b3 = -(128.0 + (QZERO - 8388608.0)) * s3
        if QOFFSETS:
            b3 += b[:, :, None]
        t = t * (256.0 * s3) + b3 * sx3
    return acc + tl.reshape(t, [BLOCK_N, W])


@triton.jit
def _packed_row_step(acc, acc_u, words, words_u, x0, x1, x2, x3, x4, x5, x6, x7, s, b, sx,
                     qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
                     BLOCK_N: tl.constexpr, W: tl.constexpr, GATED: tl.constexpr,
                     QROWS: tl.constexpr, QCOLS: tl.constexpr, QNG: tl.constexpr,
                     QOFFSETS: tl.constexpr, QZERO: tl.constexpr, ASM: tl.constexpr):
    """:func:`int4_row_step` on bf16 activations: each word's ``t = sum((q - 8) * x)`` in
    bf16x2 (:func:`_packed_word_dot`), then ``s * t`` in fp32, with offsets ``+ (b + 8 s) *
    sum(x)``, as the exact form folds its sums."""
    shape: tl.constexpr = [BLOCK_N, W]
    # Nibble n of a word holds its column n: pair i is columns i and i + 4.
    p0 = tl.broadcast_to(_pair_bits(x0, x4, ASM), shape)
    p1 = tl.broadcast_to(_pair_bits(x1, x5, ASM), shape)
    p2 = tl.broadcast_to(_pair_bits(x2, x6, ASM), shape)
    p3 = tl.broadcast_to(_pair_bits(x3, x7, ASM), shape)
    t = _packed_word_dot(words, p0, p1, p2, p3, ASM)
    acc = _fold_words(acc, t, s, b + 8.0 * s, sx, BLOCK_N, W, QNG, QOFFSETS, True, QZERO)
    if GATED:  # the "up" rows against the same pairs
        s_u, b_u = load_scale_tile(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, k_end,
                                   stride_qs, QROWS, QCOLS, QNG, QOFFSETS)
        t_u = _packed_word_dot(words_u, p0, p1, p2, p3, ASM)
        acc_u = _fold_words(acc_u, t_u, s_u, b_u + 8.0 * s_u, sx, BLOCK_N, W, QNG, QOFFSETS,
                            True, QZERO)
    return acc, acc_u


@triton.jit
def load_words(w_rows, u_rows, k0, k_end, mask_n, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
               PER_WORD: tl.constexpr = 8):
    """The int32 words of codes (``PER_WORD`` each: 8 int4, 4 fp8) of the K tile at ``k0`` (and
    of the "up" rows); past ``k_end`` they read as zeros."""
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
    mask = mask_n[:, None] & (offs_w < k_end // PER_WORD)[None, :]
    words = tl.load(w_rows + offs_w[None, :], mask=mask, other=0)
    if GATED:
        words_u = tl.load(u_rows + offs_w[None, :], mask=mask, other=0)
    else:
        words_u = words
    return words, words_u


@triton.jit
def int4_row_step(acc, acc_u, sq, words, words_u, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n,
                   k0, k_end, stride_qs, x_rows, g_ptr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                   HAS_G: tl.constexpr, QROWS: tl.constexpr, QCOLS: tl.constexpr,
                   QNG: tl.constexpr, QOFFSETS: tl.constexpr, QZERO: tl.constexpr,
                   ASM: tl.constexpr):
    """One K tile of one row on int4 codes read as int32 ``words`` (eight codes each; ``words_u``
    the "up" rows'): each word's eight codes against their columns of x, summed, then scaled
    per word (with the fused norm's sums of squares); ``acc`` is ``[BLOCK_N, BLOCK_K / 8]``."""
    W: tl.constexpr = BLOCK_K // 8
    offs_w = k0 // 8 + tl.arange(0, W)
    mask_w = offs_w < k_end // 8
    # bf16 activations take packed bf16x2 products (see _word_dot_ptx); fp16 ones one fp32 FMA
    # per code (see _word_sums); fp32 ones the exact products.
    PACKED: tl.constexpr = x_rows.dtype.element_ty == tl.bfloat16
    EXACT: tl.constexpr = x_rows.dtype.element_ty == tl.float32
    x0, x1, x2, x3, x4, x5, x6, x7, sx, part = _x_word_columns(x_rows, g_ptr, offs_w, mask_w,
                                                              W, NORM, HAS_G)
    sq += part
    s, b = load_scale_tile(qs_ptr, qb_ptr, offs_n, mask_n, k0, k_end, stride_qs, QROWS, QCOLS,
                           QNG, QOFFSETS)
    if PACKED:  # x0..x7 are columns 0, 2, 4, 6, 1, 3, 5, 7: passed in column order
        acc, acc_u = _packed_row_step(acc, acc_u, words, words_u, x0, x4, x1, x5, x2, x6, x3,
                                      x7, s, b, sx, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n,
                                      k0, k_end, stride_qs, BLOCK_N, W, GATED, QROWS, QCOLS,
                                      QNG, QOFFSETS, QZERO, ASM)
    else:
        acc, acc_u = _fp32_row_step(acc, acc_u, words, words_u, x0, x1, x2, x3, x4, x5, x6, x7,
                                    s, b, sx, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0,
                                    k_end, stride_qs, BLOCK_N, W, GATED, QROWS, QCOLS, QNG,
                                    QOFFSETS, QZERO, ASM, EXACT)
    return acc, acc_u, sq


@triton.jit
def _fp32_row_step(acc, acc_u, words, words_u, x0, x1, x2, x3, x4, x5, x6, x7, s, b, sx,
                   qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
                   BLOCK_N: tl.constexpr, W: tl.constexpr, GATED: tl.constexpr,
                   QROWS: tl.constexpr, QCOLS: tl.constexpr, QNG: tl.constexpr,
                   QOFFSETS: tl.constexpr, QZERO: tl.constexpr, ASM: tl.constexpr,
                   EXACT: tl.constexpr):
    """:func:`int4_row_step` on fp16 or fp32 activations, in fp32: ``x0``-``x7`` are columns 0,
    2, 4, 6, 1, 3, 5, 7 of each word, as :func:`_unpack_words` returns its codes."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _unpack_words(words, ASM, EXACT)
    t = _word_sums(c0, c1, c2, c3, c4, c5, c6, c7, x0, x1, x2, x3, x4, x5, x6, x7, EXACT, QZERO)
    acc = _fold_words(acc, t, s, b, sx, BLOCK_N, W, QNG, QOFFSETS, EXACT, QZERO)
    if GATED:  # the "up" rows against the same activations
        s_u, b_u = load_scale_tile(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, k_end,
                                   stride_qs, QROWS, QCOLS, QNG, QOFFSETS)
        u0, u1, u2, u3, u4, u5, u6, u7 = _unpack_words(words_u, ASM, EXACT)
        t_u = _word_sums(u0, u1, u2, u3, u4, u5, u6, u7, x0, x1, x2, x3, x4, x5, x6, x7, EXACT,
                         QZERO)
        acc_u = _fold_words(acc_u, t_u, s_u, b_u, sx, BLOCK_N, W, QNG, QOFFSETS, EXACT, QZERO)
    return acc, acc_u
