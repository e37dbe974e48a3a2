"""The slot-tile multi-LoRA shrink kernel, :func:`lora_shrink_concat` (which also dispatches decode
batches to the per-token kernel, :mod:`tgraph.kernels.triton.lora_rows`), and its launch
heuristics (:func:`lora_concat_splits`). Layout: :mod:`tgraph.kernels.triton.lora`.

Grouping. Tokens are sorted by slot (:func:`lora_segments`, or the feature's per-step arrays). The
kernel runs over *tiles*: the tokens of slot ``s`` are cut into ``ceil(count_s / BLOCK_T)`` tiles,
and program ``i`` finds its ``(slot, first row)`` from a prefix sum over the slots' tile counts,
computed in the kernel. The number of tiles is at most ``T // BLOCK_T + min(L, T)``, which is the
grid: it depends on shapes only, so the launch is CUDA-graph capturable; programs past the last
tile exit at once.

Split K, reduced in the same launch. At decode there are a handful of tiles (4 for 16 tokens of 4
adapters), so one program per tile would walk the whole K alone on an idle GPU. A second grid axis
splits K: program ``(tile, split)`` copies its chunk of ``x`` into ``xcat`` and multiplies it by
its chunk of ``A``. With more than one split, each program writes its fp32 partial to a workspace
and then takes a ticket from the tile's arrival counter (an ``acq_rel`` atomic add). The program
that arrives last sums the tile's partials in a fixed order (split blocks in sequence, a
``tl.sum`` tree inside a block), scales, rounds and writes the slot block, then resets the counter
to 0. No float atomics: the result is bit-identical run to run, whichever program arrives last.

The counters are a persistent, zero-initialised int32 buffer (:func:`new_lora_counters`) that
every launch leaves zeroed, so launches in sequence and CUDA-graph replays reuse it; one launch
needs one counter per tile of its grid. When the grid has more tiles than counters (prefill of
thousands of tokens, where tiles fill the GPU anyway) the launch runs one split and needs none.

Two adapter sets (:class:`~tgraph.kernels.triton.lora_common.AdapterSet`): the kernel runs the
second set's tiles (grouped by its own slots) as more programs of the same grid, split as the
first set alone would be (:func:`lora_concat_splits`); only the first set's programs copy ``x``.

NOTE (PDL): before the PDL wait the kernel reads only the segments, the token order and its first
``A`` tile, which no kernel of a step writes (the engine passes segments as inputs, and
:func:`lora_segments` computes them with torch ops, never PDL-launched). ``x``, ``xcat``, the
workspace, the counters and ``scaling`` are touched after the wait.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.ir.ops.lora import LORA_COUNTER_SLOTS as LORA_COUNTERS
from tgraph.kernels.triton.device_info import sm_count
from tgraph.kernels.triton.lora_common import (
    ZERO_CHUNK,
    AdapterSet,
    check_counters,
    check_layout,
    check_segments,
    check_slots,
    check_tensor,
    select_adapter_set,
)
from tgraph.kernels.triton.lora_rows import launch_rows
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.tuning import LoraTuning

__all__ = ["LORA_COUNTERS", "lora_concat_splits", "lora_segments", "lora_shrink_concat",
           "new_lora_counters"]

_DEFAULT_TUNING = LoraTuning()
# Bound on the partials the last program of a tile sums (splits * BLOCK_T * BLOCK_R fp32
# elements, 64 KB): that sum is the serial tail of the launch.
_MAX_PARTIALS = 16384
# Partials loaded at once ([SPLIT_BLOCK, BLOCK_T, BLOCK_R] fp32, 64 registers a thread at 4
# warps): enough loads in flight for the tail's L2 reads.
_SPLIT_LOAD_ELEMS = 8192


@triton.jit
def _tile_of_program(seg_ptr, pid, L, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr):
    """Map program ``pid`` to ``(slot, row0, row_end)`` in the slot-sorted token order.

    ``slot >= L`` means the program has no tile.
    """
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    lo = tl.load(seg_ptr + offs_l, mask=mask_l, other=0)
    hi = tl.load(seg_ptr + offs_l + 1, mask=mask_l, other=0)
    n_tiles = (hi - lo + BLOCK_T - 1) // BLOCK_T
    cum = tl.cumsum(n_tiles, axis=0)  # inclusive: tiles of slots 0..l
    # Slots whose tiles all come before pid; empty slots never split a run, so this is pid's slot.
    slot = tl.sum((cum <= pid).to(tl.int32), axis=0)
    is_slot = offs_l == slot
    first_tile = tl.sum(tl.where(is_slot, cum - n_tiles, 0), axis=0)
    seg_lo = tl.sum(tl.where(is_slot, lo, 0), axis=0)
    seg_hi = tl.sum(tl.where(is_slot, hi, 0), axis=0)
    row0 = seg_lo + (pid - first_tile) * BLOCK_T
    return slot, row0, seg_hi


@triton.jit
def _write_lora_columns(lora_rows, mask_t, vals, slot, R, lead, width,
                        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Write a tile's LoRA columns: ``vals`` (fp32, already scaled) in slot ``slot``'s block,
    zeros in every other column of ``[0, width)`` (slot 0: zeros only)."""
    own_lo = tl.where(slot > 0, lead + (slot - 1) * R, width)
    own_hi = tl.where(slot > 0, own_lo + R, width)
    dtype = lora_rows.dtype.element_ty
    for c0 in range(0, width, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        keep = (cols < width) & ((cols < own_lo) | (cols >= own_hi))
        tl.store(lora_rows + cols[None, :], tl.zeros((BLOCK_T, BLOCK_C), dtype=dtype),
                 mask=mask_t[:, None] & keep[None, :])
    offs_r = tl.arange(0, BLOCK_R)
    # A bound, not a scalar & block mask (the interpreter rejects those); slot 0 writes nothing.
    mask_r = offs_r < own_hi - own_lo
    tl.store(lora_rows + own_lo + offs_r[None, :], vals.to(dtype),
             mask=mask_t[:, None] & mask_r[None, :])


@triton.jit
def _sum_partials(part_tile, mask_t, mask_r, splits,
                  BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    """Sum a tile's ``[splits, BLOCK_T, BLOCK_R]`` partials in a fixed order."""
    offs_s = tl.arange(0, SPLIT_BLOCK)
    tile_offs = tl.arange(0, BLOCK_T)[:, None] * BLOCK_R + tl.arange(0, BLOCK_R)[None, :]
    mask_tr = mask_t[:, None] & mask_r[None, :]
    total = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for s0 in range(0, splits, SPLIT_BLOCK):
        split = s0 + offs_s
        ptrs = part_tile + split[:, None, None] * (BLOCK_T * BLOCK_R) + tile_offs[None, :, :]
        mask = (split < splits)[:, None, None] & mask_tr[None, :, :]
        # .cg: the other programs' partials are in L2; never read a stale L1 line.
        part = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        total += tl.sum(part, axis=0)
    return total


@triton.jit
def _shrink_concat_kernel(
    x_ptr, a_ptr, scale_ptr, order_ptr, seg_ptr, count_ptr,
    a2_ptr, scale2_ptr, order2_ptr, seg2_ptr, count2_ptr, out_ptr, part_ptr,
    K, R, L, lead, width, R2, L2, lead2, width2, tiles1, k_per_split, splits,
    stride_xt, stride_al, stride_ar, stride_a2l, stride_a2r, stride_ot,
    SECOND: tl.constexpr, SPLIT: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_C: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Programs past the first set's tiles run the second set's (SECOND): same x, its own
    # grouping, A, scale and counters, its columns after the first set's.
    if SECOND:
        second = pid >= tiles1
        tile = tl.where(second, pid - tiles1, pid)
        a_ptr, scale_ptr, R, L, lead, col0, width, stride_al, stride_ar = select_adapter_set(
            second, K, a_ptr, scale_ptr, R, L, lead, width, stride_al, stride_ar,
            a2_ptr, scale2_ptr, R2, L2, lead2, width2, stride_a2l, stride_a2r)
        seg_ptr = tl.where(second, seg2_ptr, seg_ptr)
        count_ptr = tl.where(second, count2_ptr, count_ptr)
    else:
        tile = pid
        col0 = K
    # Before the PDL wait: segments, token order and the first A tile (see the module NOTE).
    slot, row0, row_end = _tile_of_program(seg_ptr, tile, L, BLOCK_T, BLOCK_L)
    offs_t = row0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < row_end  # all false for a program without a tile (row_end 0)
    tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    if SECOND:
        # The orders may differ in dtype: loaded apart, not through one selected pointer.
        tok2 = tl.load(order2_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        tok = tl.where(second, tok2, tok)
    adapted = (slot > 0) & (slot < L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if SECOND:
        # Only the first set's programs copy x (a bound: see _write_lora_columns).
        copy_end = tl.where(second, 0, k_end)
    else:
        copy_end = k_end
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
    # No A rows for slot 0 or no tile (a bound: see _write_lora_columns).
    mask_a = offs_r < tl.where(adapted, R, 0)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    av = tl.load(a_rows + offs_k[None, :], mask=mask_a[:, None] & (offs_k < k_end)[None, :],
                 other=0.0)
    pdl_wait(PDL)
    if slot < L:
        x_rows = x_ptr + tok[:, None] * stride_xt
        out_rows = out_ptr + tok[:, None] * stride_ot
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        # This program's chunk of x goes into xcat as it streams through the dot. A split past the
        # end of K runs no iteration (its partial is zero).
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_tk = mask_t[:, None] & (offs_k < k_end)[None, :]
            xv = tl.load(x_rows + offs_k[None, :], mask=mask_tk, other=0.0)
            tl.store(out_rows + offs_k[None, :], xv.to(out_ptr.dtype.element_ty),
                     mask=mask_t[:, None] & (offs_k < copy_end)[None, :])
            # Slot 0 multiplies zeros (its A mask is empty): no loads, and no branch in the loop.
            if F32_DOT:
                acc += tl.dot(xv.to(tl.float32), tl.trans(av.to(tl.float32)),
                              input_precision="ieee")
            else:
                acc += tl.dot(xv, tl.trans(av))
            # Next A tile (one ahead: the first came before the wait).
            offs_k += BLOCK_K
            av = tl.load(a_rows + offs_k[None, :], mask=mask_a[:, None] & (offs_k < k_end)[None, :],
                         other=0.0)
        lora_rows = out_rows + col0
        if slot == 0:
            # No adapter: zeros in every LoRA column of the set, written once per tile.
            if pid_s == 0:
                _write_lora_columns(lora_rows, mask_t, acc, slot, R, lead, width,
                                    BLOCK_T, BLOCK_R, BLOCK_C)
        elif SPLIT:
            part_tile = part_ptr + pid.to(tl.int64) * splits * (BLOCK_T * BLOCK_R)
            part_offs = tl.arange(0, BLOCK_T)[:, None] * BLOCK_R + offs_r[None, :]
            tl.store(part_tile + pid_s * (BLOCK_T * BLOCK_R) + part_offs, acc,
                     mask=mask_t[:, None] & mask_r[None, :])
            # Every thread's partial is stored before the ticket is taken; the release orders them
            # before the increment, the last program's acquire after it.
            tl.debug_barrier()
            ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == splits - 1:
                total = _sum_partials(part_tile, mask_t, mask_r, splits,
                                      BLOCK_T, BLOCK_R, SPLIT_BLOCK)
                total *= tl.load(scale_ptr + slot).to(tl.float32)
                _write_lora_columns(lora_rows, mask_t, total, slot, R, lead, width,
                                    BLOCK_T, BLOCK_R, BLOCK_C)
                # Self-cleaning: the next launch (or graph replay) finds the counter at zero.
                tl.store(count_ptr + tile, 0)
        else:
            acc *= tl.load(scale_ptr + slot).to(tl.float32)
            _write_lora_columns(lora_rows, mask_t, acc, slot, R, lead, width,
                                BLOCK_T, BLOCK_R, BLOCK_C)



def lora_segments(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group tokens by adapter slot, on the device and without host syncs.

    Args:
        token_slots: int32/int64 ``[T]``, the adapter slot of each token.
        num_slots: ``L``, the number of stacked adapter slots (slot 0 included).

    Returns:
        ``(order, seg_start)``: ``order`` int64 ``[T]`` lists token indices sorted by slot
        (stable); the tokens of slot ``s`` are ``order[seg_start[s]:seg_start[s + 1]]``;
        ``seg_start`` is int32 ``[L + 1]``.
    """
    if not isinstance(token_slots, torch.Tensor) or token_slots.dim() != 1:
        raise ValueError(f"lora_segments: token_slots must be a 1-D tensor, got "
                         f"{getattr(token_slots, 'shape', token_slots)!r}")
    check_slots(token_slots, token_slots.shape[0], token_slots.device)
    sorted_slots, order = torch.sort(token_slots, stable=True)
    bounds = torch.arange(num_slots + 1, device=token_slots.device, dtype=token_slots.dtype)
    seg_start = torch.searchsorted(sorted_slots, bounds, out_int32=True)
    return order, seg_start


def new_lora_counters(device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 ``[LORA_COUNTERS]`` buffer of arrival counters for :func:`lora_shrink_concat`.

    Allocate it once and keep it (every launch leaves it zeroed); it must not share memory with
    anything else, e.g. an engine's reused arena.
    """
    return torch.zeros(LORA_COUNTERS, dtype=torch.int32, device=device)



# ---- launch configuration ------------------------------------------------------------------------
def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 adapters must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting there matches a bf16 MMA with fp32
    accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and envs.TRITON_INTERPRET)


def _block_t(T: int) -> int:
    return 16 if T <= 128 else 64


def _block_k(T: int, K: int) -> int:
    return max(16, min(128 if _block_t(T) == 16 else 64, triton.next_power_of_2(K)))


def _num_warps(block_t: int, block_r: int) -> int:
    return 8 if block_t * block_r >= 64 * 128 else 4


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _tile_grid(T: int, L: int, block_t: int) -> int:
    # sum_s ceil(c_s / B) <= sum_s (floor(c_s / B) + 1) <= floor(T / B) + (non-empty slots).
    return T // block_t + min(L, T)


def _split_block(splits: int, block_t: int, block_r: int) -> int:
    return min(triton.next_power_of_2(splits), max(1, _SPLIT_LOAD_ELEMS // (block_t * block_r)))


def lora_concat_splits(num_tokens: int, in_features: int, rank: int, num_slots: int,
                       device: torch.device | str | None = None, max_tiles: int = LORA_COUNTERS,
                       tuning: LoraTuning = _DEFAULT_TUNING, *, second_rank: int = 0,
                       second_slots: int = 0) -> int:
    """How many K chunks :func:`lora_shrink_concat` of these shapes runs.

    Depends on shapes and the SM count only (132 when ``device`` is not CUDA), so a captured
    decode graph keeps it. The grid (``tiles * splits``) aims at 2 programs per SM, bounded by
    half the number of ``BLOCK_K`` blocks of K (every split gets the same whole number of blocks,
    at least two, but the last), by 32, and by the partials the last program of a tile sums
    (``splits * BLOCK_T * BLOCK_R <= 16384``). A grid of more than ``max_tiles`` tiles (the
    arrival counters) runs one split. E.g. 16 tokens, 5 slots (6 tiles): K 2048 gives 8 splits,
    K 8192 gives 32 (rank <= 32) or 16 (rank 48..64): 48..192 programs.

    A second adapter set's tiles run beside the first's at the first set's split count: only the
    first set's tiles enter the programs-per-SM target (the second's enter the counters bound, and
    its rank the partials bound). So a stacked launch splits, and sums in fp32, exactly as the
    one-set launch of the same tokens does (with the same ``BLOCK_R``): the split depends on
    ``T`` only through the first set's grid, and padding a batch (a captured prefill's bucket)
    changes it only where it changes the one-set launch's.

    Args:
        num_tokens: ``T``.
        in_features: ``K``.
        rank: ``R``, the padded rank of the stack.
        num_slots: ``L``, stacked slots (slot 0 included).
        device: where the kernel runs.
        max_tiles: the arrival counters available (to each adapter set).
        tuning: the launch settings (programs per SM, split bounds).
        second_rank, second_slots: the second adapter set's ``R`` and ``L``
            (:class:`AdapterSet`; 0: none); its tiles share the grid at the first set's split.

    Returns:
        ``splits >= 1`` (1 when there is nothing to split).
    """
    for name, v in (("num_tokens", num_tokens), ("in_features", in_features), ("rank", rank),
                    ("num_slots", num_slots), ("max_tiles", max_tiles),
                    ("second_rank", second_rank), ("second_slots", second_slots)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"lora_concat_splits: {name} must be a non-negative int, got {v!r}")
    if min(num_tokens, in_features, max(rank, second_rank), num_slots) == 0:
        return 1
    block_t = _block_t(num_tokens)
    tiles = _tile_grid(num_tokens, num_slots, block_t)
    tiles2 = _tile_grid(num_tokens, second_slots, block_t) if second_slots else 0
    if max(tiles, tiles2) > max_tiles:
        return 1
    k_blocks = triton.cdiv(in_features, _block_k(num_tokens, in_features))
    partial_cap = max(1, _MAX_PARTIALS // (block_t * _block_r(max(rank, second_rank))))
    # The first set's tiles only: the second set's grid must not move the first set's fp32 sums.
    want = min(triton.cdiv(tuning.programs_per_sm * sm_count(device), tiles),
               max(1, k_blocks // tuning.min_blocks_per_split), tuning.max_splits, partial_cap)
    # Even distribution: no split gets a short or empty range of K blocks.
    per_split = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, per_split)



# ---- launch --------------------------------------------------------------------------------------
def lora_shrink_concat(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scaling: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    counters: torch.Tensor,
    *,
    lead: int = 0,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    splits: int | None = None,
    config: tuple[int, int] | None = None,
    rows: bool | None = None,
    tuning: LoraTuning = _DEFAULT_TUNING,
    width: int | None = None,
    second: AdapterSet | None = None,
) -> torch.Tensor:
    """``out = [x | xa]``: ``x`` copied, then every token's scaled shrink in its slot's block.

    ``out[t, :K] = x[t]``; for ``s = token_slots[t] >= 1``, ``out[t, K + lead + (s-1)*R :][:R] =
    scaling[s] * x[t] @ lora_a[s].T`` (fp32 accumulation, rounded once); every other column of
    the first set's ``out[t, K:K + width]`` is zero. With ``second``, its columns
    ``out[t, K + width:]`` hold the second set's shrink of the same ``x`` in the same layout.
    One launch (see the module docstring for the split-K reduction).

    Args:
        x: ``[T, K]`` activations (fp16/bf16/fp32); rows may be strided.
        lora_a: ``[L, R, K]`` stacked adapters in ``x``'s dtype; ``R`` is the padded rank.
        scaling: fp32 ``[L]`` per-slot scale.
        token_slots: int32/int64 ``[T]`` adapter slot per token (0: no adapter).
        out: ``[T, K + width (+ the second set's columns)]`` in ``x``'s dtype with a unit column
            stride, ``width >= lead + (L - 1) * R``.
        counters: int32 arrival counters, all zero (:func:`new_lora_counters`); left zeroed.
        lead: zero columns between ``x`` and slot 1's block.
        segments: ``lora_segments(token_slots, L)``, computed here when omitted.
        splits: force the number of K chunks (>= 1; more than the counters allow is refused);
            default :func:`lora_concat_splits`.
        config: ``(BLOCK_K, num_warps)`` instead of the heuristic (for tuning).
        tuning: the launch settings (which kernel runs, split-K bounds).
        rows: run the per-token kernel (True) or the slot-tile kernel (False); default: per
            token for up to 64 tokens unless ``splits`` or ``config`` is given (both are
            slot-tile options). ``segments`` and ``counters`` are unused by the per-token kernel.
        width: the first set's LoRA columns; default (and required without ``second``) every
            column of ``out`` after ``x``.
        second: a second adapter set written by the same launch (see :class:`AdapterSet`).

    Returns:
        ``out``.
    """
    fn = "lora_shrink_concat"
    check_tensor(fn, "x", x, 2, None)
    T, K = x.shape
    device = x.device
    check_tensor(fn, "lora_a", lora_a, 3, device)
    L, R, K_a = lora_a.shape
    if K_a != K:
        raise ValueError(f"{fn}: lora_a must be [L, R, {K}] to match x {list(x.shape)}, "
                         f"got {list(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    width, _ = check_layout(fn, x, lora_a, scaling, token_slots, out, lead, width, second)
    check_counters(fn, counters, device)
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"{fn}: splits must be a positive int, got {splits!r}")
    if T == 0 or L == 0:
        return out
    if segments is not None:
        check_segments(segments, T, L, device)
    if rows is None:
        rows = T <= tuning.rows_max_tokens and splits is None and config is None
    elif rows and (splits is not None or config is not None):
        raise ValueError(f"{fn}: splits and config are options of the slot-tile kernel; the "
                         "per-token kernel (rows=True) takes neither")
    if rows:
        launch_rows(x, lora_a, scaling, token_slots, out, lead, width, second)
        return out
    segments = lora_segments(token_slots, L) if segments is None else segments
    order, seg_start = segments
    L2, R2 = second.lora_a.shape[:2] if second is not None else (0, 0)
    if second is not None:
        seg2 = second.segments or lora_segments(second.token_slots, L2)
        a2, scale2, count2, lead2 = second.lora_a, second.scaling, second.counters, second.lead
    else:  # unused: the kernel's SECOND branch is compiled out
        seg2, a2, scale2, count2, lead2 = segments, lora_a, scaling, counters, 0

    block_t, block_r = _block_t(T), _block_r(max(R, R2))
    block_k, num_warps = config or (_block_k(T, K), _num_warps(block_t, block_r))
    tiles = _tile_grid(T, L, block_t)
    tiles2 = _tile_grid(T, L2, block_t) if second is not None else 0
    max_tiles = min(counters.numel(), count2.numel())
    if splits is None:
        splits = lora_concat_splits(T, K, R, L, device, max_tiles, tuning, second_rank=R2,
                                    second_slots=L2)
    elif splits > 1 and max(tiles, tiles2) > max_tiles:
        raise ValueError(f"{fn}: {splits} splits need one counter per tile "
                         f"({max(tiles, tiles2)}), got {max_tiles} counters")
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), splits) * block_k
    partials = out
    if splits > 1:
        partials = torch.empty((tiles + tiles2) * splits * block_t * block_r,
                               dtype=torch.float32, device=device)
    _shrink_concat_kernel[(tiles + tiles2, splits)](
        x, lora_a, scaling, order, seg_start, counters, a2, scale2, seg2[0], seg2[1], count2,
        out, partials,
        K, R, L, lead, width, R2, L2, lead2, out.shape[1] - K - width, tiles, k_per_split, splits,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), a2.stride(0), a2.stride(1),
        out.stride(0),
        SECOND=second is not None, SPLIT=splits > 1, F32_DOT=_use_f32_dot(x.dtype),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
        BLOCK_L=triton.next_power_of_2(max(L, L2)), BLOCK_C=ZERO_CHUNK,
        SPLIT_BLOCK=_split_block(splits, block_t, block_r), num_warps=num_warps,
        **pdl_kwargs(x),
    )
    return out
