"""``out = x @ dequant(w).T (+ bias) (+ residual)`` for a :class:`~tgraph.quant.QuantizedWeight`,
dequantizing in the K loop (the weight's packed bytes are the only weight bytes read).

One kernel serves every layout of :mod:`tgraph.quant` (int4 / int8 with or without offsets, fp8
with block scales) and every M: programs own a ``[BLOCK_M, BLOCK_N]`` output tile, unpack a
``[BLOCK_N, BLOCK_K]`` weight tile per step into fp32 (``s * q + b``), round it to the
activations' dtype (what the dense reference multiplies by) and accumulate ``tl.dot`` in fp32.
When K tiles fit in the scale groups a tile reads one scale per row
(:mod:`tgraph.kernels.triton.quant_tiles`); otherwise (narrow groups, act-order columns) each
weight's scale is gathered. On a GPU, fp8 codes convert in hardware; under the interpreter they
are decoded from their bits.

From ``QuantGemmTuning.dense_min_m`` rows on a GPU the weight is instead dequantized once into a
scratch buffer (:func:`dequantize_into`, one pass over the codes) and multiplied by cuBLAS: at
prefill sizes that pass is a few percent of the GEMM, and cuBLAS's tiles beat a Triton GEMM that
unpacks codes in its K loop. Decode runs the GEMV of :mod:`tgraph.kernels.triton.gemv` and fp8
prefill the e4m3 GEMM of :mod:`tgraph.kernels.triton.fp8_linear`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.kernels.triton.checks import FLOAT_DTYPES, check_device, check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.kernels.triton.quant_tiles import (
    KIND_FP8,
    KIND_IDS,
    KIND_INT4,
    KIND_INT8,
    code_zero,
    dequantize_tile,
    fp8_e4m3_value,
    load_codes,
    load_scales,
)
from tgraph.quant import QuantizedWeight
from tgraph.tuning import QuantGemmTuning

__all__ = ["check_quantized_linear", "dequantize_into", "quant_linear"]

_DEFAULT_TUNING = QuantGemmTuning()

def check_quantized_linear(op: str, x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
                           bias: torch.Tensor | None, residual: torch.Tensor | None,
                           x_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
                           ) -> tuple[int, int, int]:
    """The checks of ``out = x @ weight.T (+ bias) (+ residual)`` on a quantized weight;
    returns ``(M, N, K)``."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"{op}: weight must be a QuantizedWeight, got {type(weight).__name__}")
    check_tensor(op, "x", x, 2, x_dtypes)
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
    return m, n, k


@triton.jit
def _quant_linear_kernel(
    x_ptr, q_ptr, s_ptr, o_ptr, bias_ptr, res_ptr, out_ptr, perm_ptr,
    M, N, K, S_COLS,
    stride_xm, stride_qn, stride_sn, stride_rm, stride_om,
    KIND: tl.constexpr, OFFSETS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, F32_DOT: tl.constexpr, PERM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    VEC_SCALES: tl.constexpr = False, NATIVE_FP8: tl.constexpr = False,
    ZERO: tl.constexpr = 0.0,
):
    """``VEC_SCALES``: every K tile lies in one scale block, so a tile reads one scale (and
    offset) per row and dequantizes with it; else each weight's scale is gathered."""
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
        if VEC_SCALES:
            v = load_codes(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn, k0, K, mask_n,
                           BLOCK_N, BLOCK_K, KIND, 0, NATIVE_FP8, tl.float32)
            s, b = load_scales(s_ptr, o_ptr, offs_n, mask_n, k0, stride_sn, ROWS, COLS, OFFSETS)
            w = dequantize_tile(v, s, b, ZERO, OFFSETS)
        elif KIND == KIND_INT4:
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + (offs_k // 2)[None, :],
                           mask=wmask, other=0)
            code = ((byte >> ((offs_k % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        elif KIND == KIND_INT8:
            code = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask,
                           other=0).to(tl.float32)
        else:
            bits = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=wmask,
                           other=0)
            code = fp8_e4m3_value(bits)  # gathered scales: the codes come as uint8 bits
        if not VEC_SCALES:
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


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, o_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on,
                       KIND: tl.constexpr, OFFSETS: tl.constexpr, ROWS: tl.constexpr,
                       COLS: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` tile of the dense weight (one scale block per row)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    mask_n = offs_n < N
    offs_k = k0 + tl.arange(0, BLOCK_K)
    v = load_codes(q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn, k0, K, mask_n, BLOCK_N,
                   BLOCK_K, KIND, 0, True, tl.float32)
    s, b = load_scales(s_ptr, o_ptr, offs_n, mask_n, k0, stride_sn, ROWS, COLS, OFFSETS)
    pdl_wait(PDL)  # the output may be a buffer an earlier kernel still reads
    w = dequantize_tile(v, s, b, ZERO, OFFSETS)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & (offs_k < K)[None, :])


def dequantize_into(weight: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """``out = weight.dequantize(out.dtype)`` on the GPU in one pass (fp32 arithmetic, one
    rounding to ``out``'s dtype, as :meth:`~tgraph.quant.QuantizedWeight.dequantize`)."""
    n, k = weight.shape
    if tuple(out.shape) != (n, k) or out.stride(-1) != 1:
        raise ValueError(f"dequantize_into: out must be [{n}, {k}] with a contiguous last dim, "
                         f"got {list(out.shape)} strides {out.stride()}")
    rows, cols = weight.scheme.block
    if weight.perm is not None or (cols < k and cols % 16) or not out.is_cuda \
            or envs.TRITON_INTERPRET:
        out.copy_(weight.dequantize(out.dtype))  # act-order / narrow groups: the reference
        return out
    block_k = 128 if cols >= k else min(128, cols & -cols)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        weight.qdata, weight.scale, weight.offset if weight.offset is not None else weight.scale,
        out, n, k, weight.qdata.stride(0), weight.scale.stride(0), out.stride(0),
        KIND=KIND_IDS[weight.scheme.kind], OFFSETS=weight.scheme.offsets,
        ROWS=rows if rows < n else 1 << 30, COLS=cols if cols < k else 1 << 30,
        ZERO=code_zero(weight.scheme.kind, weight.scheme.offsets, 0.0), BLOCK_N=64,
        BLOCK_K=block_k, num_warps=4, **pdl_kwargs(out))
    return out


def _dense_gemm(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
                bias: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    """Large M: the weight dequantized once into a scratch buffer, then cuBLAS."""
    dense = dequantize_into(weight, torch.empty(weight.shape, dtype=x.dtype, device=x.device))
    if residual is not None:
        torch.addmm(residual, x, dense.t(), out=out)
        if bias is not None:
            out.add_(bias)
    elif bias is not None:
        torch.addmm(bias, x, dense.t(), out=out)
    else:
        torch.mm(x, dense.t(), out=out)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor,
                 bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None,
                 tuning: QuantGemmTuning = _DEFAULT_TUNING) -> torch.Tensor:
    """``out = x @ dequant(weight).T (+ bias) (+ residual)``, the weight rounded to x's dtype.

    Args:
        x: ``[M, K]`` activations (fp32/fp16/bf16), last dim contiguous.
        weight: a quantized ``[N, K]`` weight on x's device.
        out: ``[M, N]`` in x's dtype; written, never allocated. May alias ``residual``.
        bias: optional ``[N]``.
        residual: optional ``[M, N]`` added last.
        tuning: tiles on a GPU (``int_*``).

    Returns:
        ``out``.
    """
    m, n, k = check_quantized_linear("quant_linear", x, weight, out, bias, residual)
    if m == 0 or n == 0:
        return out
    if x.is_cuda and not envs.TRITON_INTERPRET and m >= tuning.dense_min_m \
            and x.dtype != torch.float32:
        _dense_gemm(x, weight, out, bias, residual)
        return out
    scheme = weight.scheme
    rows, cols = scheme.block
    # Tiles inside one scale block read one scale per row (unless columns are permuted).
    vec_cols = weight.perm is None and (cols >= k or cols % 16 == 0)
    native_fp8 = x.is_cuda and not envs.TRITON_INTERPRET and vec_cols
    q = weight.qdata.view(torch.uint8) if scheme.kind == "fp8" and not native_fp8 \
        else weight.qdata
    dummy = out
    if x.is_cuda and m > 64:
        block_m, block_n = tuning.int_block_m, tuning.int_block_n
        block_k, warps, stages = tuning.int_block_k, tuning.int_num_warps, tuning.int_num_stages
    else:  # decode-sized M (act-order weights) and the interpreter: small tiles
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k, warps, stages = 64, 64, 4, None
    if vec_cols and cols < k:
        block_k = min(block_k, cols & -cols)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    f32 = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and envs.TRITON_INTERPRET)
    launch = dict(num_warps=warps) if stages is None else dict(num_warps=warps,
                                                               num_stages=stages)
    _quant_linear_kernel[grid](
        x, q, weight.scale, weight.offset if weight.offset is not None else weight.scale,
        bias if bias is not None else dummy, residual if residual is not None else dummy, out,
        weight.perm if weight.perm is not None else dummy,
        m, n, k, weight.scale.shape[1],
        x.stride(0), q.stride(0), weight.scale.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        KIND=KIND_IDS[scheme.kind], OFFSETS=scheme.offsets, ROWS=rows,
        COLS=cols if cols < k else 1 << 30,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, F32_DOT=f32,
        PERM=weight.perm is not None, VEC_SCALES=vec_cols,
        NATIVE_FP8=native_fp8, ZERO=code_zero(scheme.kind, scheme.offsets, 0.0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch, **pdl_kwargs(x),
    )
    return out
