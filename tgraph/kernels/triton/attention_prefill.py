"""Varlen (packed) causal prefill attention over a paged KV cache: the Triton kernel and its launch.

Public entry point with input checks:
:func:`tgraph.kernels.triton.attention.paged_attention_prefill`.
This module holds the kernel and a launcher that trusts its (already checked) arguments.

Work split: one program per (query tile of ``BLOCK_M`` rows of one sequence, query head). The
query tiles of all sequences are numbered on one flat grid axis of ``T // BLOCK_M + B`` programs,
a bound that depends only on tensor shapes (so the launch is CUDA-graph capturable); each program
finds its sequence by a binary search over ``query_start_loc`` and exits early when it has no rows.
Sequence ``b`` owns the programs ``[query_start_loc[b] // BLOCK_M + b, query_start_loc[b+1] //
BLOCK_M + b + 1)``, which always holds at least ``cdiv(q_len_b, BLOCK_M)`` tiles.

Each program walks the keys of its tile in three ranges so that the common case needs no mask:
keys only some rows may see at the sliding-window edge (masked), keys every row sees (unmasked),
and keys at the causal diagonal (masked).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# NOTE: softmax runs in base 2 (exp2 is a single MUFU instruction); scores are pre-multiplied
# by log2(e) together with the user's scale, so results equal the natural-base softmax.
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch options of the prefill kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(head_dim: int, max_query_len: int | None, is_cuda: bool) -> PrefillConfig:
    """Pick tile sizes by heuristic (no autotuning, so no first-call sweep and no recompiles).

    Args:
        head_dim: D, a power of two in [16, 256].
        max_query_len: longest query run of the batch if the caller knows it; short runs (chunked
            prefill, speculative verification) get a smaller ``BLOCK_M`` to waste fewer rows.
        is_cuda: False under the Triton interpreter, where small tiles keep the tests exercising
            multi-tile paths at small shapes.

    Returns:
        The launch configuration.
    """
    if not is_cuda:
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    if head_dim <= 64:
        cfg = PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        # Best of a sweep on an H200 (tgraph.bench.tune_attention, 4 x 2048 tokens, 32/8 heads):
        # 64 x 64 tiles on 4 warps with a 2-stage K/V pipeline.
        cfg = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    else:
        # D=256: halve the tiles to stay within registers and shared memory.
        cfg = PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    if max_query_len is not None and max_query_len < cfg.block_m:
        # Only powers of two in [16, block_m]: a bounded set of compiled variants.
        block_m = max(16, triton.next_power_of_2(max(1, max_query_len)))
        cfg = PrefillConfig(block_m, cfg.block_n, min(cfg.num_warps, 4), cfg.num_stages)
    return cfg


def interpreter_needs_upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be upcast to fp32 to get right results.

    Triton's interpreter (checked on 3.9) multiplies bf16 operands as their raw uint16 storage,
    so under ``TRITON_INTERPRET=1`` bf16 dots run on fp32 copies (exact products of bf16 values,
    which the GPU's bf16 MMA also computes with fp32 accumulation).
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _key_range(
    acc, l_i, m_i, q, k_base, v_base, bt_row, lo, hi, pos, window, qk_scale,
    stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax update of one query tile with keys [lo, hi) read through the page table."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            kv_mask = offs_n < hi
            page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn, mask=kv_mask, other=0)
        else:
            page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn)
        # int64: page * stride can pass 2**31 elements in a large cache.
        page = page.to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k_ptrs = k_base + (page * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (page * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=kv_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        if UPCAST:  # see interpreter_needs_upcast (inline: a jit call per tile is slow there)
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        # m_i tracks the raw score maximum (the scale is positive, so the max commutes with it);
        # the scale is applied inside the exponent, qk * scale - m * scale: one FMA per score.
        if MASKED:
            visible = (offs_n[None, :] <= pos[:, None]) & kv_mask[None, :]
            if HAS_WINDOW:
                visible = visible & (pos[:, None] - offs_n[None, :] < window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED:
            # A row may see no key of a masked tile yet: subtract 0, not -inf, to avoid NaN.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - (m_sub * qk_scale)[:, None])
        alpha = tl.math.exp2((m_i - m_sub) * qk_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=kv_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None]
        if UPCAST:
            p_mma = p.to(v.dtype).to(tl.float32)  # keep the MMA operand's rounding
            acc = tl.dot(p_mma, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, kv_lens_ptr, qsl_ptr,
    num_seqs, qk_scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_btb, stride_btn,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # Reversed so the last tiles of each sequence (the most keys, causally) start first and the
    # cheap ones fill the tail of the launch.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)

    # Largest seq b whose first tile index qsl[b] // BLOCK_M + b is <= pid (indices increase
    # strictly with b, so the answer is unique even for empty sequences).
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_M + seq)
    if tile * BLOCK_M >= q_len:
        return

    kv_len = tl.load(kv_lens_ptr + seq)
    ctx_len = kv_len - q_len  # keys cached before this chunk of queries
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m < q_len
    pos = ctx_len + offs_m  # absolute positions of the tile's queries

    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)

    kv_head = head // GROUP
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    pos_first = ctx_len + tile * BLOCK_M
    pos_last = tl.minimum(pos_first + BLOCK_M - 1, kv_len - 1)  # last valid row
    key_hi = pos_last + 1
    # Keys in [0, full_hi) are causally visible to every row of the tile.
    full_hi = ((pos_first + 1) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:
        # Rows see keys j > pos - window; [full_lo, ...) is inside every valid row's window.
        key_lo = (tl.maximum(pos_first - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_last - window + 1, 0), BLOCK_N) * BLOCK_N
        mid_lo = tl.minimum(full_lo, (key_hi // BLOCK_N) * BLOCK_N)
    else:
        key_lo = 0
        mid_lo = 0
    mid_hi = tl.maximum(mid_lo, full_hi)

    if HAS_WINDOW:
        acc, l_i, m_i = _key_range(
            acc, l_i, m_i, q, k_base, v_base, bt_row, key_lo, mid_lo, pos, window,
            qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION, UPCAST,
        )
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, k_base, v_base, bt_row, mid_lo, mid_hi, pos, window,
        qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, HAS_WINDOW, DOT_PRECISION, UPCAST,
    )
    acc, l_i, m_i = _key_range(
        acc, l_i, m_i, q, k_base, v_base, bt_row, mid_hi, key_hi, pos, window,
        qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, HAS_WINDOW, DOT_PRECISION, UPCAST,
    )

    # Every valid row sees at least its own key, so l_i > 0 there; the guard keeps rows of a
    # (malformed) kv_len 0 sequence at zero instead of NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    config: PrefillConfig,
) -> None:
    """Launch the prefill kernel on arguments already checked by the public wrapper.

    Args:
        q, k_cache, v_cache, block_table, kv_lens, query_start_loc, scale, sliding_window, out:
            see :func:`tgraph.kernels.triton.attention.paged_attention_prefill`.
        config: tile sizes from :func:`prefill_config`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # Shape-only grid: sum over seqs of cdiv(q_len, BLOCK_M) <= T // BLOCK_M + B.
    grid = (num_tokens // config.block_m + num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_table, kv_lens, query_start_loc,
        num_seqs, scale * LOG2E, sliding_window if sliding_window is not None else 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), block_table.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreter_needs_upcast(q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


__all__ = [
    "LOG2E",
    "PrefillConfig",
    "interpreter_needs_upcast",
    "launch_prefill",
    "prefill_config",
]
