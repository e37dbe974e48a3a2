"""Multi-LoRA shrink/expand kernels: every token of a batch may use a different adapter.

A LoRA linear adds ``scaling[s] * (x @ A[s].T) @ B[s].T`` to the base output, ``s`` being the token's
adapter slot. Adapters are stacked: ``lora_a [L, R, K]`` and ``lora_b [L, N, R]``, ``R`` the padded
maximum rank (a smaller adapter has zero rows/columns). Slot 0 means "no adapter".

Grouping. Tokens are sorted by slot on the device (:func:`lora_segments`: a stable sort plus a
``searchsorted`` for the segment starts, no host sync). The kernels then run over *tiles*: the
tokens of slot ``s`` are cut into ``ceil(count_s / BLOCK_T)`` tiles, and program ``i`` finds its
``(slot, first row)`` from a prefix sum over the slots' tile counts, computed in the kernel. So
every program does dense work for one adapter and no program scans slots it does not serve. The
number of tiles is at most ``T // BLOCK_T + min(L, T)``, which is the grid: it depends on shapes
only, so the launches are CUDA-graph capturable; the programs past the last tile exit at once.

The segments depend only on ``token_slots``: compute them once per batch with
:func:`lora_segments` and pass them to every shrink/expand of the step.

Tokens whose slot is outside ``[0, L)`` belong to no segment and are skipped (their rows of the
shrink output are left unwritten); checking the values would need a host sync.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["lora_segments", "lora_shrink", "lora_expand"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


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
def _lora_shrink_kernel(
    x_ptr, a_ptr, order_ptr, seg_ptr, scale_ptr, out_ptr,
    K, R, L,
    stride_xt, stride_al, stride_ar, stride_ot,
    HAS_SCALE: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    slot, row0, row_end = _tile_of_program(seg_ptr, pid, L, BLOCK_T, BLOCK_L)
    if slot < L:
        offs_t = row0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < row_end
        tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        out_ptrs = out_ptr + tok[:, None] * stride_ot + offs_r[None, :]
        mask_out = mask_t[:, None] & mask_r[None, :]
        if slot == 0:
            # No adapter: zeros, no reads.
            tl.store(out_ptrs, tl.zeros((BLOCK_T, BLOCK_R), dtype=out_ptr.dtype.element_ty), mask=mask_out)
        else:
            a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
            x_rows = x_ptr + tok[:, None] * stride_xt
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < K
                xv = tl.load(x_rows + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                av = tl.load(a_rows + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
                if F32_DOT:
                    acc += tl.dot(xv.to(tl.float32), tl.trans(av.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(xv, tl.trans(av))
            if HAS_SCALE:
                acc *= tl.load(scale_ptr + slot).to(tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, order_ptr, seg_ptr, scale_ptr, y_ptr,
    N, R, L, col_off,
    stride_tt, stride_bl, stride_bn, stride_yt,
    F32_DOT: tl.constexpr, OVERWRITE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, row0, row_end = _tile_of_program(seg_ptr, pid, L, BLOCK_T, BLOCK_L)
    if OVERWRITE & (slot == 0):
        # No adapter: the delta of these rows is zero.
        offs_t = row0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < row_end
        tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + col_off + offs_n[None, :]
        tl.store(y_ptrs, tl.zeros((BLOCK_T, BLOCK_N), dtype=y_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & (offs_n < N)[None, :])
    # Without OVERWRITE, slot 0 tokens keep y as it is: nothing to do.
    if (slot > 0) & (slot < L):
        offs_t = row0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < row_end
        tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        tv = tl.load(t_ptr + tok[:, None] * stride_tt + offs_r[None, :],
                     mask=mask_t[:, None] & mask_r[None, :], other=0.0)
        bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :],
                     mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        if F32_DOT:
            acc = tl.dot(tv.to(tl.float32), tl.trans(bv.to(tl.float32)), input_precision="ieee")
        else:
            # NOTE: an fp32 shrink output is rounded to the adapter dtype for the tensor-core dot
            # (as punica/vLLM do); the rounding is within the dtype's tolerance.
            acc = tl.dot(tv.to(bv.dtype), tl.trans(bv))
        acc *= tl.load(scale_ptr + slot).to(tl.float32)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + col_off + offs_n[None, :]
        mask_y = mask_t[:, None] & mask_n[None, :]
        if not OVERWRITE:
            acc += tl.load(y_ptrs, mask=mask_y, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)


def lora_segments(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group tokens by adapter slot, on the device and without host syncs.

    Args:
        token_slots: int32/int64 ``[T]``, the adapter slot of each token.
        num_slots: ``L``, the number of stacked adapter slots (slot 0 included).

    Returns:
        ``(order, seg_start)``: ``order`` int64 ``[T]`` lists token indices sorted by slot (stable);
        the tokens of slot ``s`` are ``order[seg_start[s]:seg_start[s + 1]]``; ``seg_start`` is int32
        ``[L + 1]``.
    """
    if not isinstance(token_slots, torch.Tensor) or token_slots.dim() != 1:
        raise ValueError(f"lora_segments: token_slots must be a 1-D tensor, got {getattr(token_slots, 'shape', token_slots)!r}")
    _check_slots(token_slots, token_slots.shape[0], token_slots.device)
    sorted_slots, order = torch.sort(token_slots, stable=True)
    bounds = torch.arange(num_slots + 1, device=token_slots.device, dtype=token_slots.dtype)
    seg_start = torch.searchsorted(sorted_slots, bounds, out_int32=True)
    return order, seg_start


def _check_tensor(fn: str, name: str, t: torch.Tensor, dims: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{fn}: {name} must be {dims}-D, got shape {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.device != device:
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


def _check_segments(segments: tuple[torch.Tensor, torch.Tensor], T: int, L: int, device: torch.device) -> None:
    order, seg_start = segments
    if tuple(order.shape) != (T,) or tuple(seg_start.shape) != (L + 1,):
        raise ValueError(f"segments must be (order [{T}], seg_start [{L + 1}]) from lora_segments, got "
                         f"({list(order.shape)}, {list(seg_start.shape)})")
    if order.device != device or seg_start.device != device:
        raise ValueError(f"segments must be on {device}")


def _check_scaling(fn: str, scaling: torch.Tensor, L: int, device: torch.device) -> None:
    if not isinstance(scaling, torch.Tensor) or scaling.dtype != torch.float32:
        raise TypeError(f"{fn}: scaling must be a float32 tensor [{L}], got "
                        f"{getattr(scaling, 'dtype', type(scaling).__name__)}")
    if tuple(scaling.shape) != (L,) or scaling.device != device:
        raise ValueError(f"{fn}: scaling must have shape [{L}] on {device}, got {list(scaling.shape)} on {scaling.device}")


def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 adapters must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting there matches a bf16 MMA with fp32
    accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _tile_grid(T: int, L: int, block_t: int) -> int:
    # sum_s ceil(c_s / B) <= sum_s (floor(c_s / B) + 1) <= floor(T / B) + (non-empty slots).
    return T // block_t + min(L, T)


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    scaling: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[t] = scaling[s] * x[t] @ lora_a[s].T`` with ``s = token_slots[t]``; zeros for slot 0.

    Args:
        x: ``[T, K]`` activations (fp16/bf16/fp32); rows may be strided.
        lora_a: ``[L, R, K]`` stacked adapters, same dtype as ``x``; ``R`` is the padded rank.
        token_slots: int32 ``[T]`` adapter slot per token (0: no adapter).
        out: ``[T, R]``, fp32 or ``x``'s dtype; every row of a token with a valid slot is written.
        scaling: optional fp32 ``[L]`` applied here (usually it is applied in :func:`lora_expand`).
        segments: ``lora_segments(token_slots, L)``, computed here when omitted.

    Returns:
        ``out``.
    """
    fn = "lora_shrink"
    _check_tensor(fn, "x", x, 2, x.device if isinstance(x, torch.Tensor) else None)
    T, K = x.shape
    device = x.device
    _check_tensor(fn, "lora_a", lora_a, 3, device)
    L, R, _ = lora_a.shape
    if lora_a.shape[2] != K:
        raise ValueError(f"{fn}: lora_a must be [L, R, {K}] to match x [T, {K}], got {list(lora_a.shape)}")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    _check_tensor(fn, "out", out, 2, device)
    if tuple(out.shape) != (T, R):
        raise ValueError(f"{fn}: out must have shape [{T}, {R}], got {list(out.shape)}")
    if out.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{fn}: out must be float32 or {x.dtype}, got {out.dtype}")
    _check_slots(token_slots, T, device)
    if scaling is not None:
        _check_scaling(fn, scaling, L, device)
    if T == 0 or L == 0 or R == 0:
        return out
    order, seg_start = lora_segments(token_slots, L) if segments is None else segments
    _check_segments((order, seg_start), T, L, device)

    block_t = 16 if T <= 128 else 64
    block_r = max(16, triton.next_power_of_2(R))
    block_k = max(16, min(128 if block_t == 16 else 64, triton.next_power_of_2(K)))
    _lora_shrink_kernel[(_tile_grid(T, L, block_t),)](
        x, lora_a, order, seg_start, scaling if scaling is not None else out, out,
        K, R, L,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        HAS_SCALE=scaling is not None, F32_DOT=_use_f32_dot(x.dtype),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_L=triton.next_power_of_2(L),
        num_warps=4, **pdl_kwargs(x),
    )
    return out


def lora_expand(
    t: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    scaling: torch.Tensor,
    column_offset: int = 0,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """``y[t, off:off+N] += scaling[s] * (t[t] @ lora_b[s].T)``, ``s = token_slots[t]``, slot 0 skipped.

    Packed projections (q/k/v, gate/up) call this once per part with that part's adapters and
    ``column_offset``; ``y`` may also be a column-strided view.

    Args:
        t: ``[T, R]`` shrink output (fp32 or the adapter dtype).
        lora_b: ``[L, N, R]`` stacked adapters (fp16/bf16/fp32).
        token_slots: int32 ``[T]`` adapter slot per token (0: no adapter).
        y: ``[T, N_total]`` updated in place (any supported dtype), ``N_total >= column_offset + N``.
        scaling: fp32 ``[L]`` per-slot scale (``alpha / rank``).
        column_offset: first column of ``y`` this adapter writes.
        segments: ``lora_segments(token_slots, L)``, computed here when omitted.
        overwrite: write the delta instead of adding it (slot-0 rows get zeros), so ``y``
            needs no zeroing beforehand.

    Returns:
        ``y``.
    """
    fn = "lora_expand"
    _check_tensor(fn, "t", t, 2, t.device if isinstance(t, torch.Tensor) else None)
    T, R = t.shape
    device = t.device
    _check_tensor(fn, "lora_b", lora_b, 3, device)
    L, N, _ = lora_b.shape
    if lora_b.shape[2] != R:
        raise ValueError(f"{fn}: lora_b must be [L, N, {R}] to match t [T, {R}], got {list(lora_b.shape)}")
    if t.dtype not in (torch.float32, lora_b.dtype):
        raise TypeError(f"{fn}: t must be float32 or {lora_b.dtype} (lora_b's dtype), got {t.dtype}")
    _check_tensor(fn, "y", y, 2, device)
    if not isinstance(column_offset, int) or column_offset < 0:
        raise ValueError(f"{fn}: column_offset must be a non-negative int, got {column_offset!r}")
    if y.shape[0] != T or y.shape[1] < column_offset + N:
        raise ValueError(f"{fn}: y must be [{T}, >= {column_offset + N}] (column_offset {column_offset} + N {N}), "
                         f"got {list(y.shape)}")
    _check_slots(token_slots, T, device)
    _check_scaling(fn, scaling, L, device)
    if T == 0 or L == 0 or N == 0 or R == 0:
        return y
    order, seg_start = lora_segments(token_slots, L) if segments is None else segments
    _check_segments((order, seg_start), T, L, device)

    block_t = 16 if T <= 128 else 64
    block_n = 64 if block_t == 16 else 128
    # 8 warps for the 64x128 tile: with 4 its fp32 accumulator and y tile exceed 255 registers.
    num_warps = 4 if block_t == 16 else 8
    block_r = max(16, triton.next_power_of_2(R))
    _lora_expand_kernel[(_tile_grid(T, L, block_t), triton.cdiv(N, block_n))](
        t, lora_b, order, seg_start, scaling, y,
        N, R, L, column_offset,
        t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        F32_DOT=_use_f32_dot(lora_b.dtype), OVERWRITE=bool(overwrite),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_L=triton.next_power_of_2(L),
        num_warps=num_warps, **pdl_kwargs(y),
    )
    return y
