"""Wrappers of the core ops: norms, activations, embedding, rope and the paged cache, attention,
linears (the small-M Triton kernel or cuBLAS), matmul, pointwise programs and device copies.

Calling convention (see :mod:`tgraph.kernels.registry`): ``kernel(outs, *inputs, **attrs)``
where ``outs`` holds one preallocated buffer per output; the wrapper returns the op's output(s).
"""
from __future__ import annotations

from typing import Any

import torch

from tgraph.ir.ops.fused import EPILOGUE_ACTIVATIONS
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton_backend.common import (
    Outs,
    interpreted,
    last_contiguous,
    reference_into,
    rows,
)
from tgraph.quant import dense, is_quantized
from tgraph.tuning import Tuning

__all__ = ["KERNELS"]


def rms_norm_into(outs: Outs, x, weight, *, eps):
    if weight is None or weight.dtype != x.dtype:
        return reference_into("rms_norm")(outs, x, weight, eps=eps)
    from tgraph.kernels.triton.norms import rms_norm

    rms_norm(rows(x), weight, eps, outs[0].view(-1, x.shape[-1]))
    return outs[0]


def add_rms_norm_into(outs: Outs, x, residual, weight, *, eps):
    if weight.dtype != x.dtype:
        return reference_into("add_rms_norm")(outs, x, residual, weight, eps=eps)
    from tgraph.kernels.triton.norms import add_rms_norm

    n = x.shape[-1]
    add_rms_norm(rows(x), rows(residual), weight, eps, outs[0].view(-1, n), outs[1].view(-1, n))
    return outs[0], outs[1]


def swiglu_into(outs: Outs, gate_up):
    from tgraph.kernels.triton.activations import swiglu

    swiglu(rows(gate_up), outs[0].view(-1, outs[0].shape[-1]))
    return outs[0]


def embedding_into(outs: Outs, ids, weight):
    if is_quantized(weight):  # the looked-up rows only, dequantized
        outs[0].copy_(weight.rows(ids.long()))
        return outs[0]
    from tgraph.kernels.triton.embedding import embedding

    embedding(ids.reshape(-1), weight, outs[0].view(-1, weight.shape[1]))
    return outs[0]


def rope_into(outs: Outs, q, k, cos, sin, *, interleaved=False):
    from tgraph.kernels.triton.rope import rope

    rope(last_contiguous(q), last_contiguous(k), cos.float(), sin.float(), outs[0], outs[1],
         interleaved)
    return outs[0], outs[1]


def reshape_and_cache_into(outs: Outs, k, v, k_cache, v_cache, slots_mapping):
    from tgraph.kernels.triton.rope import reshape_and_cache

    reshape_and_cache(last_contiguous(k), last_contiguous(v), k_cache, v_cache, slots_mapping)
    return k_cache, v_cache


def rope_cache_into(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *,
                    interleaved=False, keep_k=False):
    from tgraph.kernels.triton.rope import rope_and_cache

    # Without keep_k the rotated k only goes to the cache: no k_out.
    k_out = outs[3] if keep_k else None
    rope_and_cache(last_contiguous(q), last_contiguous(k), last_contiguous(v), cos.float(),
                   sin.float(), k_cache, v_cache, slots_mapping, outs[0], k_out, interleaved)
    return (outs[0], k_cache, v_cache, k_out) if keep_k else (outs[0], k_cache, v_cache)


def rope_cache_attention_into(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                              block_table, seq_len, *, tuning: Tuning, interleaved=False,
                              scale=None, sliding_window=None):
    from tgraph.kernels.triton.attention import NewKey, paged_attention_decode

    new_key = NewKey(last_contiguous(k), last_contiguous(v), cos.float(), sin.float(),
                     slots_mapping, interleaved)
    paged_attention_decode(last_contiguous(q), k_cache, v_cache, block_table, seq_len, scale,
                           sliding_window, outs[0], new_key=new_key,
                           tuning=tuning.decode_attention)
    return outs[0], k_cache, v_cache


def qk_norm_rope_cache_attention_into(outs: Outs, q, k, v, q_weight, k_weight, cos, sin,
                                      k_cache, v_cache, slots_mapping, block_table, seq_len, *,
                                      tuning: Tuning, eps, interleaved=False, scale=None,
                                      sliding_window=None):
    from tgraph.kernels.triton.attention import NewKey, paged_attention_decode

    new_key = NewKey(last_contiguous(k), last_contiguous(v), cos.float(), sin.float(),
                     slots_mapping, interleaved, q_norm=q_weight, k_norm=k_weight, norm_eps=eps)
    paged_attention_decode(last_contiguous(q), k_cache, v_cache, block_table, seq_len, scale,
                           sliding_window, outs[0], new_key=new_key,
                           tuning=tuning.decode_attention)
    return outs[0], k_cache, v_cache


def l2_prefetch_into(outs: Outs, x, *weights, tuning: Tuning, halves):
    from tgraph.kernels.triton.prefetch import prefetch_ahead

    prefetch_ahead(x, weights, halves, tuning.prefetch)
    return x


def paged_attention_into(outs: Outs, q, k_cache, v_cache, block_table, seq_len,
                         query_start_loc=None, k_new=None, v_new=None, *, tuning: Tuning,
                         scale=None, sliding_window=None):
    from tgraph.kernels.triton.attention import paged_attention_decode, paged_attention_prefill

    if query_start_loc is None:
        paged_attention_decode(last_contiguous(q), k_cache, v_cache, block_table, seq_len, scale,
                               sliding_window, outs[0], tuning=tuning.decode_attention)
    else:
        new_kv = None if k_new is None else (last_contiguous(k_new), last_contiguous(v_new))
        paged_attention_prefill(last_contiguous(q), k_cache, v_cache, block_table, seq_len,
                                query_start_loc, scale, sliding_window, outs[0], new_kv=new_kv)
    return outs[0]


def _quantized_matmul(out2, x2, w, bias, residual2, tuning: Tuning) -> None:
    from tgraph.kernels.triton.fp8_linear import fp8_linear, fp8_linear_supported
    from tgraph.kernels.triton.gemv import prefer_quant_gemv, small_m_linear
    from tgraph.kernels.triton.quant_linear import quant_linear

    if prefer_quant_gemv(x2.shape[0], w, tuning.gemv):
        small_m_linear(x2, w, out2, bias=bias, residual=residual2, tuning=tuning.gemv)
    elif tuning.quant_gemm.fp8_activations and fp8_linear_supported(x2, w) \
            and w.scheme.block[1] >= w.shape[1]:  # block scales: the dense path measured faster
        fp8_linear(x2, w, out2, bias=bias, residual=residual2, tuning=tuning.quant_gemm)
    else:
        quant_linear(x2, w, out2, bias=bias, residual=residual2, tuning=tuning.quant_gemm)


def matmul_into(out2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, bias, residual2,
                transpose_b: bool, full_tuning: Tuning) -> None:
    """``out2 = x2 @ w(.T) + bias + residual2`` through the small-M kernel or cuBLAS, or for a
    quantized weight the quantized GEMV (small M), the e4m3 GEMM (fp8 weights) or the
    dequantizing GEMM."""
    tuning = full_tuning.gemv
    if is_quantized(w):
        if transpose_b:
            _quantized_matmul(out2, last_contiguous(x2), w, bias, residual2, full_tuning)
            return
        w = dense(w, x2.dtype)  # a transposed quantized operand: no kernel takes it packed
    m, k = x2.shape
    n = w.shape[0] if transpose_b else w.shape[1]
    if transpose_b and (w.is_cuda or interpreted(x2)):
        from tgraph.kernels.triton.gemv import prefer_small_m, small_m_linear

        if prefer_small_m(m, n, k, fused=residual2 is not None, tuning=tuning) \
                and w.stride(-1) == 1:
            small_m_linear(last_contiguous(x2), w, out2, bias=bias, residual=residual2,
                           tuning=tuning)
            return
    b = w.t() if transpose_b else w
    if residual2 is not None:
        torch.addmm(residual2, x2, b, out=out2)
        if bias is not None:
            out2.add_(bias)
    elif bias is not None:
        torch.addmm(bias, x2, b, out=out2)
    else:
        torch.mm(x2, b, out=out2)


def linear_into(outs: Outs, x, w, bias=None, *, tuning: Tuning, transpose_a=False,
                transpose_b=True, impl=None):
    if transpose_a or x.dim() < 1:
        return reference_into("linear")(outs, x, w, bias, transpose_a=transpose_a,
                                        transpose_b=transpose_b)
    out2 = outs[0].view(-1, outs[0].shape[-1])
    matmul_into(out2, rows(x), w, bias, None, transpose_b, tuning)
    return outs[0]


def linear_epilogue_into(outs: Outs, x, w, bias=None, residual=None, *, tuning: Tuning,
                         transpose_b=True, act=None):
    out2 = outs[0].view(-1, outs[0].shape[-1])
    if act is None:
        matmul_into(out2, rows(x), w, bias, None if residual is None else rows(residual),
                    transpose_b, tuning)
        return outs[0]
    assert act in EPILOGUE_ACTIVATIONS
    matmul_into(out2, rows(x), w, bias, None, transpose_b, tuning)
    out2.copy_(EPILOGUE_ACTIVATIONS[act](out2.float()))
    if residual is not None:
        out2.add_(rows(residual))
    return outs[0]


def norm_linear_into(outs: Outs, x, norm_weight, w, bias=None, *, tuning: Tuning, eps,
                     act=None):
    out2 = outs[0].view(-1, outs[0].shape[-1])
    x2 = rows(x)
    m, k = x2.shape
    quantized = is_quantized(w)
    fused_ok = (norm_weight is None or norm_weight.dtype == x2.dtype) \
        and (quantized or w.stride(-1) == 1)
    if fused_ok and (w.is_cuda or interpreted(x2)):
        from tgraph.kernels.triton.gemv import prefer_quant_gemv, prefer_small_m, small_m_linear

        if prefer_quant_gemv(m, w, tuning.gemv) if quantized else \
                prefer_small_m(m, out2.shape[-1], k, tuning=tuning.gemv):
            small_m_linear(x2, w, out2, bias=bias, norm_eps=eps, norm_weight=norm_weight,
                           gated=act == "swiglu", tuning=tuning.gemv)
            return outs[0]
    # Larger M: the norm into a scratch buffer, then the GEMM (and the gate) as unfused.
    normed = torch.empty_like(x2) if norm_weight is None else torch.empty(
        x2.shape, dtype=torch.promote_types(x2.dtype, norm_weight.dtype), device=x2.device)
    rms_norm_into([normed], x2, norm_weight, eps=eps)
    if act is None:
        matmul_into(out2, normed, w, bias, None, True, tuning)
        return outs[0]
    gate_up = torch.empty(m, w.shape[0], dtype=out2.dtype, device=out2.device)
    matmul_into(gate_up, normed, w, bias, None, True, tuning)
    swiglu_into([out2], gate_up)
    return outs[0]


def matmul_op_into(outs: Outs, a, b):
    torch.matmul(a, b, out=outs[0])
    return outs[0]


def fused_pointwise_into(outs: Outs, *args: Any, program, **attrs: Any):
    from tgraph.kernels.pointwise_codegen import run_fused_pointwise

    return run_fused_pointwise(program, args, outs, **attrs)


def to_device_into(outs: Outs, x: torch.Tensor, *, device: str) -> torch.Tensor:
    """Copy ``x`` into ``outs[0]``, a buffer on the destination device.

    On CUDA, torch orders a cross-device copy after the work queued on both devices' current
    streams and makes the destination stream wait for it, so no explicit event is needed.
    """
    outs[0].copy_(x, non_blocking=True)
    return outs[0]


def _reference_impl(node) -> bool:
    return node.attrs.get("impl") == "reference"


KERNELS = (
    # A linear a rule asked to run as the torch reference (a quantized weight dequantized per
    # call); tried before the kernel entry below.
    KernelSpec("linear", reference_into("linear"), supports=_reference_impl,
               name="torch.linear"),
    KernelSpec("rms_norm", rms_norm_into),
    KernelSpec("add_rms_norm", add_rms_norm_into),
    KernelSpec("swiglu", swiglu_into),
    KernelSpec("embedding", embedding_into),
    KernelSpec("rope", rope_into),
    KernelSpec("reshape_and_cache", reshape_and_cache_into),
    KernelSpec("rope_cache", rope_cache_into),
    KernelSpec("rope_cache_attention", rope_cache_attention_into, tuned=True),
    KernelSpec("qk_norm_rope_cache_attention", qk_norm_rope_cache_attention_into, tuned=True),
    KernelSpec("l2_prefetch", l2_prefetch_into, tuned=True),
    KernelSpec("paged_attention", paged_attention_into, tuned=True),
    KernelSpec("linear", linear_into, tuned=True),
    KernelSpec("linear_epilogue", linear_epilogue_into, tuned=True),
    KernelSpec("norm_linear", norm_linear_into, tuned=True),
    KernelSpec("matmul", matmul_op_into, name="cublas.matmul"),
    KernelSpec("fused_pointwise", fused_pointwise_into),
    KernelSpec("to_device", to_device_into),
)
