"""The Triton backend's kernel table: for each op, a wrapper that adapts a node's inputs to a
Triton kernel (or cuBLAS, where it wins) and writes into the output buffers the engine planned.

Calling convention: ``kernel(outs, *inputs, **attrs)`` where ``outs`` holds one preallocated
buffer per output (``None`` for outputs that alias an input, e.g. the KV cache); the wrapper
returns the op's output(s). Ops without a wrapper fall back to their torch reference, copied into
the buffer, so every network runs.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from tgraph.ir.node import Node
from tgraph.ir.ops import get_op
from tgraph.ir.ops.fused import EPILOGUE_ACTIVATIONS
from tgraph.ir.ops.pointwise import _UNARY_FLOAT

Outs = Sequence[torch.Tensor | None]
FastKernel = Callable[..., Any]
_TABLE: dict[str, FastKernel] = {}


def _register(op: str):
    def deco(fn: FastKernel) -> FastKernel:
        _TABLE[op] = fn
        return fn
    return deco


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` as ``[M, N]`` with a contiguous last dim (a view when possible)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1])


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@_register("rms_norm")
def _rms_norm(outs: Outs, x, weight, *, eps):
    if weight is None or weight.dtype != x.dtype:
        return _reference_into("rms_norm")(outs, x, weight, eps=eps)
    from tgraph.kernels.triton.norms import rms_norm

    rms_norm(_rows(x), weight, eps, outs[0].view(-1, x.shape[-1]))
    return outs[0]


@_register("add_rms_norm")
def _add_rms_norm(outs: Outs, x, residual, weight, *, eps):
    if weight.dtype != x.dtype:
        return _reference_into("add_rms_norm")(outs, x, residual, weight, eps=eps)
    from tgraph.kernels.triton.norms import add_rms_norm

    n = x.shape[-1]
    add_rms_norm(_rows(x), _rows(residual), weight, eps, outs[0].view(-1, n), outs[1].view(-1, n))
    return outs[0], outs[1]


@_register("swiglu")
def _swiglu(outs: Outs, gate_up):
    from tgraph.kernels.triton.activations import swiglu

    swiglu(_rows(gate_up), outs[0].view(-1, outs[0].shape[-1]))
    return outs[0]


@_register("embedding")
def _embedding(outs: Outs, ids, weight):
    from tgraph.kernels.triton.embedding import embedding

    embedding(ids.reshape(-1), weight, outs[0].view(-1, weight.shape[1]))
    return outs[0]


@_register("rope")
def _rope(outs: Outs, q, k, cos, sin, *, interleaved=False):
    from tgraph.kernels.triton.rope import rope

    rope(_last_contiguous(q), _last_contiguous(k), cos.float(), sin.float(), outs[0], outs[1],
         interleaved)
    return outs[0], outs[1]


@_register("reshape_and_cache")
def _reshape_and_cache(outs: Outs, k, v, k_cache, v_cache, slots_mapping):
    from tgraph.kernels.triton.rope import reshape_and_cache

    reshape_and_cache(_last_contiguous(k), _last_contiguous(v), k_cache, v_cache, slots_mapping)
    return k_cache, v_cache


@_register("rope_cache")
def _rope_cache(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *, interleaved=False,
                keep_k=False):
    from tgraph.kernels.triton.rope import rope_and_cache

    # Without keep_k the rotated k only goes to the cache: no k_out.
    k_out = outs[3] if keep_k else None
    rope_and_cache(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v), cos.float(),
                   sin.float(), k_cache, v_cache, slots_mapping, outs[0], k_out, interleaved)
    return (outs[0], k_cache, v_cache, k_out) if keep_k else (outs[0], k_cache, v_cache)


@_register("rope_cache_attention")
def _rope_cache_attention(outs: Outs, q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table,
                          seq_len, *, interleaved=False, scale=None, sliding_window=None):
    from tgraph.kernels.triton.attention import NewKey, paged_attention_decode

    new_key = NewKey(_last_contiguous(k), _last_contiguous(v), cos.float(), sin.float(), slots_mapping,
                     interleaved)
    paged_attention_decode(_last_contiguous(q), k_cache, v_cache, block_table, seq_len, scale,
                           sliding_window, outs[0], new_key=new_key)
    return outs[0], k_cache, v_cache


@_register("l2_prefetch")
def _l2_prefetch(outs: Outs, x, *weights, halves, fraction):
    from tgraph.kernels.triton.prefetch import prefetch_ahead

    prefetch_ahead(x, weights, halves, fraction)
    return x


@_register("paged_attention")
def _paged_attention(outs: Outs, q, k_cache, v_cache, block_table, seq_len, query_start_loc=None,
                     k_new=None, v_new=None, *, scale=None, sliding_window=None):
    from tgraph.kernels.triton.attention import paged_attention_decode, paged_attention_prefill

    if query_start_loc is None:
        paged_attention_decode(_last_contiguous(q), k_cache, v_cache, block_table, seq_len, scale,
                               sliding_window, outs[0])
    else:
        new_kv = None if k_new is None else (_last_contiguous(k_new), _last_contiguous(v_new))
        paged_attention_prefill(_last_contiguous(q), k_cache, v_cache, block_table, seq_len,
                                query_start_loc, scale, sliding_window, outs[0], new_kv=new_kv)
    return outs[0]


def _matmul_into(out2: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, bias, residual2,
                 transpose_b: bool) -> None:
    """``out2 = x2 @ w(.T) + bias + residual2`` through the small-M kernel or cuBLAS."""
    m, k = x2.shape
    n = w.shape[0] if transpose_b else w.shape[1]
    if transpose_b and (w.is_cuda or _force_triton(x2)):
        from tgraph.kernels.triton.gemv import prefer_small_m, small_m_linear

        if prefer_small_m(m, n, k, fused=residual2 is not None) and w.stride(-1) == 1:
            small_m_linear(_last_contiguous(x2), w, out2, bias=bias, residual=residual2)
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


def _force_triton(t: torch.Tensor) -> bool:
    # Under the interpreter (CI) the Triton backend runs its kernels on CPU tensors too.
    return not t.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


@_register("linear")
def _linear(outs: Outs, x, w, bias=None, *, transpose_a=False, transpose_b=True):
    if transpose_a or x.dim() < 1:
        return _reference_into("linear")(outs, x, w, bias, transpose_a=transpose_a,
                                         transpose_b=transpose_b)
    out2 = outs[0].view(-1, outs[0].shape[-1])
    _matmul_into(out2, _rows(x), w, bias, None, transpose_b)
    return outs[0]


@_register("linear_epilogue")
def _linear_epilogue(outs: Outs, x, w, bias=None, residual=None, *, transpose_b=True, act=None):
    out2 = outs[0].view(-1, outs[0].shape[-1])
    if act is None:
        _matmul_into(out2, _rows(x), w, bias, None if residual is None else _rows(residual),
                     transpose_b)
        return outs[0]
    assert act in EPILOGUE_ACTIVATIONS
    _matmul_into(out2, _rows(x), w, bias, None, transpose_b)
    out2.copy_(_UNARY_FLOAT[act](out2.float()))
    if residual is not None:
        out2.add_(_rows(residual))
    return outs[0]


@_register("norm_linear")
def _norm_linear(outs: Outs, x, norm_weight, w, bias=None, *, eps, act=None):
    out2 = outs[0].view(-1, outs[0].shape[-1])
    x2 = _rows(x)
    m, k = x2.shape
    fused_ok = (norm_weight is None or norm_weight.dtype == x2.dtype) and w.stride(-1) == 1
    if fused_ok and (w.is_cuda or _force_triton(x2)):
        from tgraph.kernels.triton.gemv import prefer_small_m, small_m_linear

        if prefer_small_m(m, out2.shape[-1], k):
            small_m_linear(x2, w, out2, bias=bias, norm_eps=eps, norm_weight=norm_weight,
                           gated=act == "swiglu")
            return outs[0]
    # Larger M: the norm into a scratch buffer, then the GEMM (and the gate) as unfused.
    normed = torch.empty_like(x2) if norm_weight is None else torch.empty(
        x2.shape, dtype=torch.promote_types(x2.dtype, norm_weight.dtype), device=x2.device)
    _rms_norm([normed], x2, norm_weight, eps=eps)
    if act is None:
        _matmul_into(out2, normed, w, bias, None, True)
        return outs[0]
    gate_up = torch.empty(m, w.shape[0], dtype=out2.dtype, device=out2.device)
    _matmul_into(gate_up, normed, w, bias, None, True)
    _swiglu([out2], gate_up)
    return outs[0]


@_register("matmul")
def _matmul(outs: Outs, a, b):
    torch.matmul(a, b, out=outs[0])
    return outs[0]


def _reference_into(op: str) -> FastKernel:
    """Run the torch reference and copy its buffer outputs into the planned buffers."""
    reference = get_op(op).reference

    def kernel(outs: Outs, *args, **attrs):
        result = reference(*args, **attrs)
        results = result if isinstance(result, tuple) else (result,)
        final = []
        for buf, r in zip(outs, results):
            if buf is None:
                final.append(r)
            else:
                buf.copy_(r)
                final.append(buf)
        return tuple(final) if isinstance(result, tuple) else final[0]

    kernel.__name__ = f"ref_into_{op}"
    return kernel


def fast_kernel(node: Node) -> tuple[FastKernel, str]:
    """The Triton-backend kernel for ``node`` and a printable name."""
    fn = _TABLE.get(node.op)
    if fn is not None:
        return fn, f"triton.{node.op}" if node.op not in ("matmul",) else f"cublas.{node.op}"
    if node.op == "fused_pointwise":
        from tgraph.kernels.pointwise_codegen import run_fused_pointwise

        def kernel(outs: Outs, *args, program, **attrs):
            return run_fused_pointwise(program, args, outs, **attrs)
        return kernel, "triton.fused_pointwise"
    return _reference_into(node.op), f"torch.{node.op}"


from tgraph.kernels import collective_kernels  # noqa: E402,F401  (registers collective kernels)
from tgraph.kernels import sdpa_kernels  # noqa: E402,F401  (registers sdpa_attention, to_device)
