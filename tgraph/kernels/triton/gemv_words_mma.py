"""Device code of the small-M linear for 2-64 rows on int4 and fp8 codes
(:mod:`tgraph.kernels.triton.gemv`): tensor cores fed straight from int32 words of codes, in the
stored layout, with the weight on the MMA's M side.

An MMA operand register holds two adjacent elements of K, so each word is turned into such
registers by one or two instructions and a K tile becomes a few MMAs, each on one kind of pair
of every word against the matching columns of the activations (split from their tile in
registers). The codes go from the pipeline's shared-memory stage straight into the MMA's
registers, with no second pass through shared memory, at one instruction a pair at most:

- int4 (eight codes a word, nibble ``c`` holding column ``c``): one LOP3 of the word shifted
  right by ``4 i`` puts nibbles ``i`` and ``i + 4`` under a 16-bit float's exponent (bf16
  ``128 + q``, fp16 ``1024 + q``), four MMAs a tile; ``ZERO`` folds with the rows' sums of x.
- fp8 e4m3 (four codes a word): one ``cvt.rn.f16x2.e4m3x2`` per half word makes columns ``2 h``
  and ``2 h + 1`` exact fp16, two MMAs a tile, in fp16. bf16 activations enter fp16 scaled per
  row and tile by a power of two that puts their largest into ``[2**14, 2**15)``, exactly
  (bf16's 8 significant bits fit fp16's 11; only elements below ``2**-28`` of a row's largest
  lose bits), and the products are scaled back as the tile folds.

The scales fold once per tile as for the other layouts
(:func:`~tgraph.kernels.triton.quant_tiles.fold_part`). Under the interpreter (and for fp32
activations) the pairs are the codes' values and the MMAs fp32 ones, in the same arrangement.

The main kernel, :func:`~tgraph.kernels.triton.gemv_kernels.small_m_linear_kernel`, calls
:func:`load_word_tile` and :func:`words_mma_step` for ``QWORDS``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tgraph.kernels.triton.gemv_int4_row import load_words
from tgraph.kernels.triton.gemv_tiles import load_x_tile, mac
from tgraph.kernels.triton.quant_tiles import KIND_INT4, fold_part, fp8_e4m3_value, load_scales

__all__ = ["load_word_tile", "words_mma_step"]


def _int4_pair_ptx(magic: int) -> str:
    """PTX for a 32-bit register of two codes, nibbles 0 and 4 of ``$1`` under the 16-bit float
    bits ``magic`` (``(a & b) | c``)."""
    return f"lop3.b32 $0, $1, 0x000F000F, {magic << 16 | magic:#010x}, 0xEA;"


def _fp8_pair_ptx(half: int) -> str:
    """PTX for the two e4m3 codes of 16-bit half ``half`` of ``$1`` as an fp16x2 register."""
    return ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
            f"cvt.rn.f16x2.e4m3x2 $0, {'hi' if half else 'lo'}; }}")


_INT4_BF16_ASM: tl.constexpr = tl.constexpr(_int4_pair_ptx(0x4300))
_INT4_FP16_ASM: tl.constexpr = tl.constexpr(_int4_pair_ptx(0x6400))
_FP8_LOW_ASM: tl.constexpr = tl.constexpr(_fp8_pair_ptx(0))
_FP8_HIGH_ASM: tl.constexpr = tl.constexpr(_fp8_pair_ptx(1))


@triton.jit
def load_word_tile(w_rows, u_rows, w_desc, n0, u0, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0,
                   k_end, stride_qs, BLOCK_K: tl.constexpr, GATED: tl.constexpr,
                   W_DESC: tl.constexpr, QKIND: tl.constexpr, QROWS: tl.constexpr,
                   QCOLS: tl.constexpr, QOFFSETS: tl.constexpr):
    """The K tile at ``k0`` as int32 words ``[BLOCK_N, words]`` with its rows' scales (and
    offsets), and the "up" rows' when ``GATED`` (else the same again); the tile lies in one
    scale block. ``W_DESC``: the words by TMA through ``w_desc`` at rows ``n0`` (and ``u0``),
    reading zeros past the weight, as the dense tiles are read."""
    PER_WORD: tl.constexpr = 8 if QKIND == KIND_INT4 else 4
    if W_DESC:
        words = w_desc.load([n0, k0 // PER_WORD])
        if GATED:
            words_u = w_desc.load([u0, k0 // PER_WORD])
        else:
            words_u = words
    else:
        words, words_u = load_words(w_rows, u_rows, k0, k_end, mask_n, BLOCK_K, GATED, PER_WORD)
    s, b = load_scales(qs_ptr, qb_ptr, offs_n, mask_n, k0, stride_qs, QROWS, QCOLS, QOFFSETS)
    if GATED:
        s_u, b_u = load_scales(qs_ptr, qb_ptr, offs_n + gate_rows, mask_n, k0, stride_qs, QROWS,
                               QCOLS, QOFFSETS)
    else:
        s_u, b_u = s, b
    return words, words_u, s, b, s_u, b_u


@triton.jit
def _flat(pairs):
    """``[rows, W, 2]`` -> ``[rows, 2 W]``."""
    return tl.reshape(pairs, [pairs.shape[0], 2 * pairs.shape[1]])


@triton.jit
def _asm_pairs(words, PTX: tl.constexpr, BF16: tl.constexpr):
    """``[BLOCK_N, W]`` words -> ``[BLOCK_N, W, 2]`` bf16 (``BF16``) or fp16 pairs made by
    ``PTX`` (``$1`` the word, ``$0`` the pair's register). pack=2: one instance makes both
    halves of a register, its two inputs the same word, joined for the shape."""
    if BF16:
        pairs = tl.inline_asm_elementwise(PTX, "=r,r,r", [tl.join(words, words)],
                                          dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        pairs = tl.inline_asm_elementwise(PTX, "=r,r,r", [tl.join(words, words)],
                                          dtype=tl.float16, is_pure=True, pack=2)
    return pairs


@triton.jit
def _int4_pairs(shifted, DTYPE: tl.constexpr, MAGIC: tl.constexpr, ASM: tl.constexpr):
    """``[BLOCK_N, W]`` words shifted right by ``4 i`` -> ``[BLOCK_N, 2 W]`` codes, nibbles ``i``
    and ``i + 4`` of word ``w`` at ``2 w`` and ``2 w + 1``: ``ASM``, one LOP3 per pair putting
    both under ``MAGIC`` (bf16 ``0x4300`` or fp16 ``0x6400``: ``magic + q``); else the codes'
    values ``q`` converted."""
    if ASM:
        PTX: tl.constexpr = _INT4_BF16_ASM if MAGIC == 0x4300 else _INT4_FP16_ASM
        pairs = _asm_pairs(shifted, PTX, MAGIC == 0x4300)
    else:
        pairs = tl.join(shifted & 0xF, (shifted >> 16) & 0xF).to(DTYPE)
    return _flat(pairs)


@triton.jit
def _fp8_pairs(words, HALF: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """``[BLOCK_N, W]`` words of four e4m3 codes -> ``[BLOCK_N, 2 W]``: the codes of half word
    ``HALF`` (columns ``2 HALF`` and ``2 HALF + 1`` of the word's four), exact fp16 by one
    conversion per pair (``ASM``), else their values."""
    if ASM:
        PTX: tl.constexpr = _FP8_LOW_ASM if HALF == 0 else _FP8_HIGH_ASM
        pairs = _asm_pairs(words, PTX, False)
    else:
        low = fp8_e4m3_value((words >> (16 * HALF)) & 0xFF)
        high = fp8_e4m3_value((words >> (16 * HALF + 8)) & 0xFF)
        pairs = tl.join(low, high).to(DTYPE)
    return _flat(pairs)


@triton.jit
def _x_int4_quarters(xd, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """The ``[BLOCK_M, 8 W]`` activations as four ``[BLOCK_M, 2 W]`` quarters: quarter ``i`` holds
    columns ``i`` and ``i + 4`` of each word's eight, in :func:`_int4_pairs`' order."""
    x5 = tl.reshape(xd, [BLOCK_M, W, 2, 2, 2])  # word, column // 4, (column // 2) % 2, column % 2
    even, odd = tl.split(x5)
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    shape: tl.constexpr = [BLOCK_M, 2 * W]
    return tl.reshape(x0, shape), tl.reshape(x1, shape), tl.reshape(x2, shape), \
        tl.reshape(x3, shape)


@triton.jit
def _x_fp8_halves(xd, BLOCK_M: tl.constexpr, W: tl.constexpr):
    """The ``[BLOCK_M, 4 W]`` activations as two ``[BLOCK_M, 2 W]`` halves: half ``h`` holds
    columns ``2 h`` and ``2 h + 1`` of each word's four, in :func:`_fp8_pairs`' order."""
    x4 = tl.permute(tl.reshape(xd, [BLOCK_M, W, 2, 2]), (0, 1, 3, 2))  # word, column % 2, half
    low, high = tl.split(x4)
    shape: tl.constexpr = [BLOCK_M, 2 * W]
    return tl.reshape(low, shape), tl.reshape(high, shape)


@triton.jit
def _row_powers(xf):
    """Per row of fp32 ``xf``: ``2**e`` that puts the row's largest magnitude into
    ``[2**14, 2**15)`` (``e`` clamped to +-100; an all-zero row gets ``2**100``) and ``2**-e``."""
    top = tl.max(tl.abs(xf), axis=1)
    e = tl.minimum(tl.maximum(141 - ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF), -100), 100)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), \
        ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _word_products(words, xd, BLOCK_M: tl.constexpr, W: tl.constexpr, F32_DOT: tl.constexpr,
                   QKIND: tl.constexpr, QBASE_BITS: tl.constexpr, QDTYPE: tl.constexpr,
                   ASM: tl.constexpr):
    """``sum_k code * x`` of a tile of words against the activations ``xd`` (in the MMA's
    dtype): ``[BLOCK_N, BLOCK_M]``."""
    part = tl.zeros((words.shape[0], BLOCK_M), dtype=tl.float32)
    if QKIND == KIND_INT4:
        x0, x1, x2, x3 = _x_int4_quarters(xd, BLOCK_M, W)
        part = mac(part, _int4_pairs(words, QDTYPE, QBASE_BITS, ASM), x0, BLOCK_M, F32_DOT, True)
        part = mac(part, _int4_pairs(words >> 4, QDTYPE, QBASE_BITS, ASM), x1, BLOCK_M, F32_DOT,
                   True)
        part = mac(part, _int4_pairs(words >> 8, QDTYPE, QBASE_BITS, ASM), x2, BLOCK_M, F32_DOT,
                   True)
        part = mac(part, _int4_pairs(words >> 12, QDTYPE, QBASE_BITS, ASM), x3, BLOCK_M,
                   F32_DOT, True)
    else:
        x0, x1 = _x_fp8_halves(xd, BLOCK_M, W)
        part = mac(part, _fp8_pairs(words, 0, QDTYPE, ASM), x0, BLOCK_M, F32_DOT, True)
        part = mac(part, _fp8_pairs(words, 1, QDTYPE, ASM), x1, BLOCK_M, F32_DOT, True)
    return part


@triton.jit
def words_mma_step(acc, acc_u, sq, words, words_u, s, b, s_u, b_u, x_rows, g_ptr, offs_k, mask_m,
                   mask_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                   HAS_G: tl.constexpr, GATED: tl.constexpr, F32_DOT: tl.constexpr,
                   QKIND: tl.constexpr, QZERO: tl.constexpr, QOFFSETS: tl.constexpr,
                   QBASE_BITS: tl.constexpr, QDTYPE: tl.constexpr, ASM: tl.constexpr):
    """One K tile of 2-64 rows on words of codes (``acc`` is ``[BLOCK_N, BLOCK_M]``): the MMAs on
    code pairs, folded with the tile's scales."""
    W: tl.constexpr = BLOCK_K // 8 if QKIND == KIND_INT4 else BLOCK_K // 4
    xv, part = load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G)
    sq += part
    # fp8 on bf16 activations: into fp16 by a power of two per row (see the module docstring).
    SCALED: tl.constexpr = QKIND != KIND_INT4 and x_rows.dtype.element_ty == tl.bfloat16
    if SCALED:
        xf = xv.to(tl.float32)
        up, down = _row_powers(xf)
        xd = (xf * up[:, None]).to(QDTYPE)
    else:
        xd = xv.to(QDTYPE)
    # The row sums of exactly the values the products see (x rounded to the MMA's dtype).
    if QZERO != 0.0 or QOFFSETS:
        sx = tl.sum(xd.to(tl.float32), axis=1)
    else:
        sx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    part = _word_products(words, xd, BLOCK_M, W, F32_DOT, QKIND, QBASE_BITS, QDTYPE, ASM)
    if SCALED:
        part = part * down[None, :]
    acc = fold_part(acc, part, s, b, sx, QZERO, QOFFSETS, True)
    if GATED:
        part_u = _word_products(words_u, xd, BLOCK_M, W, F32_DOT, QKIND, QBASE_BITS, QDTYPE, ASM)
        if SCALED:
            part_u = part_u * down[None, :]
        acc_u = fold_part(acc_u, part_u, s_u, b_u, sx, QZERO, QOFFSETS, True)
    return acc, acc_u, sq
