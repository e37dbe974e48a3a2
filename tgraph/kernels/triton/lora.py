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

Split K. At decode there are a handful of tiles (5 for 16 tokens of 4 adapters), so one program
per tile would walk the whole K (2048..8192) alone: a serial chain of loads on an idle GPU. The
shrink therefore also splits K over a second grid axis: program ``(tile, s)`` reduces the ``s``-th
chunk of K and writes its fp32 partial sums to ``out[s]`` of a ``[splits, T, R]`` workspace (no
atomics, so no zeroing and bit-identical results run to run). The expand sums the partials in a
fixed order (split blocks in sequence, a ``tl.sum`` tree inside a block) when it loads them, so the
pair stays two launches. :func:`lora_shrink_splits` picks ``splits`` from shapes and the SM count
only; a ``[T, R]`` shrink output means one split (the whole K per program).

The segments depend only on ``token_slots``: compute them once per batch with
:func:`lora_segments` and pass them to every shrink/expand of the step. :func:`lora_shrink_expand`
launches the pair; it is what the graph's ``lora_delta`` runs.

Tokens whose slot is outside ``[0, L)`` belong to no segment and are skipped (their rows of the
shrink output and of ``y`` are left unwritten); checking the values would need a host sync.

NOTE (PDL): like the GEMV with its weights, both kernels read what no kernel of a step writes
before waiting on the previous kernel: ``seg_start``, ``order`` and the adapter stacks (the shrink
its first A tile, the expand its B tile), so those loads overlap the previous kernel's tail. The
engine passes segments as inputs and :func:`lora_segments` computes them with torch ops (never
PDL-launched), so the previous kernel cannot be writing them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["lora_segments", "lora_shrink", "lora_shrink_splits", "lora_expand", "lora_shrink_expand"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
# SM count assumed when not running on CUDA (H100 SXM / H200 have 132 SMs).
_DEFAULT_SM_COUNT = 132
# Split-K aims at this many shrink programs per SM (as the GEMV does): a few resident programs per
# SM keep enough loads in flight to cover HBM latency.
_PROGRAMS_PER_SM = 2
_MAX_SPLITS = 32
# Bound on the partials one expand program sums (splits * BLOCK_T * BLOCK_R fp32 elements): every
# expand program over N re-reads them from L2, so more splits trade shrink latency for expand reads.
_MAX_PARTIALS = 16384
# Partials the expand loads at once ([SPLIT_BLOCK, BLOCK_T, BLOCK_R] fp32, 64 registers a thread
# at 4 warps): enough loads in flight without spilling.
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
def _lora_shrink_kernel(
    x_ptr, a_ptr, order_ptr, seg_ptr, scale_ptr, out_ptr,
    K, R, L, k_per_split,
    stride_xt, stride_al, stride_ar, stride_os, stride_ot,
    HAS_SCALE: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    # Before the PDL wait: segments, token order and adapter weights (see the module NOTE).
    slot, row0, row_end = _tile_of_program(seg_ptr, pid, L, BLOCK_T, BLOCK_L)
    offs_t = row0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < row_end
    # A program without a tile has row_end 0, so mask_t is all false.
    tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    a_rows = a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
    # No A rows for slot 0 or no tile (a bound, not a scalar & block mask: the interpreter
    # rejects those).
    mask_a = offs_r < tl.where((slot > 0) & (slot < L), R, 0)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    av = tl.load(a_rows + offs_k[None, :], mask=mask_a[:, None] & (offs_k < k_end)[None, :], other=0.0)
    pdl_wait(PDL)
    if slot < L:
        out_ptrs = out_ptr + pid_s * stride_os + tok[:, None] * stride_ot + offs_r[None, :]
        mask_out = mask_t[:, None] & mask_r[None, :]
        if slot == 0:
            # No adapter: zeros, no reads.
            tl.store(out_ptrs, tl.zeros((BLOCK_T, BLOCK_R), dtype=out_ptr.dtype.element_ty), mask=mask_out)
        else:
            x_rows = x_ptr + tok[:, None] * stride_xt
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            # A split past the end of K runs no iteration and writes zeros.
            for k0 in range(k_start, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < k_end
                xv = tl.load(x_rows + offs_k[None, :], mask=mask_t[:, None] & mask_k[None, :], other=0.0)
                if F32_DOT:
                    acc += tl.dot(xv.to(tl.float32), tl.trans(av.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(xv, tl.trans(av))
                # Next A tile (one ahead: the first came before the wait).
                offs_k += BLOCK_K
                av = tl.load(a_rows + offs_k[None, :], mask=mask_r[:, None] & (offs_k < k_end)[None, :],
                             other=0.0)
            if HAS_SCALE:
                acc *= tl.load(scale_ptr + slot).to(tl.float32)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _lora_expand_kernel(
    t_ptr, b_ptr, order_ptr, seg_ptr, scale_ptr, y_ptr,
    N, R, L, col_off, splits,
    stride_ts, stride_tt, stride_bl, stride_bn, stride_yt,
    F32_DOT: tl.constexpr, OVERWRITE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Before the PDL wait: segments, token order and this program's B tile (see the module NOTE).
    slot, row0, row_end = _tile_of_program(seg_ptr, pid, L, BLOCK_T, BLOCK_L)
    offs_t = row0 + tl.arange(0, BLOCK_T)
    mask_t = offs_t < row_end
    tok = tl.load(order_ptr + offs_t, mask=mask_t, other=0).to(tl.int64)  # all false: no tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    adapted = (slot > 0) & (slot < L)
    mask_b = offs_n < tl.where(adapted, N, 0)  # no B rows for slot 0 or no tile
    bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :],
                 mask=mask_b[:, None] & mask_r[None, :], other=0.0)
    pdl_wait(PDL)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + col_off + offs_n[None, :]
    mask_y = mask_t[:, None] & mask_n[None, :]
    if OVERWRITE & (slot == 0):
        # No adapter: the delta of these rows is zero.
        tl.store(y_ptrs, tl.zeros((BLOCK_T, BLOCK_N), dtype=y_ptr.dtype.element_ty), mask=mask_y)
    # Without OVERWRITE, slot 0 tokens keep y as it is: nothing to do.
    if adapted:
        # t = sum of the shrink's partials over its K splits, in a fixed order.
        offs_s = tl.arange(0, SPLIT_BLOCK)
        t_tok = t_ptr + tok[None, :, None] * stride_tt + offs_r[None, None, :]
        mask_tr = mask_t[None, :, None] & mask_r[None, None, :]
        tv = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for s0 in range(0, splits, SPLIT_BLOCK):
            split = s0 + offs_s
            part = tl.load(t_tok + split[:, None, None] * stride_ts,
                           mask=(split < splits)[:, None, None] & mask_tr, other=0.0)
            tv += tl.sum(part.to(tl.float32), axis=0)
        if F32_DOT:
            acc = tl.dot(tv, tl.trans(bv.to(tl.float32)), input_precision="ieee")
        else:
            # NOTE: the fp32 shrink output is rounded to the adapter dtype for the tensor-core dot
            # (as punica/vLLM do); the rounding is within the dtype's tolerance.
            acc = tl.dot(tv.to(bv.dtype), tl.trans(bv))
        acc *= tl.load(scale_ptr + slot).to(tl.float32)
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


# ---- argument checks -----------------------------------------------------------------------------
def _check_tensor(fn: str, name: str, t: torch.Tensor, dims: int | tuple[int, ...],
                  device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = (dims,) if isinstance(dims, int) else dims
    if t.dim() not in allowed:
        want = " or ".join(f"{d}-D" for d in allowed)
        raise ValueError(f"{fn}: {name} must be {want}, got shape {list(t.shape)}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {name} must be float16, bfloat16 or float32, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{fn}: {name} is on {t.device}, expected {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} must have a contiguous last dim, got strides {t.stride()}")


def _check_stack(fn: str, lhs_name: str, lhs: torch.Tensor, stack_name: str, stack: torch.Tensor,
                 layout: str) -> tuple[int, int, int]:
    """Check ``lhs [..., T, D]`` against ``stack [L, X, D]`` (``layout`` names the dims).

    Returns:
        ``(L, X, D)``.
    """
    _check_tensor(fn, stack_name, stack, 3, lhs.device)
    L, X, D = stack.shape
    if D != lhs.shape[-1]:
        raise ValueError(f"{fn}: {stack_name} must be {layout} with last dim {lhs.shape[-1]} to match "
                         f"{lhs_name} {list(lhs.shape)}, got {list(stack.shape)}")
    return L, X, D


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


def _check_partials(fn: str, name: str, t: torch.Tensor) -> None:
    if t.dim() == 3 and t.dtype != torch.float32:
        raise TypeError(f"{fn}: a 3-D {name} holds split-K partial sums and must be float32, got {t.dtype}")
    if t.dim() == 3 and t.shape[0] < 1:
        raise ValueError(f"{fn}: a 3-D {name} [splits, T, R] needs splits >= 1, got {list(t.shape)}")


# ---- launch configuration ------------------------------------------------------------------------
def _use_f32_dot(dtype: torch.dtype) -> bool:
    """Whether ``tl.dot`` must run on fp32 operands (``input_precision="ieee"``).

    fp32 adapters must not be rounded to TF32. NOTE: Triton's interpreter (3.9) multiplies the raw
    uint16 bits of bf16 operands in ``tl.dot``; upcasting there matches a bf16 MMA with fp32
    accumulation (bf16 products are exact in fp32).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


def _block_t(T: int) -> int:
    return 16 if T <= 128 else 64


def _shrink_block_k(T: int, K: int) -> int:
    return max(16, min(128 if _block_t(T) == 16 else 64, triton.next_power_of_2(K)))


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _tile_grid(T: int, L: int, block_t: int) -> int:
    # sum_s ceil(c_s / B) <= sum_s (floor(c_s / B) + 1) <= floor(T / B) + (non-empty slots).
    return T // block_t + min(L, T)


def _sm_count(device: torch.device | str | None) -> int:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return _DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def lora_shrink_splits(num_tokens: int, in_features: int, rank: int, num_slots: int,
                       device: torch.device | str | None = None) -> int:
    """How many K chunks the shrink of these shapes should run (the ``splits`` of its workspace).

    Depends on shapes and the SM count only (132 when ``device`` is not CUDA), so a captured
    decode graph keeps it. The shrink grid (``tiles * splits``) aims at 2 programs per SM,
    bounded by the number of ``BLOCK_K`` blocks of K (every split gets the same whole number of
    blocks but the last), by 32, and by the partials an expand program sums (``splits * BLOCK_T *
    BLOCK_R <= 16384``). E.g. 16 tokens, 5 slots (6 tiles): K 2048 gives 16 splits (rank 16..64),
    K 8192 gives 32 (rank <= 32) or 16 (rank 48..64): 96..192 programs.

    Args:
        num_tokens: ``T``.
        in_features: ``K``.
        rank: ``R``, the padded rank of the stack.
        num_slots: ``L``, stacked slots (slot 0 included).
        device: where the kernels run.

    Returns:
        ``splits >= 1`` (1 when there is nothing to split).
    """
    for name, v in (("num_tokens", num_tokens), ("in_features", in_features), ("rank", rank),
                    ("num_slots", num_slots)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"lora_shrink_splits: {name} must be a non-negative int, got {v!r}")
    if min(num_tokens, in_features, rank, num_slots) == 0:
        return 1
    block_t = _block_t(num_tokens)
    k_blocks = triton.cdiv(in_features, _shrink_block_k(num_tokens, in_features))
    tiles = _tile_grid(num_tokens, num_slots, block_t)
    partial_cap = max(1, _MAX_PARTIALS // (block_t * _block_r(rank)))
    want = min(triton.cdiv(_PROGRAMS_PER_SM * _sm_count(device), tiles), k_blocks, _MAX_SPLITS, partial_cap)
    # Even distribution: no split gets a short or empty range of K blocks.
    per_split = triton.cdiv(k_blocks, want)
    return triton.cdiv(k_blocks, per_split)


def _split_block(splits: int, block_t: int, block_r: int) -> int:
    return min(triton.next_power_of_2(splits), max(1, _SPLIT_LOAD_ELEMS // (block_t * block_r)))


# ---- launches ------------------------------------------------------------------------------------
def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    out: torch.Tensor,
    scaling: torch.Tensor | None = None,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[t] = scaling[s] * x[t] @ lora_a[s].T`` with ``s = token_slots[t]``; zeros for slot 0.

    With a 3-D ``out [splits, T, R]`` K is split in ``splits`` chunks of whole ``BLOCK_K`` blocks
    (``ceil(ceil(K / BLOCK_K) / splits)`` blocks each, a chunk past K is all zeros) and ``out[s]``
    gets chunk ``s``'s partial product: the result is ``out.sum(0)``, which :func:`lora_expand`
    computes as it loads it. :func:`lora_shrink_splits` gives the split count for the shapes.

    Args:
        x: ``[T, K]`` activations (fp16/bf16/fp32); rows may be strided.
        lora_a: ``[L, R, K]`` stacked adapters, same dtype as ``x``; ``R`` is the padded rank.
        token_slots: int32 ``[T]`` adapter slot per token (0: no adapter).
        out: ``[T, R]`` (fp32 or ``x``'s dtype), or fp32 ``[splits, T, R]`` partial sums; every
            row of a token with a valid slot is written (in every split).
        scaling: optional fp32 ``[L]`` applied here (usually it is applied in :func:`lora_expand`).
        segments: ``lora_segments(token_slots, L)``, computed here when omitted.

    Returns:
        ``out``.
    """
    fn = "lora_shrink"
    _check_tensor(fn, "x", x, 2, None)
    T, K = x.shape
    device = x.device
    L, R, _ = _check_stack(fn, "x", x, "lora_a", lora_a, "[L, R, K]")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    _check_tensor(fn, "out", out, (2, 3), device)
    _check_partials(fn, "out", out)
    if tuple(out.shape[-2:]) != (T, R):
        raise ValueError(f"{fn}: out must have shape [{T}, {R}] or [splits, {T}, {R}], got {list(out.shape)}")
    if out.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{fn}: out must be float32 or {x.dtype}, got {out.dtype}")
    _check_slots(token_slots, T, device)
    if scaling is not None:
        _check_scaling(fn, scaling, L, device)
    if T == 0 or L == 0 or R == 0:
        return out
    order, seg_start = lora_segments(token_slots, L) if segments is None else segments
    _check_segments((order, seg_start), T, L, device)

    splits, stride_os = (out.shape[0], out.stride(0)) if out.dim() == 3 else (1, 0)
    block_t = _block_t(T)
    block_k = _shrink_block_k(T, K)
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), splits) * block_k
    _lora_shrink_kernel[(_tile_grid(T, L, block_t), splits)](
        x, lora_a, order, seg_start, scaling if scaling is not None else out, out,
        K, R, L, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), stride_os, out.stride(-2),
        HAS_SCALE=scaling is not None, F32_DOT=_use_f32_dot(x.dtype),
        BLOCK_T=block_t, BLOCK_R=_block_r(R), BLOCK_K=block_k, BLOCK_L=triton.next_power_of_2(L),
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
        t: ``[T, R]`` shrink output (fp32 or the adapter dtype), or the fp32 ``[splits, T, R]``
            partial sums of a split shrink, summed here over the splits in a fixed order.
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
    _check_tensor(fn, "t", t, (2, 3), None)
    _check_partials(fn, "t", t)
    T, R = t.shape[-2:]
    device = t.device
    L, N, _ = _check_stack(fn, "t", t, "lora_b", lora_b, "[L, N, R]")
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

    splits, stride_ts = (t.shape[0], t.stride(0)) if t.dim() == 3 else (1, 0)
    block_t = _block_t(T)
    block_n = 64 if block_t == 16 else 128
    # 8 warps for the 64x128 tile: with 4 its fp32 accumulator and y tile exceed 255 registers.
    num_warps = 4 if block_t == 16 else 8
    block_r = _block_r(R)
    _lora_expand_kernel[(_tile_grid(T, L, block_t), triton.cdiv(N, block_n))](
        t, lora_b, order, seg_start, scaling, y,
        N, R, L, column_offset, splits,
        stride_ts, t.stride(-2), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        F32_DOT=_use_f32_dot(lora_b.dtype), OVERWRITE=bool(overwrite),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_L=triton.next_power_of_2(L),
        SPLIT_BLOCK=_split_block(splits, block_t, block_r),
        num_warps=num_warps, **pdl_kwargs(y),
    )
    return y


def lora_shrink_expand(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    *,
    segments: tuple[torch.Tensor, torch.Tensor] | None = None,
    column_offset: int = 0,
    overwrite: bool = False,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LoRA delta of one linear in two launches: ``y[:, off:off+N] (+)= scaling[s] * (x @
    lora_a[s].T) @ lora_b[s].T`` with ``s = token_slots[t]`` (slot 0: no delta).

    The shrink splits K (:func:`lora_shrink_splits`) into an fp32 ``[splits, T, R]`` workspace
    that the expand reduces; the grids depend on shapes only, so the pair is CUDA-graph capturable.

    Args:
        x: ``[T, K]`` activations (fp16/bf16/fp32); rows may be strided.
        lora_a: ``[L, R, K]`` stacked A, ``x``'s dtype.
        lora_b: ``[L, N, R]`` stacked B.
        scaling: fp32 ``[L]`` per-slot scale.
        token_slots: int32/int64 ``[T]`` adapter slot per token.
        y: ``[T, N_total]`` output, ``N_total >= column_offset + N``.
        segments: ``lora_segments(token_slots, L)`` when the caller computed them once for the
            step; computed here otherwise.
        column_offset: first column of ``y`` written.
        overwrite: write the delta into ``y`` (slot-0 rows: zeros) instead of adding it.
        workspace: fp32 ``[splits, T, R]`` for the partial sums, any ``splits >= 1`` (pass one
            allocated outside a CUDA-graph capture, or force a split count); allocated here with
            :func:`lora_shrink_splits` splits when omitted.

    Returns:
        ``y``.
    """
    fn = "lora_shrink_expand"
    _check_tensor(fn, "x", x, 2, None)
    L, R, _ = _check_stack(fn, "x", x, "lora_a", lora_a, "[L, R, K]")
    _check_tensor(fn, "lora_b", lora_b, 3, x.device)
    if tuple(lora_b.shape[::2]) != (L, R):
        raise ValueError(f"{fn}: lora_b must be [{L}, N, {R}] to match lora_a {list(lora_a.shape)}, "
                         f"got {list(lora_b.shape)}")
    if lora_b.dtype != lora_a.dtype:
        raise TypeError(f"{fn}: lora_b dtype {lora_b.dtype} must match lora_a dtype {lora_a.dtype}")
    T = x.shape[0]
    if segments is None:
        _check_slots(token_slots, T, x.device)
        segments = lora_segments(token_slots, L)  # one sort serves both launches
    if workspace is None:
        splits = lora_shrink_splits(T, x.shape[1], R, L, x.device)
        workspace = torch.empty(splits, T, R, dtype=torch.float32, device=x.device)
    elif (not isinstance(workspace, torch.Tensor) or workspace.dim() != 3
          or tuple(workspace.shape[1:]) != (T, R) or workspace.shape[0] < 1):
        raise ValueError(f"{fn}: workspace must be a float32 tensor [splits >= 1, {T}, {R}], got "
                         f"{getattr(workspace, 'shape', type(workspace).__name__)}")
    lora_shrink(x, lora_a, token_slots, workspace, segments=segments)
    return lora_expand(workspace, lora_b, token_slots, y, scaling, column_offset=column_offset,
                       segments=segments, overwrite=overwrite)
