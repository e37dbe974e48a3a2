"""RMSNorm and fused residual-add + RMSNorm.

Both follow HF ``LlamaRMSNorm`` rounding exactly: the row is normalised in fp32, cast to the
activation dtype, and only then multiplied by the weight::

    out = weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)

One program normalises ``ROWS`` whole rows held in registers, so the data is read once and written
once. Rows longer than ``_MAX_FUSED_N`` (beyond every current LLM hidden size) fall back to a
chunked loop that reads the row twice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device as _check_device
from tgraph.kernels.triton.checks import check_tensor as _check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["add_parts_rms_norm", "add_rms_norm", "rms_norm"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Longest row normalised from registers (16 warps hold 16384 fp32 values in 32 registers/thread).
_MAX_FUSED_N = 16384
# Chunk width of the two-pass fallback for longer rows.
_CHUNK_N = 4096
# Elements per program to aim for when rows are short (q/k norm over head_dim), so that each
# program still moves enough bytes to hide memory latency.
_TARGET_TILE = 2048


@triton.jit
def _load_x(x_ptr, x_rows, rows64, cols, mask, stride_x, dtype: tl.constexpr, PARTS: tl.constexpr):
    """The rows of ``x`` in fp32; with ``PARTS``, each row the in-order fp32 sum of its rows
    ``row * PARTS + j`` rounded once to ``dtype``, as a combine kernel would have stored it."""
    if PARTS == 0:
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.zeros(mask.shape, dtype=tl.float32)
        for j in tl.static_range(PARTS):
            x += tl.load(x_ptr + (rows64 * PARTS + j) * stride_x + cols, mask=mask, other=0.0)
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    M,
    N,
    eps,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SINGLE_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = (rows < M)[:, None]
    # int64: row * stride overflows int32 for large activations.
    rows64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    x_rows = x_ptr + rows64 * stride_x
    res_rows = res_ptr + rows64 * stride_res
    out_rows = out_ptr + rows64 * stride_out
    res_out_rows = res_out_ptr + rows64 * stride_res_out
    # HF casts the normalised value back to the dtype of the tensor being normalised: the input,
    # or the residual stream when the residual add is fused.
    if HAS_RESIDUAL:
        norm_dtype = res_out_ptr.dtype.element_ty
    else:
        norm_dtype = x_ptr.dtype.element_ty

    if SINGLE_PASS:
        mask = row_mask & (cols < N)
        x = _load_x(x_ptr, x_rows, rows64, cols, mask, stride_x, norm_dtype, PARTS)
        if HAS_RESIDUAL:
            r = tl.load(res_rows + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(norm_dtype)
            tl.store(res_out_rows + cols, s, mask=mask)
            # Normalise the stored (rounded) sum, as the unfused graph would.
            x = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = (x * rstd).to(norm_dtype).to(tl.float32) * w
        tl.store(out_rows + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask & (c < N)
            x = _load_x(x_ptr, x_rows, rows64, c, mask, stride_x, norm_dtype, PARTS)
            if HAS_RESIDUAL:
                r = tl.load(res_rows + c, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(norm_dtype)
                tl.store(res_out_rows + c, s, mask=mask)
                x = s.to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=1) / N + eps)[:, None]
        if HAS_RESIDUAL:
            # The second pass re-reads residual_out (residual may alias it, so the sum can't be
            # recomputed); the barrier makes this program's stores visible to all its threads.
            tl.debug_barrier()
            src_rows = res_out_rows
        else:
            src_rows = x_rows
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask & (c < N)
            x = tl.load(src_rows + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < N, other=0.0).to(tl.float32)
            y = (x * rstd).to(norm_dtype).to(tl.float32) * w
            tl.store(out_rows + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_config(n: int) -> tuple[int, int, int, bool]:
    """Pick ``(ROWS, BLOCK_N, num_warps, single_pass)`` from the row length alone.

    Never from the row count, so one compiled kernel serves every number of tokens.
    """
    if n > _MAX_FUSED_N:
        return 1, _CHUNK_N, 8, False
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(16, _TARGET_TILE // block_n))
    tile = rows * block_n
    # About 16 elements per thread: two 16-byte vectors of bf16, enough loads in flight per warp.
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return rows, block_n, num_warps, True






def _check_rows(op: str, x: torch.Tensor, weight: torch.Tensor, **rows: torch.Tensor) -> None:
    _check_tensor(op, "x", x, 2)
    _check_tensor(op, "weight", weight, 1)
    for name, t in rows.items():
        _check_tensor(op, name, t, 2)
        if t.shape != x.shape:
            raise ValueError(f"{op}: {name}: expected shape {tuple(x.shape)} (as x), "
                             f"got {tuple(t.shape)}")
    if weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"{op}: weight: expected shape ({x.shape[1]},) to match x's last dim, "
            f"got {tuple(weight.shape)}"
        )
    _check_device(op, {"x": x, "weight": weight, **rows})


def _launch(x, residual, weight, eps, out, residual_out, has_residual: bool,
            parts: int = 0) -> None:
    m, n = out.shape
    if m == 0 or n == 0:
        return
    rows, block_n, num_warps, single_pass = launch_config(n)
    grid = (triton.cdiv(m, rows),)
    _rms_norm_kernel[grid](
        x, residual, weight, out, residual_out,
        m, n, float(eps),
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=has_residual, PARTS=parts, ROWS=rows, BLOCK_N=block_n, SINGLE_PASS=single_pass,
        num_warps=num_warps, **pdl_kwargs(out),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """RMSNorm over the last dim, rounded exactly like HF ``LlamaRMSNorm``.

    ``out = weight * (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype)``, where the
    final product is computed in fp32 and stored once in ``out.dtype``.

    Args:
        x: ``[M, N]`` activations (fp32/fp16/bf16), last dim contiguous; rows may be strided.
        weight: ``[N]`` scale.
        eps: added to the mean square before the reciprocal square root.
        out: ``[M, N]`` output; may alias ``x``.

    Returns:
        None; the result is written into ``out``.
    """
    _check_rows("rms_norm", x, weight, out=out)
    _launch(x, x, weight, eps, out, out, has_residual=False)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    """Fused residual add and RMSNorm: the pre-norm transformer block boundary.

    ``residual_out = x + residual`` (added in fp32, stored once in ``residual_out.dtype``), then
    ``out = rms_norm(residual_out)`` computed from the stored, rounded ``residual_out`` and cast
    through ``residual_out.dtype`` before the weight, as the unfused HF graph does.

    Args:
        x: ``[M, N]`` branch output (fp32/fp16/bf16), last dim contiguous.
        residual: ``[M, N]`` residual stream.
        weight: ``[N]`` scale.
        eps: added to the mean square before the reciprocal square root.
        out: ``[M, N]`` normalised output; may alias ``x`` but not ``residual_out``.
        residual_out: ``[M, N]`` new residual stream; may alias ``residual`` (in-place update)
            or ``x``.

    Returns:
        None; results are written into ``out`` and ``residual_out``.
    """
    _check_rows("add_rms_norm", x, weight, residual=residual, out=out, residual_out=residual_out)
    if out.data_ptr() == residual_out.data_ptr():
        raise ValueError("add_rms_norm: out must not alias residual_out (both are results)")
    _launch(x, residual, weight, eps, out, residual_out, has_residual=True)


def add_parts_rms_norm(parts: torch.Tensor, num_parts: int, residual: torch.Tensor,
                       weight: torch.Tensor, eps: float, out: torch.Tensor,
                       residual_out: torch.Tensor) -> None:
    """:func:`add_rms_norm` of ``x[t] = sum_j parts[t * num_parts + j]``: the fp32 parts of a
    row (a token's weighted expert outputs) are added in order and rounded once to the residual's
    dtype, then added to the residual as :func:`add_rms_norm` adds ``x``. Bit for bit the
    combine-then-add it replaces.

    Args:
        parts: fp32 ``[M * num_parts, N]``, last dim contiguous.
        num_parts: parts per row, at least 1.
        residual, weight, eps, out, residual_out: as for :func:`add_rms_norm`.
    """
    _check_tensor("add_parts_rms_norm", "parts", parts, 2)
    _check_rows("add_parts_rms_norm", residual, weight, out=out, residual_out=residual_out)
    m, n = residual.shape
    if parts.dtype != torch.float32 or num_parts < 1 or tuple(parts.shape) != (m * num_parts, n):
        raise ValueError(f"add_parts_rms_norm: expected fp32 parts [{m} * {num_parts}, {n}] for "
                         f"the residual {list(residual.shape)}, got {parts.dtype} "
                         f"{list(parts.shape)}")
    if out.data_ptr() == residual_out.data_ptr():
        raise ValueError("add_parts_rms_norm: out must not alias residual_out (both are results)")
    _check_device("add_parts_rms_norm", {"parts": parts, "residual": residual})
    _launch(parts, residual, weight, eps, out, residual_out, has_residual=True, parts=num_parts)
