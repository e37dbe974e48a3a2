"""The Triton kernels of the small-M linear (decode GEMV): the main kernel with its fused norm,
SwiGLU, split-K fixup and TMA weight reads, and the split-K reduce kernel.

The design, the launch heuristics and the public entry point with its checks are in
:mod:`tgraph.kernels.triton.gemv` (:func:`~tgraph.kernels.triton.gemv.small_m_linear`); this module
holds only device code, so the launch side reads on its own.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tgraph.kernels.triton.gemv_fp8_row import fp8_row_step
from tgraph.kernels.triton.gemv_int4_row import int4_row_step, load_words
from tgraph.kernels.triton.gemv_quant_kernels import ROW_FOLD, k_step_q, load_q_tile
from tgraph.kernels.triton.gemv_tiles import load_x_tile, mac
from tgraph.kernels.triton.gemv_words_mma import load_word_tile, words_mma_step
from tgraph.kernels.triton.pdl import pdl_wait


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
    xv, part = load_x_tile(x_rows, g_ptr, offs_k, mask_m, mask_k, BLOCK_M, NORM, HAS_G)
    sq += part
    acc = mac(acc, w, xv, BLOCK_M, F32_DOT, SWAP_AB)
    if GATED:
        acc_u = mac(acc_u, w_u, xv, BLOCK_M, F32_DOT, SWAP_AB)
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
    ON_GPU: tl.constexpr = False, QDTYPE: tl.constexpr = tl.float32, QNG: tl.constexpr = 1,
    QWORDS: tl.constexpr = False,
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
    int4 codes of one row are read as int32 words, and with ``QWORDS`` fp8 codes of one row
    (:mod:`tgraph.kernels.triton.gemv_fp8_row`) and int4 / fp8 codes of more rows
    (:mod:`tgraph.kernels.triton.gemv_words_mma`))
    with fp32 scales at ``qs_ptr`` (and offsets at ``qb_ptr``), ``stride_qs`` per scale row, one
    scale block per ``(QROWS, QCOLS)`` weights; every K tile lies in one block (the launch sees
    to it), except that a one-row (``BLOCK_M == 1``) tile spans ``QNG`` whole blocks.
    Tensor cores multiply the codes (``QDTYPE``) and fold the scales once per tile; one row runs the
    dequantized tile on CUDA cores (:mod:`tgraph.kernels.triton.quant_tiles`). ``ON_GPU`` (not
    the interpreter): fp8 codes convert in hardware and int4 words unpack by PTX.
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

    if BLOCK_M == 1 and (QKIND == 0 or QWORDS):  # one row on words: a column per 8 codes
        acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    elif BLOCK_M == 1 and QKIND > 0:  # one-byte codes, one row: runs of ROW_FOLD columns
        acc = tl.zeros((BLOCK_N, BLOCK_K // ROW_FOLD), dtype=tl.float32)
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
    if BLOCK_M == 1 and (QKIND == 0 or QWORDS):  # one row on int32 words of int4 / fp8 codes
        PER_WORD: tl.constexpr = 8 if QKIND == 0 else 4
        words, words_u = load_words(w_rows, u_rows, k_start, k_end, mask_n, BLOCK_K, GATED,
                                    PER_WORD)
        pdl_wait(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            # A plain linear loads the next tile's words before this tile's math (two tiles in
            # flight); a gated one already has two and loses occupancy to a third and fourth.
            if not GATED:
                next_words, next_u = load_words(w_rows, u_rows, k0 + BLOCK_K, k_end, mask_n,
                                                 BLOCK_K, GATED, PER_WORD)
            if QKIND == 0:
                acc, acc_u, sq = int4_row_step(
                    acc, acc_u, sq, words, words_u, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n,
                    k0, k_end, stride_qs, x_rows, g_ptr, BLOCK_N, BLOCK_K, GATED, NORM, HAS_G,
                    QROWS, QCOLS, QNG, QOFFSETS, QZERO, ON_GPU)
            else:
                acc, acc_u, sq = fp8_row_step(
                    acc, acc_u, sq, words, words_u, qs_ptr, offs_n, gate_rows, mask_n, k0, k_end,
                    stride_qs, x_rows, g_ptr, BLOCK_N, BLOCK_K, GATED, NORM, HAS_G, QROWS,
                    QCOLS, QNG, ON_GPU)
            if GATED:
                next_words, next_u = load_words(w_rows, u_rows, k0 + BLOCK_K, k_end, mask_n,
                                                 BLOCK_K, GATED, PER_WORD)
            words, words_u = next_words, next_u
    elif QWORDS:  # int4 / fp8, 2-64 rows: MMAs on code pairs straight from int32 words
        ASM: tl.constexpr = ON_GPU and not F32_DOT  # the pairs by PTX
        words, words_u, s, b, s_u, b_u = load_word_tile(
            w_rows, u_rows, w_desc, n0, u0, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k_start,
            k_end, stride_qs, BLOCK_K, GATED, W_DESC, QKIND, QROWS, QCOLS, QOFFSETS)
        pdl_wait(PDL)
        offs_k = k_start + tl.arange(0, BLOCK_K)
        acc, acc_u, sq = words_mma_step(acc, acc_u, sq, words, words_u, s, b, s_u, b_u, x_rows,
                                        g_ptr, offs_k, mask_m, offs_k < k_end, BLOCK_M, BLOCK_K,
                                        NORM, HAS_G, GATED, F32_DOT, QKIND, QZERO, QOFFSETS,
                                        QBASE_BITS, QDTYPE, ASM)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            words, words_u, s, b, s_u, b_u = load_word_tile(
                w_rows, u_rows, w_desc, n0, u0, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0,
                k_end, stride_qs, BLOCK_K, GATED, W_DESC, QKIND, QROWS, QCOLS, QOFFSETS)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            acc, acc_u, sq = words_mma_step(acc, acc_u, sq, words, words_u, s, b, s_u, b_u,
                                            x_rows, g_ptr, offs_k, mask_m, offs_k < k_end,
                                            BLOCK_M, BLOCK_K, NORM, HAS_G, GATED, F32_DOT,
                                            QKIND, QZERO, QOFFSETS, QBASE_BITS, QDTYPE, ASM)
    elif QKIND >= 0:
        v, v_u, s, b, s_u, b_u, offs_k, mask_k = load_q_tile(
            w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k_start, k_end, stride_qs,
            BLOCK_M, BLOCK_N, BLOCK_K, GATED, QKIND, QROWS, QCOLS, QNG, QOFFSETS, QBASE_BITS,
            ON_GPU, QDTYPE)
        pdl_wait(PDL)
        acc, acc_u, sq = k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr, offs_k,
                                   mask_m, mask_k, BLOCK_M, NORM, HAS_G, GATED, F32_DOT, SWAP_AB,
                                   QZERO, QOFFSETS, BLOCK_N, BLOCK_K, QNG)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            v, v_u, s, b, s_u, b_u, offs_k, mask_k = load_q_tile(
                w_rows, u_rows, qs_ptr, qb_ptr, offs_n, gate_rows, mask_n, k0, k_end, stride_qs,
                BLOCK_M, BLOCK_N, BLOCK_K, GATED, QKIND, QROWS, QCOLS, QNG, QOFFSETS, QBASE_BITS,
                ON_GPU, QDTYPE)
            acc, acc_u, sq = k_step_q(acc, acc_u, sq, v, v_u, s, b, s_u, b_u, x_rows, g_ptr,
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
