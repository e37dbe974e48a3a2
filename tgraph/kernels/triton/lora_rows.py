"""The per-token multi-LoRA shrink kernel for decode batches, with the producer of ``x`` (RMSNorm,
add + RMSNorm) folded in: :func:`lora_prologue_concat`, and the plain shrink that
:func:`~tgraph.kernels.triton.lora_tile.lora_shrink_concat` sends here (:func:`launch_rows`).
Layout: :mod:`tgraph.kernels.triton.lora`.

Per-token programs at decode. For a handful of tokens (``T <= 64``: decode batches) this kernel
runs instead of the slot-tile one, with no grouping, no split and no reduction: program ``(t, c)``
computes rank chunk ``c`` of token ``t``'s shrink over the whole of K with CUDA-core FMAs.
Everything it multiplies by is known before the PDL wait (the token's slot is a step input, A is
adapter weight), so its A chunk streams in while the kernel before drains; after the wait it reads
one row of ``x`` (in L2), reduces, and writes. The slot-tile kernel's split-K reduction costs
several dependent L2 round trips after the wait (partials, ticket, sum): several microseconds per
launch at decode (docs/performance.md).

Two adapter sets (:class:`~tgraph.kernels.triton.lora_common.AdapterSet`): the second set's rank
chunks run as more chunks of each token; all programs of a token share the ``x`` copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.lora_common import (
    ZERO_CHUNK,
    AdapterSet,
    check_layout,
    check_tensor,
    select_adapter_set,
)
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.tuning import LoraTuning

__all__ = ["PROLOGUES", "launch_rows", "lora_prologue_concat", "prologue_fits", "rows_overlap"]

_DEFAULT_TUNING = LoraTuning()
# A chunk of the per-token kernel: BLOCK_R x BLOCK_K elements of A, held in registers.
_ROWS_CHUNK_ELEMS = 8192


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
        a_ptr, scale_ptr, R, L, lead, col0, width, stride_al, stride_ar = select_adapter_set(
            second, K, a_ptr, scale_ptr, R, L, lead, width, stride_al, stride_ar,
            a2_ptr, scale2_ptr, R2, L2, lead2, width2, stride_a2l, stride_a2r)
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
    check_tensor(fn, "x", x, 2, None)
    device = x.device
    check_tensor(fn, "lora_a", lora_a, 3, device)
    L, R, K = lora_a.shape
    T = x.shape[0]
    if x.shape[1] != K:
        raise ValueError(f"{fn}: x must be [T, {K}] to match lora_a {list(lora_a.shape)}, got "
                         f"{list(x.shape)}")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"{fn}: lora_a dtype {lora_a.dtype} must match x dtype {x.dtype}")
    check_tensor(fn, "out", out, 2, device)
    need = K + lead + max(L - 1, 0) * R
    if out.dtype != x.dtype or out.shape[0] != T or out.shape[1] < need:
        raise ValueError(f"{fn}: out must be {x.dtype} [{T}, >= {need}], got {out.dtype} "
                         f"{list(out.shape)}")
    width, _ = check_layout(fn, x, lora_a, scaling, token_slots, out, lead, width, second)
    if not prologue_fits(prologue, T, K, tuning):
        raise ValueError(f"{fn}: {T} tokens of {K} features is not a decode batch this kernel "
                         f"takes (at most {tuning.rows_max_tokens} tokens of at most "
                         f"{_ROWS_CHUNK_ELEMS} features); use the producer and lora_shrink_concat")
    check_tensor(fn, "norm_weight", norm_weight, 1, device)
    if tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"{fn}: norm_weight must be {x.dtype} [{K}], got "
                         f"{norm_weight.dtype} {list(norm_weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{fn}: eps must be a non-negative number, got {eps!r}")
    if prologue == "add_rms_norm":
        for name, t in (("residual", residual), ("summed", summed)):
            check_tensor(fn, name, t, 2, device)
            if tuple(t.shape) != (T, K) or t.dtype != x.dtype:
                raise ValueError(f"{fn}: {name} must be {x.dtype} [{T}, {K}], got {t.dtype} "
                                 f"{list(t.shape)}")
    if T == 0 or L == 0:
        return out
    if prologue == "add_rms_norm" and (rows_overlap(summed, x) or rows_overlap(summed, residual)):
        raise ValueError(f"{fn}: summed must not overlap x or residual (every program reads "
                         "the whole rows while the others write their slices of the sum)")
    launch_rows(x, lora_a, scaling, token_slots, out, lead, width, second, PROLOGUES[prologue],
                residual, norm_weight, summed, eps or 0.0)
    return out


def launch_rows(x: torch.Tensor, lora_a: torch.Tensor, scaling: torch.Tensor,
                token_slots: torch.Tensor, out: torch.Tensor, lead: int, width: int,
                second: AdapterSet | None = None, prologue: int = PROLOGUE_NONE,
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                summed: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """The per-token kernel on checked arguments (see the module docstring); ``x`` is the
    prologue's input.

    Args: as :func:`lora_prologue_concat` (the arguments ``lora_shrink_concat`` has checked),
    ``width`` the first set's LoRA columns and ``prologue`` a value of :data:`PROLOGUES` or
    ``PROLOGUE_NONE`` (``x`` copied as it is).
    """
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
        BLOCK_L=triton.next_power_of_2(max(L - 1, L2 - 1, 1)), BLOCK_C=ZERO_CHUNK,
        num_warps=8 if block_r * block_k >= 4096 else 4, **pdl_kwargs(x),
    )
