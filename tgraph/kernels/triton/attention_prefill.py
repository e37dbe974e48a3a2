"""Varlen (packed) causal prefill attention over a paged KV cache: the Triton kernel and its launch.

Public entry point with input checks:
:func:`tgraph.kernels.triton.attention.paged_attention_prefill`.
This module holds the kernel, a launcher that trusts its (already checked) arguments, and
:func:`attend_paged_keys`, the online-softmax loop over paged keys that the decode kernel shares.

Work split: one program per (query tile, head tile). A query tile is ``BLOCK_M`` rows. Unpacked
(``HEADS == 1``), they are ``BLOCK_M`` consecutive positions of one query head. GQA-packed
(``HEADS == GROUP``, or a divisor of it), they are ``BLOCK_P = BLOCK_M // HEADS`` positions times
the ``HEADS`` query heads that read one KV head (row ``r`` = position ``r // HEADS``, head
``r % HEADS``), so every K/V tile gathered through the page table feeds all heads of its group
in one MMA, and a tile spans fewer positions (a thinner causal diagonal).

The query tiles of all sequences are numbered on one flat grid axis of ``T // BLOCK_P + B``
programs, a bound that depends only on tensor shapes (so the launch is CUDA-graph capturable);
each program finds its sequence by a binary search over ``query_start_loc`` and exits early when
it has no rows. Sequence ``b`` owns the programs ``[query_start_loc[b] // BLOCK_P + b,
query_start_loc[b+1] // BLOCK_P + b + 1)``, which always holds at least ``cdiv(q_len_b, BLOCK_P)``
tiles.

The keys of a tile fall in three ranges: keys only some rows may see at the sliding-window edge
(masked), keys every row sees (no mask needed) and keys at the causal diagonal (masked). By
default one loop walks all three and branches on the range per step (``single_loop``); the
alternative runs one loop per range.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tgraph import envs

# NOTE: softmax runs in base 2 (exp2 is a single MUFU instruction); scores are pre-multiplied
# by log2(e) together with the user's scale, so results equal the natural-base softmax.
LOG2E = 1.4426950408889634

# Where attend_paged_keys reads keys and values (its KEYS switch).
PAGED: tl.constexpr = tl.constexpr(0)
CONTIGUOUS: tl.constexpr = tl.constexpr(1)
DESCRIPTORS: tl.constexpr = tl.constexpr(2)


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch options of the prefill kernel.

    Attributes:
        block_m: query rows per program (positions x packed heads).
        block_n: keys per inner-loop step.
        num_warps, num_stages: Triton launch options (``num_stages`` is the depth of the K/V
            software pipeline).
        pack_gqa: put the query heads of one KV head in the same tile (see the module doc); a
            no-op when ``Hq == Hk``.
        prefetch_pages: read the page ids of the next key tile one step ahead (see
            :func:`attend_paged_keys`), so Triton's pipeliner can issue K/V loads
            ``num_stages - 1`` steps ahead instead of one.
        single_loop: walk all keys of a tile in one loop that masks only the steps at the
            causal diagonal and the window edge (a uniform branch). False: three loops (window
            edge, unmasked middle, diagonal), the middle one free of mask code, but each loop
            fills and drains its own K/V pipeline, an exposed memory latency per program.
        tma: read the step's new keys (``new_kv``) with TMA tensor descriptors where the GPU
            and the tensors' strides allow it (else with pointers).
        new_kv_stages: pipeline depth of the loops over the new keys (contiguous rows, no
            page-id loads, so a deeper pipeline pays off).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack_gqa: bool = False
    prefetch_pages: bool = True
    single_loop: bool = True
    tma: bool = True
    new_kv_stages: int = 3


def prefill_config(
    head_dim: int, max_query_len: int | None, is_cuda: bool, group: int = 1
) -> PrefillConfig:
    """Pick tile sizes by heuristic (no autotuning, so no first-call sweep and no recompiles).

    Args:
        head_dim: D, a power of two in [16, 256].
        max_query_len: longest query run of the batch if the caller knows it; short runs (chunked
            prefill, speculative verification) get a smaller ``BLOCK_M`` to waste fewer rows.
        is_cuda: False under the Triton interpreter, where small tiles keep the tests exercising
            multi-tile paths at small shapes.
        group: query heads per KV head (``Hq // Hk``); above 1 the tile packs them (GQA packing).

    Returns:
        The launch configuration.
    """
    if not is_cuda:
        # The interpreter (tests) runs the packed, prefetching single loop at small tiles.
        pack = group > 1
        cfg = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, pack_gqa=pack)
    else:
        # NOTE: the three-loop, unpacked, no-prefetch schedule: no swept variant (packed or not,
        # page prefetch, one loop) beat it at D=128 (docs/performance.md); other head dims
        # keep unswept tiles.
        pack = False
        if head_dim <= 64:
            tiles = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
        elif head_dim <= 128:
            tiles = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)
        else:
            # D=256: halve the tiles to stay within registers and shared memory.
            tiles = dict(block_m=64, block_n=32, num_warps=8, num_stages=2)
        cfg = PrefillConfig(**tiles, pack_gqa=False, prefetch_pages=False, single_loop=False)
    if max_query_len is not None:
        rows = max(1, max_query_len) * (heads_per_tile(group, cfg.block_m) if pack else 1)
        if rows < cfg.block_m:
            # Only powers of two in [16, block_m]: a bounded set of compiled variants.
            block_m = max(16, triton.next_power_of_2(rows))
            cfg = dataclasses.replace(cfg, block_m=block_m, num_warps=min(cfg.num_warps, 4))
    return cfg


def heads_per_tile(group: int, block_m: int) -> int:
    """Query heads packed in one tile: the largest divisor of ``group`` that fits in ``block_m``.

    A divisor, so that all heads of a tile read the same KV head; any GQA ratio works (7 heads
    per KV head pack 18 positions in 128 rows, leaving 2 rows idle).

    Args:
        group: query heads per KV head.
        block_m: rows of a tile.

    Returns:
        HEADS in [1, min(group, block_m)].
    """
    return max(d for d in range(1, min(group, block_m) + 1) if group % d == 0)


def interpreter_needs_upcast(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` operands must be upcast to fp32 to get right results.

    Triton's interpreter (checked on 3.9) multiplies bf16 operands as their raw uint16 storage,
    so under ``TRITON_INTERPRET=1`` bf16 dots run on fp32 copies (exact products of bf16 values,
    which the GPU's bf16 MMA also computes with fp32 accumulation).
    """
    return dtype == torch.bfloat16 and envs.TRITON_INTERPRET


@triton.jit
def attend_paged_keys(
    acc, l_i, m_i, q, pos, k_base, v_base, bt_row, lo, hi, full_lo, full_hi, window, qk_scale,
    stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, FULL_RANGE: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, k_desc=None, v_desc=None, desc_row=0, desc_col=0,
    KEYS: tl.constexpr = PAGED, STAGES: tl.constexpr = None,
):
    """Online-softmax update of query rows with the keys ``[lo, hi)``, read through a page table
    (or, with ``KEYS``, from a contiguous ``[tokens, heads, D]`` tensor).

    Shared by the prefill and decode kernels (a jit helper is inlined, so this costs nothing).
    ``m_i`` is the running maximum of the *raw* scores; the scale (times log2 e) is applied
    inside the exponent, ``exp2(s * c - m * c)``: one FMA per score, and the max commutes with
    the positive scale. ``acc`` is unnormalised, ``l_i`` the running sum of probabilities.

    Args:
        acc, l_i, m_i: fp32 state, ``[R, D]``, ``[R]``, ``[R]``.
        q: ``[R, D]`` query rows.
        pos: ``[R]`` absolute position of each row (read only when CAUSAL or HAS_WINDOW).
        k_base, v_base: cache pointers already offset to the KV head.
        bt_row: pointer to the sequence's block-table row.
        lo, hi: key range.
        full_lo, full_hi: read only with FULL_RANGE: the steps starting in
            ``[full_lo, full_hi)`` hold only keys below ``hi`` that every row sees.
        window: sliding window W (read only when HAS_WINDOW).
        qk_scale: softmax scale times log2(e).
        MASKED: False: the caller guarantees that every key of ``[lo, hi)`` is visible to every
            row and that ``hi - lo`` is a multiple of BLOCK_N, and no mask code is emitted.
            True: mask keys ``>= hi`` and, with CAUSAL / HAS_WINDOW, keys after a row's
            position / outside its window; a row may see no key of a masked step.
        FULL_RANGE: with MASKED, steps starting in ``[full_lo, full_hi)`` skip the score mask
            (a branch uniform over the program, so no divergence; it costs ~10 registers, which
            is why the decode kernel, bandwidth-bound and occupancy-sensitive, masks every step).
        PREFETCH: load the page ids of step i + 1 during step i and carry them. The K/V
            addresses then depend on a loop-carried value instead of a load in the same step,
            which lets Triton's pipeliner issue K/V copies ``num_stages - 1`` steps ahead; with
            the in-step load the page-id load itself takes one pipeline stage and K/V are
            issued only one step ahead, right after the P@V MMA (checked in the TTGIR of
            Triton 3.6 and 3.9 for sm_90a).
        DOT_PRECISION: ``tl.dot`` input precision; UPCAST: see :func:`interpreter_needs_upcast`.
        KEYS: where key ``j`` lives. ``PAGED``: the cache, through ``bt_row``. ``CONTIGUOUS``:
            row ``j`` of ``k_base``/``v_base`` (already offset to the sequence's first key and
            the KV head; row strides ``stride_ks``/``stride_vs``). ``DESCRIPTORS``: the same
            rows read by TMA, row ``desc_row + j`` and column ``desc_col`` of the 2-D
            ``[tokens, heads * D]`` tensor descriptors ``k_desc``/``v_desc`` (rows past the
            tensor read as zeros; rows of the next sequence are finite and masked causally).
        STAGES: software-pipeline depth of this loop (None: the kernel's ``num_stages``).

    Returns:
        The updated ``(acc, l_i, m_i)``.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    if KEYS == PAGED:
        if PREFETCH:
            first = lo + tl.arange(0, BLOCK_N)
            page = tl.load(bt_row + (first // BLOCK_SIZE) * stride_btn, mask=first < hi, other=0)
            # int64: page * stride can pass 2**31 elements in a large cache.
            page = page.to(tl.int64)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            kv_mask = offs_n < hi
        if KEYS == PAGED:
            if not PREFETCH:
                if MASKED:
                    page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn, mask=kv_mask,
                                   other=0)
                else:
                    page = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btn)
                page = page.to(tl.int64)
            slot = offs_n % BLOCK_SIZE
            k_rows = page * stride_kb + slot * stride_ks
            v_rows = page * stride_vb + slot * stride_vs
            if PREFETCH:
                # Past the end the ids are masked to page 0: a valid address, and never read.
                nxt = offs_n + BLOCK_N
                page = tl.load(bt_row + (nxt // BLOCK_SIZE) * stride_btn, mask=nxt < hi, other=0)
                page = page.to(tl.int64)
        else:
            k_rows = offs_n.to(tl.int64) * stride_ks
            v_rows = offs_n.to(tl.int64) * stride_vs
        if KEYS == DESCRIPTORS:
            k = k_desc.load([desc_row + start_n, desc_col])
        else:
            k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]
            if MASKED:
                k = tl.load(k_ptrs, mask=kv_mask[:, None], other=0.0)
            else:
                k = tl.load(k_ptrs)
        if UPCAST:  # see interpreter_needs_upcast (inline: a jit call per tile is slow there)
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            if FULL_RANGE:
                edge = (start_n < full_lo) | (start_n >= full_hi)
            else:
                edge = True  # a compile-time constant: no branch is emitted
            if edge:
                visible = kv_mask[None, :]
                if CAUSAL:
                    visible = visible & (offs_n[None, :] <= pos[:, None])
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
        if KEYS == DESCRIPTORS:
            v = v_desc.load([desc_row + start_n, desc_col])
            if MASKED:
                # Rows past the sequence belong to the next one (or are zero fill): p is 0
                # there, but 0 * inf would be NaN, so they are zeroed like a masked load.
                v = tl.where(kv_mask[:, None], v, 0.0)
        else:
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
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


@triton.jit
def _attend_ranges(
    acc, l_i, m_i, q, pos, k_base, v_base, bt_row, key_lo, mid_lo, mid_hi, key_hi, window,
    qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PREFETCH: tl.constexpr, SINGLE_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, k_desc, v_desc, desc_row, desc_col,
    KEYS: tl.constexpr, STAGES: tl.constexpr,
):
    """All keys of a query tile: ``[key_lo, mid_lo)`` at the window edge (masked),
    ``[mid_lo, mid_hi)`` seen by every row (no mask) and ``[mid_hi, key_hi)`` at the causal
    diagonal (masked); keys are read as ``KEYS`` says (see :func:`attend_paged_keys`)."""
    if SINGLE_LOOP:
        # One software pipeline over all keys; only the steps outside [mid_lo, mid_hi) mask.
        acc, l_i, m_i = attend_paged_keys(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, key_lo, key_hi, mid_lo, mid_hi,
            window, qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, True, HAS_WINDOW, PREFETCH,
            DOT_PRECISION, UPCAST, k_desc, v_desc, desc_row, desc_col, KEYS, STAGES,
        )
    else:
        # Three loops, the middle one free of mask code; each drains its pipeline at its end.
        if HAS_WINDOW:
            acc, l_i, m_i = attend_paged_keys(
                acc, l_i, m_i, q, pos, k_base, v_base, bt_row, key_lo, mid_lo, key_lo, key_lo,
                window, qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, True, HAS_WINDOW, PREFETCH,
                DOT_PRECISION, UPCAST, k_desc, v_desc, desc_row, desc_col, KEYS, STAGES,
            )
        acc, l_i, m_i = attend_paged_keys(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, mid_lo, mid_hi, mid_lo, mid_hi,
            window, qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, True, HAS_WINDOW, PREFETCH,
            DOT_PRECISION, UPCAST, k_desc, v_desc, desc_row, desc_col, KEYS, STAGES,
        )
        acc, l_i, m_i = attend_paged_keys(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, mid_hi, key_hi, mid_hi, mid_hi,
            window, qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, True, HAS_WINDOW, PREFETCH,
            DOT_PRECISION, UPCAST, k_desc, v_desc, desc_row, desc_col, KEYS, STAGES,
        )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, seq_len_ptr, qsl_ptr, kn_ptr, vn_ptr, kn_desc, vn_desc,
    num_seqs, qk_scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_btb, stride_btn, stride_knt, stride_knh, stride_vnt, stride_vnh,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PREFETCH: tl.constexpr, SINGLE_LOOP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, NEW_KV: tl.constexpr,
    NEW_STAGES: tl.constexpr,
):
    # Reversed so the last tiles of each sequence (the most keys, causally) start first and the
    # cheap ones fill the tail of the launch.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head_tile = tl.program_id(1)  # query heads [head_tile * HEADS, (head_tile + 1) * HEADS)

    # Largest seq b whose first tile index qsl[b] // BLOCK_P + b is <= pid (indices increase
    # strictly with b, so the answer is unique even for empty sequences).
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_P + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_P + seq)
    if tile * BLOCK_P >= q_len:
        return

    seq_len = tl.load(seq_len_ptr + seq)
    ctx_len = seq_len - q_len  # keys cached before this chunk of queries
    # Row r holds position tile * BLOCK_P + r // HEADS of query head head_tile * HEADS + r % HEADS
    # (both fold to the plain layout when HEADS == 1).
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = tile * BLOCK_P + offs_r // HEADS
    heads = head_tile * HEADS + offs_r % HEADS
    if BLOCK_P * HEADS == BLOCK_M:
        row_mask = offs_m < q_len
    else:
        # HEADS does not divide BLOCK_M (e.g. 7 heads per KV head): the last rows idle.
        row_mask = (offs_m < q_len) & (offs_r < BLOCK_P * HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    pos = ctx_len + offs_m  # absolute positions of the rows' queries

    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + (q_rows * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)

    kv_head = (head_tile * HEADS) // GROUP
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    pos_first = ctx_len + tile * BLOCK_P
    pos_last = tl.minimum(pos_first + BLOCK_P - 1, seq_len - 1)  # last valid position
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

    # A sequence without cached context has exactly the step's new k/v rows
    # [q_start, q_start + q_len) as keys: read contiguously (by TMA with DESCRIPTORS).
    use_new = ctx_len == 0
    if NEW_KV == PAGED:
        use_new = False  # a compile-time False: only the paged branch is emitted
    if use_new:
        acc, l_i, m_i = _attend_ranges(
            acc, l_i, m_i, q, pos,
            kn_ptr + q_start.to(tl.int64) * stride_knt + kv_head * stride_knh,
            vn_ptr + q_start.to(tl.int64) * stride_vnt + kv_head * stride_vnh,
            bt_row, key_lo, mid_lo, mid_hi, key_hi, window, qk_scale,
            stride_btn, 0, stride_knt, 0, stride_vnt,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, HAS_WINDOW, PREFETCH, SINGLE_LOOP, DOT_PRECISION,
            UPCAST, kn_desc, vn_desc, q_start, kv_head * HEAD_DIM, NEW_KV, NEW_STAGES,
        )
    else:
        acc, l_i, m_i = _attend_ranges(
            acc, l_i, m_i, q, pos, k_base, v_base, bt_row, key_lo, mid_lo, mid_hi, key_hi,
            window, qk_scale, stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, HAS_WINDOW, PREFETCH, SINGLE_LOOP, DOT_PRECISION,
            UPCAST, None, None, 0, 0, PAGED, None,
        )

    # Every valid row sees at least its own key, so l_i > 0 there; the guard keeps rows of a
    # (malformed) seq_len 0 sequence at zero instead of NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = o_ptr + (q_rows * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])


def launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    config: PrefillConfig,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Launch the prefill kernel on arguments already checked by the public wrapper.

    Args:
        q, k_cache, v_cache, block_table, seq_len, query_start_loc, scale, sliding_window, out,
        new_kv: see :func:`tgraph.kernels.triton.attention.paged_attention_prefill`.
        config: tile sizes from :func:`prefill_config`.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = seq_len.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    heads = heads_per_tile(group, config.block_m) if config.pack_gqa else 1
    block_p = config.block_m // heads
    # Shape-only grid: sum over seqs of cdiv(q_len, BLOCK_P) <= T // BLOCK_P + B.
    grid = (num_tokens // block_p + num_seqs, num_q_heads // heads)
    if new_kv is None:
        keys, k_new, v_new, k_desc, v_desc = PAGED, k_cache, v_cache, None, None
    else:
        k_new, v_new = new_kv
        keys = DESCRIPTORS if config.tma and _tma_ok(k_new, v_new) else CONTIGUOUS
        k_desc = _row_descriptor(k_new, config.block_n) if keys == DESCRIPTORS else None
        v_desc = _row_descriptor(v_new, config.block_n) if keys == DESCRIPTORS else None
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_len, query_start_loc, k_new, v_new,
        k_desc, v_desc,
        num_seqs, scale * LOG2E, sliding_window if sliding_window is not None else 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), block_table.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group,
        HEADS=heads,
        BLOCK_P=block_p,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        PREFETCH=config.prefetch_pages,
        SINGLE_LOOP=config.single_loop,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreter_needs_upcast(q.dtype),
        NEW_KV=keys,
        NEW_STAGES=config.new_kv_stages,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read ``[T, H, D]`` tensors as 2-D ``[T, H * D]`` row tiles: heads packed
    (head stride D), 16-byte aligned base and row stride, and a Hopper or later GPU (the
    Triton interpreter also runs descriptors)."""
    for t in tensors:
        _, heads, d = t.shape
        if t.stride(2) != 1 or (heads > 1 and t.stride(1) != d):
            return False
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    t = tensors[0]
    if t.is_cuda and not envs.TRITON_INTERPRET:
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return True


def _row_descriptor(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA descriptor of ``[T, H, D]`` as ``[T, H * D]`` with ``[block_rows, D]`` tiles."""
    tokens, heads, d = t.shape
    return TensorDescriptor(t, [tokens, heads * d], [t.stride(0), 1], [block_rows, d])


__all__ = [
    "LOG2E",
    "PrefillConfig",
    "attend_paged_keys",
    "heads_per_tile",
    "interpreter_needs_upcast",
    "launch_prefill",
    "prefill_config",
]
