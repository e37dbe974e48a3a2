"""Prefill on FP8 weights with FP8 tensor cores: ``out = x @ dequant(w).T (+ bias) (+ residual)``
where ``x`` is quantized to e4m3 per token (per 128-column group for block-scaled weights) as it
enters.

A prefill GEMM on dequantized weights runs at bf16 tensor-core speed; on Hopper the e4m3 MMA has
twice that rate, so the activations are quantized too (:func:`quantize_rows_fp8`: one program
per row, absmax scales, round to nearest even on the e4m3 grid) and the GEMM multiplies codes by
codes, applying the two scales per output (channel or tensor scales: once, after the K loop;
cuBLAS's row-wise scaled GEMM, ``torch._scaled_mm``, where it runs) or per K tile (128 x 128
block scales: each tile's partial product is scaled as it is added). This
adds e4m3's rounding of the activations (3 mantissa bits, about 3% per element, random in sign),
which the quantized model's tests bound against its dequantized twin; decode (small M) keeps
bf16 activations and the exact GEMV of :mod:`tgraph.kernels.triton.gemv`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device, check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.kernels.triton.quant_linear import check_quantized_linear
from tgraph.quant import QuantizedWeight
from tgraph.tuning import QuantGemmTuning

__all__ = ["fp8_linear", "fp8_linear_supported", "quantize_rows_fp8"]

FP8_MAX = 448.0
_DEFAULT_TUNING = QuantGemmTuning()


@triton.jit
def _round_to_e4m3(v):
    """``v`` (|v| <= 448) rounded to nearest even on the e4m3 grid, still fp32: the step is
    ``2**(e - 3)`` for ``2**e <= |v|`` (``2**-9`` below ``2**-6``), the rounding the 1.5 * 2**23
    add-and-subtract makes (exact fp32 arithmetic, the same on a GPU and the interpreter)."""
    a = tl.abs(v)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # exactly 1 / step
    r = ((a * inv_step + 12582912.0) - 12582912.0) * step
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row ``m`` of ``x`` in groups of ``GROUP`` columns (``BLOCK`` per step; ``GROUP`` is a
    multiple of ``BLOCK`` or covers K): ``s = max|x| / 448`` per group, ``q = e4m3(x / s)``."""
    m = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pdl_wait(PDL)
    start = g * GROUP
    end = tl.minimum(start + GROUP, K)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top / 448.0, 1.0)
    tl.store(s_ptr + m * stride_sm + g, scale)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < end, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(x / scale, -448.0), 448.0))
        tl.store(q_ptr + m * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < end)


def quantize_rows_fp8(x: torch.Tensor, group: int | None = None,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as e4m3 codes ``[M, K]`` and fp32 scales ``[M, ceil(K / group)]`` (one per
    row when ``group`` is None), ``x ~ q * s`` with ``s = max|x| / 448`` per group.

    Args:
        x: fp32/fp16/bf16 activations, last dim contiguous.
        group: columns per scale, a multiple of 16 (None: the whole row).
        out: optional preallocated ``(codes, scales)``.
    """
    op = "quantize_rows_fp8"
    check_tensor(op, "x", x, 2)
    m, k = x.shape
    group = k if group is None or group >= k else group
    if group % 16 and group != k:
        raise ValueError(f"{op}: group must be a multiple of 16, got {group}")
    groups = triton.cdiv(k, group)
    if out is None:
        out = (torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device),
               torch.empty(m, groups, dtype=torch.float32, device=x.device))
    q, s = out
    if q.shape != (m, k) or q.dtype != torch.float8_e4m3fn or s.shape != (m, groups) \
            or s.dtype != torch.float32:
        raise ValueError(f"{op}: out must be (float8_e4m3fn [{m}, {k}], float32 [{m}, {groups}])"
                         f", got ({q.dtype} {list(q.shape)}, {s.dtype} {list(s.shape)})")
    check_device(op, {"x": x, "codes": q, "scales": s})
    if m == 0 or k == 0:
        return q, s
    # A whole row (up to 16K columns) in one step: its second pass reads it again from L1.
    block = min(16384, group & -group if group != k else triton.next_power_of_2(k))
    _quantize_rows_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), s.stride(0),
                                       GROUP=group, BLOCK=block,
                                       num_warps=8 if block >= 4096 else 4, **pdl_kwargs(x))
    return q, s


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, res_ptr, out_ptr,
                     M, N, K, stride_am, stride_as, stride_bn, stride_bs, stride_rm, stride_om,
                     A_GROUP: tl.constexpr, B_ROWS: tl.constexpr, B_COLS: tl.constexpr,
                     PER_TILE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """``out[m, n] = sum_k a[m, k] sa[m, k / A_GROUP] * b[n, k] sb[n / B_ROWS, k / B_COLS]``.

    ``PER_TILE``: scales change along K, each ``BLOCK_K`` tile lying in one group of both; else
    both are constant along K and applied once to the accumulator. Programs walk output tiles
    in groups of ``GROUP_M`` row blocks, so neighbours share weight tiles in L2.
    """
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    sb_rows = bs_ptr + (offs_n // B_ROWS).to(tl.int64) * stride_bs
    sa_rows = as_ptr + offs_m.to(tl.int64) * stride_as
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if PER_TILE:
            part = tl.dot(a, tl.trans(b))
            sa = tl.load(sa_rows + k0 // A_GROUP, mask=mask_m, other=0.0)
            sb = tl.load(sb_rows + k0 // B_COLS, mask=mask_n, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not PER_TILE:
        sa = tl.load(sa_rows, mask=mask_m, other=0.0)
        sb = tl.load(sb_rows, mask=mask_n, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m.to(tl.int64)[:, None] * stride_rm + offs_n[None, :],
                       mask=omask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)


def _cublas_ok(x: torch.Tensor, weight: QuantizedWeight, tuning: QuantGemmTuning) -> bool:
    """cuBLAS's e4m3 GEMM with row-wise scales: Hopper or later, dims in multiples of 16."""
    if not (tuning.fp8_cublas and x.is_cuda and hasattr(torch, "_scaled_mm")):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (9, 0) and n % 16 == 0 and k % 16 == 0


def _scaled_mm(codes: torch.Tensor, scales: torch.Tensor, weight: QuantizedWeight,
               out: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None) -> None:
    """``out = (codes * scales) @ (w * sw).T (+ bias) (+ residual)`` by ``torch._scaled_mm``."""
    n = weight.shape[0]
    sw = weight.scale.reshape(1, -1)  # channel scales [1, N]; a tensor scale is broadcast
    if sw.shape[1] != n:
        sw = sw.expand(1, n).contiguous()
    fused_bias = bias if bias is not None and bias.dtype == out.dtype else None
    args = dict(scale_a=scales, scale_b=sw, bias=fused_bias, out_dtype=out.dtype)
    if residual is None and out.is_contiguous():
        torch._scaled_mm(codes, weight.qdata.t(), out=out, **args)  # no copy of the product
        result = out
    else:
        result = torch._scaled_mm(codes, weight.qdata.t(), **args)
    if bias is not None and fused_bias is None:
        result += bias
    if residual is not None:
        torch.add(result, residual, out=out)
    elif result is not out:
        out.copy_(result)


def fp8_linear_supported(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """Whether :func:`fp8_linear` takes ``weight`` for ``x``: an fp8 weight in stored column
    order whose column blocks (when narrower than K) are multiples of 16, 16-bit activations,
    and e4m3 tensor cores (compute capability 8.9 or later) or the Triton interpreter."""
    if not isinstance(weight, QuantizedWeight) or weight.scheme.kind != "fp8" \
            or weight.perm is not None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    cols = weight.scheme.block[1]
    if cols < weight.shape[1] and cols % 16:
        return False
    if x.is_cuda:
        return torch.cuda.get_device_capability(x.device) >= (8, 9)
    from tgraph import envs

    return bool(envs.TRITON_INTERPRET)


def fp8_linear(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
               bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               tuning: QuantGemmTuning = _DEFAULT_TUNING) -> torch.Tensor:
    """``out = e4m3(x) @ weight.T (+ bias) (+ residual)`` on FP8 tensor cores.

    Args:
        x: ``[M, K]`` fp16/bf16 activations, last dim contiguous.
        weight: an fp8 ``[N, K]`` weight (see :func:`fp8_linear_supported`).
        out: ``[M, N]`` in x's dtype; may alias ``residual``.
        bias: optional ``[N]``.
        residual: optional ``[M, N]`` added last.
        tuning: tiles of the GEMM.

    Returns:
        ``out``.
    """
    op = "fp8_linear"
    if not fp8_linear_supported(x, weight):
        raise ValueError(f"{op}: needs an fp8 weight in stored column order with column blocks "
                         f"of a multiple of 16, fp16/bf16 x and e4m3 tensor cores; got "
                         f"{weight!r} for {x.dtype} x on {x.device}")
    m, n, k = check_quantized_linear(op, x, weight, out, bias, residual,
                                     (torch.float16, torch.bfloat16))
    if m == 0 or n == 0:
        return out
    rows, cols = weight.scheme.block
    per_tile = cols < k
    block_k = min(tuning.block_k, cols & -cols) if per_tile else tuning.block_k
    codes, scales = quantize_rows_fp8(x, cols if per_tile else None)
    if not per_tile and _cublas_ok(x, weight, tuning):
        _scaled_mm(codes, scales, weight, out, bias, residual)
        return out
    block_m = tuning.block_m if m > 64 else 64
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, tuning.block_n),)
    dummy = out
    _fp8_gemm_kernel[grid](
        codes, scales, weight.qdata, weight.scale, bias if bias is not None else dummy,
        residual if residual is not None else dummy, out,
        m, n, k, codes.stride(0), scales.stride(0), weight.qdata.stride(0),
        weight.scale.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        A_GROUP=cols if per_tile else 1 << 30, B_ROWS=rows if rows < n else 1 << 30,
        B_COLS=cols if per_tile else 1 << 30, PER_TILE=per_tile,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        BLOCK_M=block_m, BLOCK_N=tuning.block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages, **pdl_kwargs(x),
    )
    return out
