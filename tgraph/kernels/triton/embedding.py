"""Token embedding lookup: ``out[t] = weight[ids[t]]``.

Out-of-range ids (negative or ``>= V``) are masked, never clamped: they read nothing and produce
a zero row. That is also what a vocab-parallel shard needs, where ids outside the shard's range
must contribute zeros to the all-reduce (after the caller subtracts the shard's first id).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device as _check_device
from tgraph.kernels.triton.checks import check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["embedding"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ID_DTYPES = (torch.int32, torch.int64)

# Column tile: a whole 4096-wide bf16 row (8 KiB) per program; wider rows use several programs.
_MAX_BLOCK_H = 4096
# Elements per program to aim for; narrow rows are packed several to a program.
_TARGET_TILE = 2048


def _check_tensor(op: str, name: str, t: object, ndim: int,
                  dtypes: tuple[torch.dtype, ...]) -> None:
    # Token ids may have any stride; 2-D tables need a unit-stride last dim.
    check_tensor(op, name, t, ndim, dtypes, contiguous_last=ndim > 1)



@triton.jit(do_not_specialize=["T"])
def _embedding_kernel(
    ids_ptr,
    w_ptr,
    out_ptr,
    T,
    V,
    H,
    stride_ids,
    stride_w,
    stride_out,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
    row_ok = rows < T
    ids = tl.load(ids_ptr + rows.to(tl.int64) * stride_ids, mask=row_ok, other=0).to(tl.int64)
    # Masked, not clamped: a bad id reads nothing and yields zeros (see the module docstring).
    id_ok = row_ok & (ids >= 0) & (ids < V)
    col_ok = cols < H
    vals = tl.load(w_ptr + ids[:, None] * stride_w + cols, mask=id_ok[:, None] & col_ok, other=0.0)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols
    tl.store(out_ptrs, vals.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok)


def launch_config(h: int) -> tuple[int, int, int]:
    """Pick ``(ROWS, BLOCK_H, num_warps)`` from the hidden size alone (never from T)."""
    block_h = min(triton.next_power_of_2(h), _MAX_BLOCK_H)
    rows = max(1, min(16, _TARGET_TILE // block_h))
    num_warps = 4 if rows * block_h <= 2048 else 8
    return rows, block_h, num_warps






def embedding(ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Gather embedding rows: ``out[t] = weight[ids[t]]``.

    Args:
        ids: ``[T]`` int32/int64 token ids (any stride). Ids outside ``[0, V)`` are masked, not
            clamped: nothing is read for them and their output row is zero.
        weight: ``[V, H]`` table (fp32/fp16/bf16), last dim contiguous.
        out: ``[T, H]`` output (any float dtype; values are cast), last dim contiguous.

    Returns:
        None; the rows are written into ``out``.
    """
    op = "embedding"
    _check_tensor(op, "ids", ids, 1, _ID_DTYPES)
    _check_tensor(op, "weight", weight, 2, _FLOAT_DTYPES)
    _check_tensor(op, "out", out, 2, _FLOAT_DTYPES)
    t, (v, h) = ids.shape[0], weight.shape
    if tuple(out.shape) != (t, h):
        raise ValueError(
            f"{op}: out: expected shape {(t, h)} ([len(ids), weight.shape[1]]), "
            f"got {tuple(out.shape)}"
        )
    _check_device(op, {"ids": ids, "weight": weight, "out": out})
    if t == 0 or h == 0:
        return
    rows, block_h, num_warps = launch_config(h)
    grid = (triton.cdiv(t, rows), triton.cdiv(h, block_h))
    _embedding_kernel[grid](
        ids, weight, out, t, v, h, ids.stride(0), weight.stride(0), out.stride(0),
        ROWS=rows, BLOCK_H=block_h, num_warps=num_warps, **pdl_kwargs(out),
    )  # fmt: skip
