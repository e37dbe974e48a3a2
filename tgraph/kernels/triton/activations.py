"""Gated activations: SwiGLU over a packed ``[gate | up]`` projection.

The merged gate/up linear writes ``[M, 2N]``; this kernel reads both halves once and writes
``silu(gate) * up``. Unlike HF, which rounds ``act(gate)`` to the activation dtype before the
product, the whole expression is computed in fp32 and rounded once, so results differ from HF
by at most about one unit in the last place of the output dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device as _check_device
from tgraph.kernels.triton.checks import check_tensor as _check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["swiglu"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Column tile: small enough that a decode step (M = 1) with an intermediate size of ~14k still
# spreads over a dozen programs, large enough for full 16-byte vector accesses.
_MAX_BLOCK_N = 1024
# Elements per program to aim for; short rows are packed several to a program.
_TARGET_TILE = 2048


@triton.jit(do_not_specialize=["M"])
def _swiglu_kernel(
    gate_up_ptr,
    out_ptr,
    M,
    N,
    stride_in,
    stride_out,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    gate_ptrs = gate_up_ptr + rows64 * stride_in + cols[None, :]
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g); for g -> -inf, exp overflows to inf and the quotient is -0.
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rows64 * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def launch_config(n: int) -> tuple[int, int, int]:
    """Pick ``(ROWS, BLOCK_N, num_warps)`` from the output width alone (never from M)."""
    block_n = min(triton.next_power_of_2(n), _MAX_BLOCK_N)
    rows = max(1, min(16, _TARGET_TILE // block_n))
    return rows, block_n, 4






def swiglu(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """SwiGLU of a packed gate/up projection: ``out = silu(gate) * up``.

    Computed in fp32 and rounded once to ``out.dtype`` (HF rounds twice, after the activation
    and after the product; the difference is within one unit in the last place).

    Args:
        gate_up: ``[M, 2N]`` fp32/fp16/bf16, columns ``[0, N)`` the gate and ``[N, 2N)`` the up
            projection; last dim contiguous, rows may be strided.
        out: ``[M, N]`` output; must not overlap ``gate_up``.

    Returns:
        None; the result is written into ``out``.
    """
    op = "swiglu"
    _check_tensor(op, "gate_up", gate_up, 2)
    _check_tensor(op, "out", out, 2)
    m, two_n = gate_up.shape
    if two_n % 2:
        raise ValueError(f"{op}: gate_up: expected an even last dim [gate | up], "
                         f"got {tuple(gate_up.shape)}")
    n = two_n // 2
    if tuple(out.shape) != (m, n):
        raise ValueError(
            f"{op}: out: expected shape {(m, n)} for gate_up {tuple(gate_up.shape)}, "
            f"got {tuple(out.shape)}"
        )
    _check_device(op, {"gate_up": gate_up, "out": out})
    if m == 0 or n == 0:
        return
    rows, block_n, num_warps = launch_config(n)
    grid = (triton.cdiv(m, rows), triton.cdiv(n, block_n))
    _swiglu_kernel[grid](
        gate_up, out, m, n, gate_up.stride(0), out.stride(0),
        ROWS=rows, BLOCK_N=block_n, num_warps=num_warps, **pdl_kwargs(out),
    )  # fmt: skip
