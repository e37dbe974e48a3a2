"""Split-KV ("flash decoding") paged attention for one query per sequence: kernels and launch.

Public entry point with input checks:
:func:`tgraph.kernels.triton.attention.paged_attention_decode`.

Pass 1 runs one program per (sequence, kv head, split). It loads the query rows of *all* query
heads of that kv head's group at once (padded to 16 rows, the minimum ``tl.dot`` M), so every KV
tile is read from memory once per group rather than once per query head: at batch sizes where
decode is bandwidth-bound this is what sets the speed. Each program covers a contiguous slice of
the sequence's visible keys and writes the partial softmax state (running max ``m``, sum ``l``,
unnormalised ``acc``) to an fp32 workspace. Pass 2 (one program per (sequence, query head))
rescales and sums the partials. With a single split, pass 1 normalises and writes ``out``
directly and pass 2 is skipped.

NOTE: merging the splits inside pass 1 (the last split to finish merges them) saves the second
launch but measured slower in whole decode steps: the merge then runs serially after the slowest
split, while the separate reduce overlaps its launch with pass 1 (PDL) and spreads over one
program per query head. The loop over keys is the online-softmax loop shared with the prefill
kernel, :func:`tgraph.kernels.triton.attention_prefill.attend_paged_keys`.

With a :class:`NewKey` (the ``rope_cache_attention`` op), pass 1 also does the step's rotary
embedding and cache write: every program rotates its q rows as it loads them, and the program whose
split holds position ``seq_len - 1`` rotates this step's key, stores k and v at the sequence's slot
and folds that key into its softmax state from registers; its loop stops one key short, so no
program reads the slot being written (a wash to 2% per step, kept for the launches it saves).

Splits divide the keys the sequence actually has (read from ``seq_len`` on the device), so the
grid depends only on the batch shape and ``num_splits`` and stays CUDA-graph capturable.
Launch settings come from a :class:`~tgraph.tuning.DecodeAttentionTuning`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.attention_prefill import (
    LOG2E,
    attend_paged_keys,
    interpreter_needs_upcast,
)
from tgraph.kernels.triton.device_info import DEFAULT_SM_COUNT, sm_count
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.tuning import DecodeAttentionTuning, DecodeTiles

_DEFAULT_TUNING = DecodeAttentionTuning()


@dataclass(frozen=True)
class NewKey:
    """This step's key and value, for a decode that also does the rope and the cache write.

    ``q`` then arrives unrotated; the split kernel rotates it, rotates ``k``, stores ``k`` and
    ``v`` at ``slots_mapping`` in the cache (skipping slots_mapping outside it), and takes the new
    key from registers rather than reading it back (see ``tgraph.kernels.triton.attention``'s
    ``rope_cache_attention_decode``).

    Attributes:
        k, v: ``[B, Hk, D]``, last dim contiguous.
        cos, sin: fp32 ``[B, R/2]``, ``2 <= R <= D``.
        slots_mapping: int32/int64 ``[B]`` flat cache slot per sequence.
        interleaved: GPT-J pairs ``(2i, 2i+1)`` instead of ``(i, i + R/2)``.
        q_norm, k_norm: ``[D]`` weights of an RMSNorm over each q and k head applied before the
            rope (Qwen3's q_norm / k_norm), rounded as its own kernel stores it; None: none.
        norm_eps: that norm's epsilon.
    """

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots_mapping: torch.Tensor
    interleaved: bool = False
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 0.0


@dataclass(frozen=True)
class DecodeConfig:
    """Tile sizes and launch options of the decode kernels.

    Attributes:
        block_n: keys per inner-loop step.
        num_warps, num_stages: Triton launch options of the split kernel.
        prefetch_pages: carry the next step's page ids (see
            :func:`tgraph.kernels.triton.attention_prefill.attend_paged_keys`). Off by default:
            it keeps ``num_stages - 1`` K/V tiles in flight instead of one, which costs shared
            memory (fewer resident programs) in a kernel that is bandwidth-bound; the sweep in
            ``tgraph.bench.tune_attention`` measures both.
    """

    block_n: int
    num_warps: int
    num_stages: int
    prefetch_pages: bool = False


def decode_config(head_dim: int, is_cuda: bool, programs: int | None = None,
                  num_sms: int = DEFAULT_SM_COUNT,
                  tuning: DecodeAttentionTuning = _DEFAULT_TUNING) -> DecodeConfig:
    """Pick tile sizes by heuristic.

    Args:
        head_dim: D, a power of two in [16, 256].
        is_cuda: False under the Triton interpreter, where small tiles keep tests multi-tile.
        programs: the split kernel's grid size, ``B * Hk * num_splits`` (None: not known).
        num_sms: streaming multiprocessors of the device.
        tuning: the tiles by grid size, or an override for every CUDA launch.

    Returns:
        The launch configuration.
    """
    if not is_cuda:
        return DecodeConfig(block_n=16, num_warps=4, num_stages=1)
    if tuning.override is not None:
        return _config(tuning.override)
    if head_dim <= 128 and programs is not None and programs <= num_sms:
        return _config(tuning.small_grid_tiles)
    if head_dim <= 128:
        return _config(tuning.tiles)
    return DecodeConfig(block_n=32, num_warps=4, num_stages=2)  # D=256: registers and smem


def _config(tiles: DecodeTiles) -> DecodeConfig:
    return DecodeConfig(block_n=tiles.block_n, num_warps=tiles.num_warps,
                        num_stages=tiles.num_stages)


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, num_sms: int = DEFAULT_SM_COUNT,
    tuning: DecodeAttentionTuning = _DEFAULT_TUNING,
) -> int:
    """Number of KV splits for split-KV decode, from shapes only (so CUDA graphs can capture it).

    Splitting pays when ``batch * num_kv_heads`` programs are too few to keep every SM streaming
    KV; it costs a workspace round trip and a second launch. The heuristic aims at at least
    ``tuning.programs_per_sm * num_sms`` programs (rounded up to a power of two: a bounded set of
    compiled reduce kernels) while keeping at least ``tuning.min_keys_per_split`` keys per split
    of the longest possible context.

    Args:
        batch: number of sequences B.
        num_kv_heads: KV heads Hk.
        max_context: the longest context the block table can address,
            ``block_table.shape[1] * block_size``.
        num_sms: streaming multiprocessors of the device (132 is used off CUDA).
        tuning: the split bounds.

    Returns:
        num_splits in [1, tuning.max_splits].
    """
    programs = max(1, batch * num_kv_heads)
    wanted = triton.next_power_of_2(triton.cdiv(tuning.programs_per_sm * num_sms, programs))
    most = max(1, min(tuning.max_splits, max_context // tuning.min_keys_per_split))
    # Round the cap down to a power of two so the minimum of keys per split still holds.
    return min(wanted, 1 << (most.bit_length() - 1))


def workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """fp32 elements of the decode workspace: ``acc [B, Hq, S, D]`` then ``(m, l) [B, Hq, S, 2]``.

    Args:
        batch, num_q_heads, head_dim, num_splits: B, Hq, D and S of the call.

    Returns:
        The element count (0 when ``num_splits == 1``: that path needs no workspace).
    """
    if num_splits == 1:
        return 0
    return batch * num_q_heads * num_splits * (head_dim + 2)


@triton.jit
def _rotated_rows(rows, row_mask, offs_d, cos_row, sin_row, norm_w, eps,
                  ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    """Rows ``[R, D]`` at pointers ``rows`` (``[R, 1]``) with the rotary embedding applied, fp32.

    Every element is ``x * cos + sign * partner * sin`` with its rotation partner (``d +- R/2``,
    or the other element of its pair when ``INTERLEAVED``); dims past ``2 * ROT_HALF`` pass
    through. Two loads of the row instead of a split/join keep the tensor in one layout. With
    ``NORM`` each row is first RMS-normalised with weights ``norm_w``, rounded to the rows'
    dtype as a norm kernel would store it.
    """
    rotary = offs_d < 2 * ROT_HALF
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        first = offs_d < ROT_HALF
        partner = tl.where(first, offs_d + ROT_HALF, offs_d - ROT_HALF)
        angle = tl.where(first, offs_d, offs_d - ROT_HALF)
        sign = tl.where(first, -1.0, 1.0)
    partner = tl.where(rotary, partner, offs_d)
    c = tl.load(cos_row + angle, mask=rotary, other=1.0)
    s = tl.load(sin_row + angle, mask=rotary, other=0.0)
    x_in = tl.load(rows + offs_d[None, :], mask=row_mask, other=0.0)
    x = x_in.to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=row_mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(norm_w + offs_d).to(tl.float32)
        wp = tl.load(norm_w + partner).to(tl.float32)
        x = ((x * rstd).to(x_in.dtype).to(tl.float32) * w[None, :]).to(x_in.dtype)
        x = x.to(tl.float32)
        xp = ((xp * rstd).to(x_in.dtype).to(tl.float32) * wp[None, :]).to(x_in.dtype)
        xp = xp.to(tl.float32)
    return x * c[None, :] + sign[None, :] * xp * s[None, :]


@triton.jit(do_not_specialize=["window", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, ws_acc_ptr, ws_ml_ptr, bt_ptr, seq_len_ptr,
    kn_ptr, vn_ptr, cos_ptr, sin_ptr, slots_ptr, n_slots, qn_w_ptr, kn_w_ptr, norm_eps,
    qk_scale, window, num_splits, num_q_heads,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_oh, stride_btb, stride_btn,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos, stride_sin,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DIRECT_OUT: tl.constexpr, PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, NEW_KEY: tl.constexpr, ROT_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, EARLY_KV: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Before the PDL wait: seq_len and the block table are step inputs, copied in before the
    # step's first kernel, so no kernel that may still run writes them (see
    # tgraph.kernels.triton.pdl). The split's range follows from them.
    seq_len = tl.load(seq_len_ptr + seq)
    # The one query sits at p = seq_len - 1 and sees keys j with p - j < window.
    if HAS_WINDOW:
        key_lo = tl.maximum(seq_len - window, 0)
    else:
        key_lo = seq_len * 0
    # Whole tiles per split so every split but the last streams full tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len - key_lo, num_splits), BLOCK_N) * BLOCK_N
    start = key_lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    if NEW_KEY:
        # The split holding position seq_len - 1 takes this step's key from k/v (and stores it
        # in the cache) instead of reading it back from the cache.
        last = tl.where(seq_len > key_lo, (seq_len - 1 - key_lo) // tl.maximum(per_split, 1), 0)
        owns_new = split == last
        end = tl.where(owns_new & (seq_len > 0), seq_len - 1, end)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_mask = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    if EARLY_KV:
        # With the new key folded in, no other kernel of the step writes this layer's cache
        # (this kernel stores the new key and never reads its slot), so the split's first K/V
        # tile streams in while the kernel before (the q/k/v projection) drains.
        offs_0 = start + tl.arange(0, BLOCK_N)
        mask_0 = offs_0 < end
        page_0 = tl.load(bt_row + (offs_0 // BLOCK_SIZE) * stride_btn, mask=mask_0, other=0)
        page_0 = page_0.to(tl.int64)
        slot_0 = offs_0 % BLOCK_SIZE
        k_0 = tl.load(k_base + (page_0 * stride_kb + slot_0 * stride_ks)[:, None] + offs_d[None, :],
                      mask=mask_0[:, None], other=0.0)
        v_0 = tl.load(v_base + (page_0 * stride_vb + slot_0 * stride_vs)[:, None] + offs_d[None, :],
                      mask=mask_0[:, None], other=0.0)
    pdl_wait(PDL)

    # Padding rows read zeros: their scores are 0, finite, and they are never stored.
    if NEW_KEY:
        # q arrives unrotated: rotate it here, rounded as the unfused rope would store it.
        q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q = _rotated_rows(q_rows, head_mask[:, None], offs_d, cos_ptr + seq * stride_cos,
                          sin_ptr + seq * stride_sin, qn_w_ptr, norm_eps, ROT_HALF, INTERLEAVED,
                          QK_NORM, HEAD_DIM)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    loop_lo = start
    if EARLY_KV:
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_0, v_0, mask_0, qk_scale,
                                     DOT_PRECISION, UPCAST)
        loop_lo = start + BLOCK_N
    # The window and causality are in [start, end) already, so only keys >= end are masked.
    # Every step is masked: an unmasked body needs either a second loop for the tail (which
    # drains and refills the K/V pipeline, and splits are a few steps long) or a per-step
    # branch (~10 more registers: fewer resident programs in this bandwidth-bound kernel).
    acc, l_i, m_i = attend_paged_keys(
        acc, l_i, m_i, q, 0, k_base, v_base, bt_row, loop_lo, end, loop_lo, loop_lo, 0, qk_scale,
        stride_btn, stride_kb, stride_ks, stride_vb, stride_vs,
        HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, False, False, PREFETCH,
        DOT_PRECISION, UPCAST,
    )
    if NEW_KEY:
        if owns_new:
            acc, l_i, m_i = _attend_new_key(
                acc, l_i, m_i, q, seq, kv_head, seq_len, offs_d, kn_ptr, vn_ptr,
                cos_ptr + seq * stride_cos, sin_ptr + seq * stride_sin, slots_ptr, n_slots,
                k_ptr, v_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
                kn_w_ptr, norm_eps, HEAD_DIM, BLOCK_SIZE, ROT_HALF, INTERLEAVED, QK_NORM,
            )

    if DIRECT_OUT:
        # An empty sequence (seq_len 0, e.g. batch padding) leaves l = 0, acc = 0: write zeros.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = o_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:
        # Workspace rows are (seq, q head, split); m stays -inf for an empty split.
        rows = (seq.to(tl.int64) * num_q_heads + heads) * num_splits + split
        acc_ptrs = ws_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=head_mask[:, None])
        # The reduce pass works in log2 units: store the max scaled like the exponents.
        tl.store(ws_ml_ptr + rows * 2, m_i * qk_scale, mask=head_mask)
        tl.store(ws_ml_ptr + rows * 2 + 1, l_i, mask=head_mask)


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k, v, key_mask, qk_scale, DOT_PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The online-softmax update of :func:`attend_paged_keys` for one K/V tile already loaded
    (masked keys, possibly all of them, get no weight)."""
    if UPCAST:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    qk = tl.where(key_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid -inf - -inf
    p = tl.math.exp2(qk * qk_scale - (m_sub * qk_scale)[:, None])
    alpha = tl.math.exp2((m_i - m_sub) * qk_scale)
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None],
                     input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_new_key(
    acc, l_i, m_i, q, seq, kv_head, seq_len, offs_d, kn_ptr, vn_ptr, cos_row, sin_row,
    slots_ptr, n_slots, k_ptr, v_ptr, stride_knb, stride_knh, stride_vnb, stride_vnh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, norm_w, eps,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROT_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr, NORM: tl.constexpr,
):
    """This step's key of one kv head: rotate it, store it and v at the sequence's slot, and
    fold it into the softmax state (one more key, the last one)."""
    k_row = kn_ptr + seq.to(tl.int64) * stride_knb + kv_head * stride_knh
    k_new = _rotated_rows(k_row + tl.zeros([1, 1], dtype=tl.int64), True, offs_d, cos_row,
                          sin_row, norm_w, eps, ROT_HALF, INTERLEAVED, NORM, HEAD_DIM)
    k_new = k_new.to(k_ptr.dtype.element_ty)  # [1, D], rounded as the cache holds it
    v_new = tl.load(vn_ptr + seq.to(tl.int64) * stride_vnb + kv_head * stride_vnh
                    + offs_d[None, :]).to(v_ptr.dtype.element_ty)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    # Padding (slot < 0) and slots_mapping past the cache are skipped, as reshape_and_cache does.
    # (an int bound rather than a scalar-bool mask, which the interpreter cannot broadcast)
    store = offs_d[None, :] < tl.where((slot >= 0) & (slot < n_slots), HEAD_DIM, 0)
    slot = tl.where(slot >= 0, slot, 0)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    tl.store(k_ptr + block * stride_kb + offset * stride_ks + kv_head * stride_kh
             + offs_d[None, :], k_new, mask=store)
    tl.store(v_ptr + block * stride_vb + offset * stride_vs + kv_head * stride_vh
             + offs_d[None, :], v_new, mask=store)
    if seq_len > 0:
        score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1)  # [BLOCK_H]
        m_new = tl.maximum(m_i, score)
        alpha = tl.math.exp2((m_i - m_new) * qk_scale)
        p = tl.math.exp2((score - m_new) * qk_scale)
        acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)
        l_i = l_i * alpha + p
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    ws_acc_ptr, ws_ml_ptr, o_ptr, num_splits, num_q_heads, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    split_mask = offs_s < num_splits
    rows = (seq.to(tl.int64) * num_q_heads + head) * num_splits + offs_s

    m = tl.load(ws_ml_ptr + rows * 2, mask=split_mask, other=float("-inf"))
    sums = tl.load(ws_ml_ptr + rows * 2 + 1, mask=split_mask, other=0.0)
    m_max = tl.max(m, 0)
    # All splits empty (seq_len 0): weights become exp2(-inf) = 0 and the output 0, not NaN.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.math.exp2(m - m_max)
    denom = tl.sum(w * sums, 0)
    acc = tl.load(
        ws_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=split_mask[:, None], other=0.0
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_ptrs = o_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty))


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    num_splits: int,
    workspace: torch.Tensor | None,
    config: DecodeConfig,
    new_key: NewKey | None = None,
    early_kv_max_programs_per_sm: int = _DEFAULT_TUNING.early_kv_max_programs_per_sm,
) -> None:
    """Launch split-KV decode on arguments already checked by the public wrapper.

    Args:
        q, k_cache, v_cache, block_table, seq_len, scale, sliding_window, out: see
            :func:`tgraph.kernels.triton.attention.paged_attention_decode`.
        num_splits: KV splits per (sequence, kv head), >= 1.
        workspace: fp32, at least :func:`workspace_numel` elements, or None to allocate one.
        config: tile sizes from :func:`decode_config`.
        new_key: fold the step's rope and cache write in (``q`` unrotated); see :class:`NewKey`.
        early_kv_max_programs_per_sm: with ``new_key``, grids of at most this many programs per
            SM load each split's first K/V tile before the PDL wait (0: never).
    """
    batch, num_q_heads, head_dim = q.shape
    if batch == 0:
        return
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    direct = num_splits == 1
    if direct:
        ws_acc = ws_ml = out  # unused by the kernel on this path
    else:
        numel = workspace_numel(batch, num_q_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=q.device)
        n_acc = batch * num_q_heads * num_splits * head_dim
        ws_acc = workspace[:n_acc]
        ws_ml = workspace[n_acc:numel]
    nk = new_key
    dummy = seq_len  # stands in for the new-key pointers when there is none (never read)
    qk_norm = (nk.q_norm, nk.k_norm) if nk is not None and nk.q_norm is not None else None
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, ws_acc, ws_ml, block_table, seq_len,
        nk.k if nk else dummy, nk.v if nk else dummy, nk.cos if nk else dummy,
        nk.sin if nk else dummy, nk.slots_mapping if nk else dummy,
        k_cache.shape[0] * block_size,
        qk_norm[0] if qk_norm else dummy, qk_norm[1] if qk_norm else dummy,
        float(nk.norm_eps) if qk_norm else 0.0,
        scale * LOG2E, sliding_window if sliding_window is not None else 0, num_splits,
        num_q_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), block_table.stride(0), block_table.stride(1),
        nk.k.stride(0) if nk else 0, nk.k.stride(1) if nk else 0,
        nk.v.stride(0) if nk else 0, nk.v.stride(1) if nk else 0,
        nk.cos.stride(0) if nk else 0, nk.sin.stride(0) if nk else 0,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=config.block_n,
        HAS_WINDOW=sliding_window is not None,
        DIRECT_OUT=direct,
        PREFETCH=config.prefetch_pages,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreter_needs_upcast(q.dtype),
        NEW_KEY=nk is not None,
        ROT_HALF=nk.cos.shape[1] if nk else 0,
        INTERLEAVED=bool(nk and nk.interleaved),
        QK_NORM=qk_norm is not None,
        EARLY_KV=nk is not None
        and batch * num_kv_heads * num_splits <= early_kv_max_programs_per_sm * sm_count(q.device),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_kwargs(q),
    )
    if not direct:
        _decode_reduce_kernel[(batch, num_q_heads)](
            ws_acc, ws_ml, out, num_splits, num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
            **pdl_kwargs(q),
        )


__all__ = [
    "DecodeConfig",
    "NewKey",
    "choose_num_splits",
    "decode_config",
    "launch_decode",
    "workspace_numel",
]
