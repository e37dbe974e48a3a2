"""Multi-LoRA shrink into a concatenated GEMM operand: every token of a batch may use a different
adapter, and the base linear and the adapters run as one GEMM.

A LoRA linear computes ``y[t] = x[t] @ W.T + scaling[s] * (x[t] @ A[s].T) @ B[s].T``, ``s`` being
the token's adapter slot (slot 0: no adapter). Written on concatenated operands this is one GEMM::

    y = [x | xa] @ [W | B_1 | B_2 | ... | B_{L-1}].T

where row ``t`` of ``xa`` holds ``scaling[s] * x[t] @ A[s].T`` in the column block of slot ``s``
and exact zeros everywhere else. :func:`lora_shrink_concat` writes ``xcat = [x | xa]`` in one
launch; the caller runs the GEMM on a weight whose B blocks sit beside ``W`` (see
:mod:`tgraph.layers.lora_bank`). ``xcat`` may also carry ``lead`` zero columns before the slot
blocks and zero padding after them (columns another feature's adapters own in the shared weight).

Adapters are stacked: ``lora_a [L, R, K]`` (``R`` the padded maximum rank; a smaller adapter has
zero rows). Slot ``s >= 1``'s block is ``xcat[:, K + lead + (s - 1) * R : K + lead + s * R]``.

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

Per-token programs at decode. For a handful of tokens (``T <= 64``: decode batches) a second
kernel runs instead, with no grouping, no split and no reduction: program ``(t, c)`` computes
rank chunk ``c`` of token ``t``'s shrink over the whole of K with CUDA-core FMAs. Everything it
multiplies by is known before the PDL wait (the token's slot is a step input, A is adapter
weight), so its A chunk streams in while the kernel before drains; after the wait it reads one row
of ``x`` (in L2), reduces, and writes. The slot-tile kernel's split-K reduction costs several
dependent L2 round trips after the wait (partials, ticket, sum): several microseconds per
launch at decode (docs/performance.md).

Two adapter sets in one launch (stacked LoRA features, :class:`AdapterSet`). The operand may
hold a second set's columns after the first set's ``width``: ``[x | set 1 | set 2]``, each set
with its own slots, A, scale and layout, both shrinking the same ``x``. The slot-tile kernel runs
the second set's tiles (grouped by its own slots) as more programs of the same grid, split as the
first set alone would be (:func:`lora_concat_splits`), and the per-token kernel its rank chunks
as more chunks of each token; a program picks its set from its program id, and only the first
set's programs copy ``x`` (per token: all programs share it). A ``SECOND`` constexpr compiles the
selection out of one-set launches.

Tokens whose slot is outside ``[0, L)`` belong to no tile: their rows of ``xcat`` are left
unwritten (checking the values would need a host sync). Callers pass valid slots.

NOTE (PDL): before the PDL wait the kernel reads only the segments, the token order and its first
``A`` tile, which no kernel of a step writes (the engine passes segments as inputs, and
:func:`lora_segments` computes them with torch ops, never PDL-launched). ``x``, ``xcat``, the
workspace, the counters and ``scaling`` are touched after the wait.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.ir.ops.lora import LORA_COUNTER_SLOTS as LORA_COUNTERS
from tgraph.kernels.triton.device_info import sm_count
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.tuning import LoraTuning

__all__ = ["LORA_COUNTERS", "PROLOGUES", "AdapterSet", "lora_concat_splits",
           "lora_prologue_concat", "lora_segments", "lora_shrink_concat", "new_lora_counters",
           "prologue_fits", "rows_overlap"]

_DEFAULT_TUNING = LoraTuning()
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
# Bound on the partials the last program of a tile sums (splits * BLOCK_T * BLOCK_R fp32
# elements, 64 KB): that sum is the serial tail of the launch.
_MAX_PARTIALS = 16384
# Partials loaded at once ([SPLIT_BLOCK, BLOCK_T, BLOCK_R] fp32, 64 registers a thread at 4
# warps): enough loads in flight for the tail's L2 reads.
_SPLIT_LOAD_ELEMS = 8192
# Width of the column chunks of zeros written beside the slot block.
_BLOCK_C = 64
# A chunk of the per-token kernel: BLOCK_R x BLOCK_K elements of A, held in registers.
_ROWS_CHUNK_ELEMS = 8192


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
        a_ptr = tl.where(second, a2_ptr, a_ptr)
        scale_ptr = tl.where(second, scale2_ptr, scale_ptr)
        seg_ptr = tl.where(second, seg2_ptr, seg_ptr)
        count_ptr = tl.where(second, count2_ptr, count_ptr)
        R = tl.where(second, R2, R)
        L = tl.where(second, L2, L)
        lead = tl.where(second, lead2, lead)
        col0 = tl.where(second, K + width, K)
        width = tl.where(second, width2, width)
        stride_al = tl.where(second, stride_a2l, stride_al)
        stride_ar = tl.where(second, stride_a2r, stride_ar)
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


# What the per-token kernel computes x from (its PROLOGUE constexpr).
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_ADD_RMS_NORM = 0, 1, 2


@triton.jit
def _x_tile(x_row, r_row, g_ptr, sum_row, offs_k, mask_k, keep, K, eps,
            PROLOGUE: tl.constexpr, DTYPE: tl.constexpr):
    """One K tile of the token's ``x`` in ``DTYPE``, computed as the unfused producer stores it.

    ``PROLOGUE_NONE``: read. The norms (the whole row in this one tile): the sum
    ``x + residual`` rounded and stored where ``keep`` (add), then
    ``weight * (s * rsqrt(mean(s**2) + eps)).to(DTYPE)``, as ``tgraph.kernels.triton.norms``.
    """
    if PROLOGUE == 0:
        xv = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(DTYPE)
    else:
        h = tl.load(x_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if PROLOGUE == 2:
            summed = (h + tl.load(r_row + offs_k, mask=mask_k, other=0.0).to(tl.float32)).to(DTYPE)
            tl.store(sum_row + offs_k, summed, mask=keep)
            h = summed.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        w = tl.load(g_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        xv = ((h * rstd).to(DTYPE).to(tl.float32) * w).to(DTYPE)
    return xv


@triton.jit
def _shrink_rows_kernel(
    x_ptr, r_ptr, g_ptr, sum_ptr, a_ptr, scale_ptr, slots_ptr, a2_ptr, scale2_ptr, slots2_ptr,
    out_ptr, K, R, L, lead, width, R2, L2, lead2, width2, chunks1, eps,
    stride_xt, stride_rt, stride_st, stride_al, stride_ar, stride_a2l, stride_a2r, stride_ot,
    PROLOGUE: tl.constexpr, SECOND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """Token ``t = program_id(0)``, ranks ``[c * BLOCK_R, +BLOCK_R)`` with ``c = program_id(1)``:
    the shrink values of those ranks in the token's slot block, zeros at the same ranks of every
    other slot block, and a ``1 / num_programs(1)`` slice of the ``x`` copy (and of the sum, for
    ``PROLOGUE_ADD_RMS_NORM``); chunk 0 also zeroes the columns outside the slot blocks. Every
    program computes the whole ``x`` row it multiplies (see :func:`_x_tile`).

    ``SECOND``: chunks ``c >= chunks1`` are chunk ``c - chunks1`` of the second adapter set (its
    own slots, A, scale and layout), whose columns follow the first set's ``width``."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    # Before the PDL wait: the token's slot (a step input), then its scale and first A tile
    # (adapter state, written only when adapters are loaded or activated, between steps).
    slot = tl.load(slots_ptr + t)
    if SECOND:
        second = c >= chunks1
        # The slots may differ in dtype: loaded apart, not through one selected pointer.
        slot = tl.where(second, tl.load(slots2_ptr + t).to(tl.int64), slot.to(tl.int64))
        c = tl.where(second, c - chunks1, c)
        a_ptr = tl.where(second, a2_ptr, a_ptr)
        scale_ptr = tl.where(second, scale2_ptr, scale_ptr)
        R = tl.where(second, R2, R)
        L = tl.where(second, L2, L)
        lead = tl.where(second, lead2, lead)
        col0 = tl.where(second, K + width, K)
        width = tl.where(second, width2, width)
        stride_al = tl.where(second, stride_a2l, stride_al)
        stride_ar = tl.where(second, stride_a2r, stride_ar)
    else:
        col0 = K
    adapted = (slot > 0) & (slot < L)
    scale = tl.load(scale_ptr + tl.where(adapted, slot, 0)).to(tl.float32)
    offs_r = c * BLOCK_R + tl.arange(0, BLOCK_R)
    # No A rows for slot 0 (a bound: the interpreter cannot broadcast a scalar-bool mask).
    mask_a = offs_r < tl.where(adapted, R, 0)
    a_rows = (a_ptr + tl.where(adapted, slot, 0).to(tl.int64) * stride_al
              + offs_r[:, None] * stride_ar)
    offs_k = tl.arange(0, BLOCK_K)
    av = tl.load(a_rows + offs_k[None, :], mask=mask_a[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_wait(PDL)
    if (slot >= 0) & (slot < L):
        x_row = x_ptr + t * stride_xt
        out_row = out_ptr + t * stride_ot
        # Every program of the token (both sets') copies a share of x.
        share = tl.cdiv(K, chunks)
        copy_lo = tl.program_id(1) * share
        copy_hi = copy_lo + share
        acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            keep = mask_k & (offs_k >= copy_lo) & (offs_k < copy_hi)
            xv = _x_tile(x_row, r_ptr + t * stride_rt, g_ptr, sum_ptr + t * stride_st, offs_k,
                         mask_k, keep, K, eps, PROLOGUE, out_ptr.dtype.element_ty)
            tl.store(out_row + offs_k, xv, mask=keep)
            acc += av.to(tl.float32) * xv.to(tl.float32)[None, :]
            nxt = offs_k + BLOCK_K
            av = tl.load(a_rows + nxt[None, :], mask=mask_a[:, None] & (nxt < K)[None, :],
                         other=0.0)
        vals = tl.sum(acc, axis=1) * scale
        # Rank chunk c of slot blocks 1..L-1: this token's values in its own block, else zeros.
        blocks = tl.arange(0, BLOCK_L) + 1
        cols = lead + (blocks[:, None] - 1) * R + offs_r[None, :]
        vals = tl.where(blocks[:, None] == slot, vals[None, :], 0.0)
        tl.store(out_row + col0 + cols, vals.to(out_ptr.dtype.element_ty),
                 mask=(blocks < L)[:, None] & (offs_r < R)[None, :])
        if c == 0:
            # The lead columns (another feature's region) and the padding after the last block.
            blocks_end = lead + (L - 1) * R
            for c0 in range(0, width, BLOCK_C):
                pad = c0 + tl.arange(0, BLOCK_C)
                outside = (pad < lead) | ((pad >= blocks_end) & (pad < width))
                tl.store(out_row + col0 + pad,
                         tl.zeros((BLOCK_C,), dtype=out_ptr.dtype.element_ty), mask=outside)


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
    _check_slots(token_slots, token_slots.shape[0], token_slots.device)
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


# ---- argument checks ----------------------------------------------------------------------------
def _check_tensor(fn: str, name: str, t: torch.Tensor, dims: int,
                  device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {dims}-D, got shape {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dim, got strides {t.stride()}")


def _check_slots(token_slots: torch.Tensor, T: int, device: torch.device) -> None:
    if not isinstance(token_slots, torch.Tensor) or token_slots.dtype not in _SLOT_DTYPES:
        raise TypeError(f"token_slots must be an int32 (or int64) tensor, got "
                        f"{getattr(token_slots, 'dtype', type(token_slots).__name__)}")
    if token_slots.dim() != 1 or token_slots.shape[0] != T:
        raise ValueError(f"token_slots must have shape [{T}], got {list(token_slots.shape)}")
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, expected {device}")


def _check_segments(segments: tuple[torch.Tensor, torch.Tensor], T: int, L: int,
                    device: torch.device) -> None:
    order, seg_start = segments
    if tuple(order.shape) != (T,) or tuple(seg_start.shape) != (L + 1,):
        raise ValueError(f"segments must be (order [{T}], seg_start [{L + 1}]) from lora_segments, "
                         f"got ({list(order.shape)}, {list(seg_start.shape)})")
    if order.device != device or seg_start.device != device:
        raise ValueError(f"segments must be on {device}")


def _check_scaling(fn: str, scaling: torch.Tensor, L: int, device: torch.device) -> None:
    if not isinstance(scaling, torch.Tensor) or scaling.dtype != torch.float32:
        raise TypeError(f"{fn}: scaling must be a float32 tensor [{L}], got "
                        f"{getattr(scaling, 'dtype', type(scaling).__name__)}")
    if tuple(scaling.shape) != (L,) or scaling.device != device:
        raise ValueError(f"{fn}: scaling must have shape [{L}] on {device}, "
                         f"got {list(scaling.shape)} on {scaling.device}")


def _check_counters(fn: str, counters: torch.Tensor, device: torch.device) -> None:
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
            or counters.dim() != 1):
        raise TypeError(f"{fn}: counters must be a 1-D int32 tensor (new_lora_counters), got "
                        f"{getattr(counters, 'dtype', type(counters).__name__)}"
                        f"{list(getattr(counters, 'shape', []))}")
    if counters.device != device or (counters.numel() > 1 and counters.stride(0) != 1):
        raise ValueError(f"{fn}: counters must be contiguous on {device}, got {counters.device} "
                         f"strides {counters.stride()}")


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


class AdapterSet(NamedTuple):
    """A second stack of adapters in the same operand (stacked LoRA features): its LoRA columns
    follow the first set's ``width`` columns, laid out as the first set's are, with its own
    slots; every token gets both sets' shrinks of the same ``x``, in one launch.

    Attributes:
        lora_a: ``[L2, R2, K]`` in ``x``'s dtype.
        scaling: fp32 ``[L2]``.
        token_slots: int32/int64 ``[T]`` (0: no adapter of this set).
        counters: its own zeroed int32 arrival counters (:func:`new_lora_counters`).
        lead: zero columns before its slot 1's block.
        segments: ``lora_segments(token_slots, L2)``, computed when omitted.
    """

    lora_a: torch.Tensor
    scaling: torch.Tensor
    token_slots: torch.Tensor
    counters: torch.Tensor
    lead: int = 0
    segments: tuple[torch.Tensor, torch.Tensor] | None = None


def _check_layout(fn: str, x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor,
                  token_slots: torch.Tensor, out: torch.Tensor, lead: int, width: int | None,
                  second: AdapterSet | None) -> tuple[int, int]:
    """Check the operand's layout; returns ``(width, width2)``: the first set's LoRA columns and
    the second's (0 without one)."""
    T, K = x.shape
    device = x.device
    L, R = lora_a.shape[:2]
    _check_tensor(fn, "out", out, 2, device)
    if out.dtype != x.dtype:
        raise TypeError(f"{fn}: out must be {x.dtype} (x's dtype), got {out.dtype}")
    if not isinstance(lead, int) or lead < 0:
        raise ValueError(f"{fn}: lead must be a non-negative int, got {lead!r}")
    need = K + lead + max(L - 1, 0) * R
    if out.shape[0] != T or out.shape[1] < need:
        raise ValueError(f"{fn}: out must be [{T}, >= {need}] (K {K} + lead {lead} + (L - 1) * R "
                         f"{max(L - 1, 0) * R}), got {list(out.shape)}")
    _check_scaling(fn, scaling, L, device)
    _check_slots(token_slots, T, device)
    if second is None:
        if width is not None and width != out.shape[1] - K:
            raise ValueError(f"{fn}: width {width} must be out's {out.shape[1] - K} columns after "
                             "x (without a second adapter set)")
        return out.shape[1] - K, 0
    if not isinstance(second, AdapterSet):
        raise TypeError(f"{fn}: second must be an AdapterSet, got {type(second).__name__}")
    if not isinstance(width, int) or width < need - K:
        raise ValueError(f"{fn}: with a second adapter set, width (the first set's columns) must "
                         f"be an int >= {need - K}, got {width!r}")
    a2 = second.lora_a
    _check_tensor(fn, "second.lora_a", a2, 3, device)
    L2, R2, K2 = a2.shape
    if K2 != K or a2.dtype != x.dtype:
        raise ValueError(f"{fn}: second.lora_a must be {x.dtype} [L2, R2, {K}], got {a2.dtype} "
                         f"{list(a2.shape)}")
    if not isinstance(second.lead, int) or second.lead < 0:
        raise ValueError(f"{fn}: second.lead must be a non-negative int, got {second.lead!r}")
    need2 = K + width + second.lead + max(L2 - 1, 0) * R2
    if out.shape[1] < need2:
        raise ValueError(f"{fn}: out must have >= {need2} columns (K {K} + width {width} + "
                         f"second.lead {second.lead} + (L2 - 1) * R2 {max(L2 - 1, 0) * R2}), "
                         f"got {list(out.shape)}")
    _check_scaling(fn, second.scaling, L2, device)
    _check_slots(second.token_slots, T, device)
    _check_counters(fn, second.counters, device)
    if second.segments is not None:
        _check_segments(second.segments, T, L2, device)
    return width, out.shape[1] - K - width


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
    _check_tensor(fn, "x", x, 2, None)
    T, K = x.shape
    device = x.device
    _check_tensor(fn, "lora_a", lora_a, 3, device)
    L, R, K_a = lora_a.shape
    if K_a != K:
        raise ValueError(f"{fn}: lora_a must be [L, R, {K}] to match x {list(x.shape)}, "
                         f"got {list(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    width, _ = _check_layout(fn, x, lora_a, scaling, token_slots, out, lead, width, second)
    _check_counters(fn, counters, device)
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise ValueError(f"{fn}: splits must be a positive int, got {splits!r}")
    if T == 0 or L == 0:
        return out
    if segments is not None:
        _check_segments(segments, T, L, device)
    if rows is None:
        rows = T <= tuning.rows_max_tokens and splits is None and config is None
    elif rows and (splits is not None or config is not None):
        raise ValueError(f"{fn}: splits and config are options of the slot-tile kernel; the "
                         "per-token kernel (rows=True) takes neither")
    if rows:
        _launch_rows(x, lora_a, scaling, token_slots, out, lead, width, second)
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
        BLOCK_L=triton.next_power_of_2(max(L, L2)), BLOCK_C=_BLOCK_C,
        SPLIT_BLOCK=_split_block(splits, block_t, block_r), num_warps=num_warps,
        **pdl_kwargs(x),
    )
    return out


# lora_prologue_concat's prologue names -> the kernel's PROLOGUE values.
PROLOGUES = {"rms_norm": PROLOGUE_RMS_NORM, "add_rms_norm": PROLOGUE_ADD_RMS_NORM}


def prologue_fits(prologue: str, num_tokens: int, in_features: int,
                  tuning: LoraTuning = _DEFAULT_TUNING) -> bool:
    """Whether :func:`lora_prologue_concat` takes these sizes: a decode batch (at most
    ``tuning.rows_max_tokens`` tokens) of rows that one program holds whole
    (``in_features <= 8192``)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; expected one of {sorted(PROLOGUES)}")
    return num_tokens <= tuning.rows_max_tokens and in_features <= _ROWS_CHUNK_ELEMS


def rows_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two row-strided 2-D tensors intersect."""
    a_lo = a.data_ptr()
    b_lo = b.data_ptr()
    a_hi = a_lo + (a.shape[0] - 1) * a.stride(0) * a.element_size() + a.shape[1] * a.element_size()
    b_hi = b_lo + (b.shape[0] - 1) * b.stride(0) * b.element_size() + b.shape[1] * b.element_size()
    return a_lo < b_hi and b_lo < a_hi


def lora_prologue_concat(
    prologue: str,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    scaling: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    *,
    lead: int = 0,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    summed: torch.Tensor | None = None,
    eps: float | None = None,
    tuning: LoraTuning = _DEFAULT_TUNING,
    width: int | None = None,
    second: AdapterSet | None = None,
) -> torch.Tensor:
    """``out = [p(x) | xa]`` in one launch: the producer ``p`` of a LoRA linear's input and
    :func:`lora_shrink_concat` of its result (decode batches; see :func:`prologue_fits`).

    - ``"rms_norm"``: ``p(x) = rms_norm(x) * norm_weight``.
    - ``"add_rms_norm"``: ``summed = x + residual`` (rounded, written), ``p = rms_norm(summed) *
      norm_weight``.

    Args:
        prologue: one of :data:`PROLOGUES`.
        x: ``[T, K]`` in ``lora_a``'s dtype, last dim contiguous.
        lora_a, scaling, token_slots, out, lead, width, second: as :func:`lora_shrink_concat`.
        residual: ``[T, K]`` (add_rms_norm).
        norm_weight: ``[K]`` in ``x``'s dtype.
        summed: ``[T, K]`` output of the sum (add_rms_norm); must not overlap ``x`` or
            ``residual`` (every program reads the whole rows while others write their slices).
        eps: the RMSNorm epsilon.
        tuning: the launch settings (the most tokens the kernel takes).

    Returns:
        ``out``.
    """
    fn = "lora_prologue_concat"
    if prologue not in PROLOGUES:
        raise ValueError(f"{fn}: unknown prologue {prologue!r}; "
                         f"expected one of {sorted(PROLOGUES)}")
    _check_tensor(fn, "x", x, 2, None)
    device = x.device
    _check_tensor(fn, "lora_a", lora_a, 3, device)
    L, R, K = lora_a.shape
    T = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"{fn}: x must be [T, {K}] to match lora_a {list(lora_a.shape)}, got "
                         f"{list(x.shape)}")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    _check_tensor(fn, "out", out, 2, device)
    need = K + lead + max(L - 1, 0) * R
    if out.dtype != x.dtype or out.shape[0] != T or out.shape[1] < need:
        raise ValueError(f"{fn}: out must be {x.dtype} [{T}, >= {need}], got {out.dtype} "
                         f"{list(out.shape)}")
    width, _ = _check_layout(fn, x, lora_a, scaling, token_slots, out, lead, width, second)
    if not prologue_fits(prologue, T, K, tuning):
        raise ValueError(f"{fn}: {T} tokens of {K} features is not a decode batch this kernel "
                         f"takes (at most {tuning.rows_max_tokens} tokens of at most "
                         f"{_ROWS_CHUNK_ELEMS} features); use the producer and lora_shrink_concat")
    _check_tensor(fn, "norm_weight", norm_weight, 1, device)
    if tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"{fn}: norm_weight must be {x.dtype} [{K}], got "
                         f"{norm_weight.dtype} {list(norm_weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{fn}: eps must be a non-negative number, got {eps!r}")
    if prologue == "add_rms_norm":
        for name, t in (("residual", residual), ("summed", summed)):
            _check_tensor(fn, name, t, 2, device)
            if tuple(t.shape) != (T, K) or t.dtype != x.dtype:
                raise ValueError(f"{fn}: {name} must be {x.dtype} [{T}, {K}], got {t.dtype} "
                                 f"{list(t.shape)}")
    if T == 0 or L == 0:
        return out
    if prologue == "add_rms_norm" and (rows_overlap(summed, x) or rows_overlap(summed, residual)):
        raise ValueError(f"{fn}: summed must not overlap x or residual (every program reads "
                         "the whole rows while the others write their slices of the sum)")
    _launch_rows(x, lora_a, scaling, token_slots, out, lead, width, second, PROLOGUES[prologue],
                 residual, norm_weight, summed, eps or 0.0)
    return out


def _launch_rows(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor,
                 token_slots: torch.Tensor, out: torch.Tensor, lead: int, width: int,
                 second: AdapterSet | None = None, prologue: int = PROLOGUE_NONE,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 summed: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """The per-token kernel on checked arguments (see the module docstring); ``x`` is the
    prologue's input."""
    T = x.shape[0]
    L, R, K = lora_a.shape
    if second is not None:
        a2, scale2, slots2, lead2 = (second.lora_a, second.scaling, second.token_slots,
                                     second.lead)
    else:  # unused: the kernel's SECOND branch is compiled out
        a2, scale2, slots2, lead2 = lora_a, scaling, token_slots, 0
    L2, R2 = a2.shape[:2] if second is not None else (0, 0)
    block_k = min(triton.next_power_of_2(K), _ROWS_CHUNK_ELEMS)
    block_r = max(1, min(triton.next_power_of_2(max(R, R2)), _ROWS_CHUNK_ELEMS // block_k))
    # At least one chunk per set: with R == 0 (no adapter rank) the x copy and zeros remain.
    chunks1 = max(1, triton.cdiv(R, block_r))
    chunks2 = max(1, triton.cdiv(R2, block_r)) if second is not None else 0
    r = residual if residual is not None else x
    s = summed if summed is not None else out
    _shrink_rows_kernel[(T, chunks1 + chunks2)](
        x, r, norm_weight if norm_weight is not None else x, s, lora_a, scaling, token_slots,
        a2, scale2, slots2, out,
        K, R, L, lead, width, R2, L2, lead2, out.shape[1] - K - width, chunks1, float(eps),
        x.stride(0), r.stride(0), s.stride(0), lora_a.stride(0), lora_a.stride(1),
        a2.stride(0), a2.stride(1), out.stride(0),
        PROLOGUE=prologue, SECOND=second is not None, BLOCK_R=block_r, BLOCK_K=block_k,
        BLOCK_L=triton.next_power_of_2(max(L - 1, L2 - 1, 1)), BLOCK_C=_BLOCK_C,
        num_warps=8 if block_r * block_k >= 4096 else 4, **pdl_kwargs(x),
    )
