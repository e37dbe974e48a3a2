"""``out = x @ dequant(w).T (+ bias) (+ residual)`` for a :class:`~tgraph.quant.QuantizedWeight`,
dequantizing in the K loop (the weight's packed bytes are the only weight bytes read).

One kernel serves every layout of :mod:`tgraph.quant` (int4 / int8 with or without offsets, fp8
with block scales) and every M: programs own a ``[BLOCK_M, BLOCK_N]`` output tile, unpack a
``[BLOCK_N, BLOCK_K]`` weight tile per step into fp32 (``s * q + b``), round it to the
activations' dtype (what the dense reference multiplies by) and accumulate ``tl.dot`` in fp32.
fp8 codes are decoded from their bits (e4m3: 4 exponent bits, bias 7, 3 mantissa bits), which
the interpreter runs too. This is the correct, generic path; decode-speed GEMVs per layout are
a tuning matter of their own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.kernels.triton.checks import FLOAT_DTYPES, check_device, check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.quant import QuantizedWeight

__all__ = ["quant_linear"]

KIND_INT4: tl.constexpr = tl.constexpr(0)
KIND_INT8: tl.constexpr = tl.constexpr(1)
KIND_FP8: tl.constexpr = tl.constexpr(2)
_KINDS = {"int4": 0, "int8": 1, "fp8": 2}


@triton.jit
def _fp8_e4m3_value(bits):
    """The fp32 value of e4m3 codes given as uint8 bits (0x7F / 0xFF are NaN)."""
    b = bits.to(tl.int32)
    mag = b & 0x7F
    exp = mag >> 3
    man = (mag & 7).to(tl.float32)
    normal = (1.0 + man * 0.125) * tl.exp2((exp - 7).to(tl.float32))
    sub = man * 0.001953125  # man / 8 * 2**-6
    val = tl.where(exp == 0, sub, normal)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where((b & 0x80) != 0, -val, val)


@triton.jit
def _quant_linear_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, bias_ptr, res_ptr, out_ptr, perm_ptr,
    M, N, K, S_COLS,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    KIND: tl.constexpr, OFFSETS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, F32_DOT: tl.constexpr, PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        wmask = mask_n[:, None] & mask_k[None, :]
        if KIND == KIND_INT4:
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + (offs_k // 2)[None, :],
                           mask=wmask, other=0)
            code = ((byte >> ((offs_k % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        elif KIND == KIND_INT8:
            code = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask,
                           other=0).to(tl.float32)
        else:
            bits = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask,
                           other=0)
            code = _fp8_e4m3_value(bits)
        s_idx = (offs_n // ROWS)[:, None] * stride_sn + (offs_k // COLS)[None, :]
        scale = tl.load(s_ptr + s_idx, mask=wmask, other=0.0)
        if OFFSETS:
            w = scale * code + tl.load(o_ptr + s_idx, mask=wmask, other=0.0)
        elif KIND == KIND_INT4:
            w = scale * (code - 8.0)
        elif KIND == KIND_FP8:
            w = code * scale
        else:
            w = scale * code
        w = tl.where(wmask, w, 0.0)
        if PERM:  # stored column k holds logical column perm[k]: gather x to match
            cols = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)
        else:
            cols = offs_k
        xv = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if F32_DOT:
            acc = tl.dot(xv.to(tl.float32), tl.trans(w.to(x_ptr.dtype.element_ty).to(tl.float32)),
                         acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=omask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=omask)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
                 bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x @ dequant(weight).T (+ bias) (+ residual)``, the weight rounded to x's dtype.

    Args:
        x: ``[M, K]`` activations (fp32/fp16/bf16), last dim contiguous.
        weight: a quantized ``[N, K]`` weight on x's device.
        out: ``[M, N]`` in x's dtype; written, never allocated. May alias ``residual``.
        bias: optional ``[N]``.
        residual: optional ``[M, N]`` added last.

    Returns:
        ``out``.
    """
    op = "quant_linear"
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"{op}: weight must be a QuantizedWeight, got {type(weight).__name__}")
    check_tensor(op, "x", x, 2)
    check_tensor(op, "out", out, 2)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"{op}: x is [{m}, {k}] but the weight is {list(weight.shape)}")
    if tuple(out.shape) != (m, n) or out.dtype != x.dtype:
        raise ValueError(f"{op}: out must be {x.dtype} [{m}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    tensors = {"x": x, "out": out, "weight": weight.qdata}
    for name, t, shape in (("bias", bias, (n,)), ("residual", residual, (m, n))):
        if t is not None:
            check_tensor(op, name, t, len(shape), FLOAT_DTYPES)
            if tuple(t.shape) != shape:
                raise ValueError(f"{op}: {name} must be {list(shape)}, got {list(t.shape)}")
            tensors[name] = t
    check_device(op, tensors)
    if m == 0 or n == 0:
        return out
    scheme = weight.scheme
    q = weight.qdata.view(torch.uint8) if scheme.kind == "fp8" else weight.qdata
    rows, cols = scheme.block
    dummy = out
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and envs.TRITON_INTERPRET)
    _quant_linear_kernel[grid](
        x, q, weight.scale, weight.offset if weight.offset is not None else weight.scale,
        bias if bias is not None else dummy, residual if residual is not None else dummy, out,
        weight.perm if weight.perm is not None else dummy,
        m, n, k, weight.scale.shape[1],
        x.stride(0), q.stride(0), weight.scale.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        KIND=_KINDS[scheme.kind], OFFSETS=scheme.offsets, ROWS=rows, COLS=cols,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, F32_DOT=f32,
        PERM=weight.perm is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl_kwargs(x),
    )
    return out
