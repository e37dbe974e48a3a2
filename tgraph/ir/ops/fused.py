"""Fused ops that fusion passes introduce. Each reference is written as the composition of the
unfused ops' references, so a fused engine on the reference backend equals the unfused one
exactly; the Triton kernels behind them are tested against these references."""
from __future__ import annotations

import torch

from tgraph.ir.ops import attention as attn_ops
from tgraph.ir.ops.linalg import linear_infer, linear_reference
from tgraph.ir.ops.norms import norm_infer, rms_norm_reference
from tgraph.ir.ops.pointwise import UNARY_FLOAT, binary_infer, in_fp32
from tgraph.ir.ops.registry import (
    Meta,
    OpCategory,
    dim_of,
    register_op,
    require,
)
from tgraph.ir.shape import dims_conflict

# Activations a linear's epilogue applies, each as the unfused op computes it (in fp32; relu is
# exact in any dtype and has no UNARY_FLOAT entry).
EPILOGUE_ACTIVATIONS = {**{name: UNARY_FLOAT[name] for name in ("silu", "gelu", "gelu_tanh",
                                                                 "sigmoid")},
                        "relu": torch.relu}


def add_rms_norm_infer(x: Meta, residual: Meta, weight: Meta, *, eps: float):
    summed = binary_infer(x, residual)
    require(summed.shape == x.shape or summed.shape is None,
            f"add_rms_norm: residual {residual} must have the shape of x {x}")
    return norm_infer(summed, weight, eps=eps), summed


def add_rms_norm_reference(x, residual, weight, *, eps):
    summed = x + residual
    return rms_norm_reference(summed, weight, eps=eps), summed


register_op("add_rms_norm", infer=add_rms_norm_infer, reference=add_rms_norm_reference,
            category=OpCategory.FUSED,
            doc="(rms_norm(x + residual) * weight, x + residual): the pre-norm residual step")


def _swiglu_infer(gate_up: Meta) -> Meta:
    width = dim_of(gate_up, -1)
    if isinstance(width, int):
        require(width % 2 == 0, f"swiglu needs an even last dim, got {gate_up}")
    shape = None if gate_up.shape is None else gate_up.shape[:-1] + (
        width // 2 if isinstance(width, int) else None,)
    return Meta(shape, gate_up.dtype)


def swiglu_reference(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return in_fp32(UNARY_FLOAT["silu"])(gate) * up


register_op("swiglu", infer=_swiglu_infer, reference=swiglu_reference, category=OpCategory.FUSED,
            doc="silu(gate) * up on a packed [..., 2n] gate|up tensor")


def _rope_cache_infer(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *, interleaved=False,
                      keep_k=False):
    q_out, k_out = attn_ops.rope_infer(q, k, cos, sin, interleaved=interleaved)
    kc, vc = attn_ops.cache_infer(k_out, v, k_cache, v_cache, slots_mapping)
    return (q_out, kc, vc, k_out) if keep_k else (q_out, kc, vc)


def rope_cache_reference(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, *, interleaved=False,
                         keep_k=False):
    q_rot, k_rot = attn_ops.rope_reference(q, k, cos, sin, interleaved=interleaved)
    kc, vc = attn_ops.reshape_and_cache_reference(k_rot, v, k_cache, v_cache, slots_mapping)
    return (q_rot, kc, vc, k_rot) if keep_k else (q_rot, kc, vc)


register_op("rope_cache", infer=_rope_cache_infer, reference=rope_cache_reference,
            category=OpCategory.FUSED, view_of=(None, 5, 6, None), mutates=(5, 6),
            doc="rope(q, k) and the write of rotated k and v into the paged cache, in one kernel; "
                "with keep_k the rotated k is also a fourth output (a prefill attention reads it)")


def _rope_cache_attention_infer(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table,
                                seq_len, *, interleaved=False, scale=None, sliding_window=None):
    q_rot, kc, vc = _rope_cache_infer(q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                                      interleaved=interleaved)
    out = attn_ops.attention_infer(q_rot, kc, vc, block_table, seq_len, scale=scale,
                                    sliding_window=sliding_window)
    return out, kc, vc


def rope_cache_attention_reference(q, k, v, cos, sin, k_cache, v_cache, slots_mapping, block_table,
                                   seq_len, *, interleaved=False, scale=None,
                                   sliding_window=None):
    q_rot, kc, vc = rope_cache_reference(q, k, v, cos, sin, k_cache, v_cache, slots_mapping,
                                         interleaved=interleaved)
    out = attn_ops.paged_attention_reference(q_rot, kc, vc, block_table, seq_len, scale=scale,
                                             sliding_window=sliding_window)
    return out, kc, vc


register_op("rope_cache_attention", infer=_rope_cache_attention_infer,
            reference=rope_cache_attention_reference, category=OpCategory.FUSED,
            view_of=(None, 5, 6), mutates=(5, 6),
            doc="decode: rope_cache then paged_attention (one query per sequence), one kernel "
                "pair: the attention rotates q and the new k and stores k/v itself")


def _qk_norm_rope_cache_attention_infer(q, k, v, q_weight, k_weight, cos, sin, k_cache, v_cache,
                                        slots_mapping, block_table, seq_len, *, eps,
                                        interleaved=False, scale=None, sliding_window=None):
    q_n, k_n = norm_infer(q, q_weight, eps=eps), norm_infer(k, k_weight, eps=eps)
    return _rope_cache_attention_infer(q_n, k_n, v, cos, sin, k_cache, v_cache, slots_mapping,
                                       block_table, seq_len, interleaved=interleaved,
                                       scale=scale, sliding_window=sliding_window)


def qk_norm_rope_cache_attention_reference(q, k, v, q_weight, k_weight, cos, sin, k_cache,
                                           v_cache, slots_mapping, block_table, seq_len, *, eps,
                                           interleaved=False, scale=None, sliding_window=None):
    return rope_cache_attention_reference(
        rms_norm_reference(q, q_weight, eps=eps), rms_norm_reference(k, k_weight, eps=eps), v,
        cos, sin, k_cache, v_cache, slots_mapping, block_table, seq_len,
        interleaved=interleaved, scale=scale, sliding_window=sliding_window)


register_op("qk_norm_rope_cache_attention", infer=_qk_norm_rope_cache_attention_infer,
            reference=qk_norm_rope_cache_attention_reference, category=OpCategory.FUSED,
            view_of=(None, 7, 8), mutates=(7, 8),
            doc="decode: the RMSNorm over each q and k head (Qwen3's q_norm / k_norm) and then "
                "rope_cache_attention, in the attention kernel")


def _linear_epilogue_infer(x, w, bias=None, residual=None, *, transpose_b=True, act=None):
    require(act is None or act in EPILOGUE_ACTIVATIONS,
            f"linear_epilogue: unknown activation {act!r}")
    out = linear_infer(x, w, bias, transpose_b=transpose_b)
    if residual is not None and residual.shape is not None and out.shape is not None:
        require(len(residual.shape) == len(out.shape)
                and not any(dims_conflict(a, b) for a, b in zip(residual.shape, out.shape)),
                f"linear_epilogue: residual {residual} must have the output's shape {out}")
    return out


def linear_epilogue_reference(x, w, bias=None, residual=None, *, transpose_b=True, act=None):
    out = linear_reference(x, w, bias, transpose_b=transpose_b)
    if act is not None:
        out = in_fp32(EPILOGUE_ACTIVATIONS[act])(out)
    return out if residual is None else out + residual


register_op("linear_epilogue", infer=_linear_epilogue_infer, reference=linear_epilogue_reference,
            category=OpCategory.FUSED,
            doc="act(x @ w.T + bias) + residual, with the epilogue in the matmul kernel")


NORM_LINEAR_ACTIVATIONS = ("swiglu",)


def _norm_linear_infer(x, norm_weight, w, bias=None, *, eps, act=None):
    require(act is None or act in NORM_LINEAR_ACTIVATIONS,
            f"norm_linear: unknown activation {act!r} "
            f"(expected None or one of {NORM_LINEAR_ACTIVATIONS})")
    out = linear_infer(norm_infer(x, norm_weight, eps=eps), w, bias)
    return _swiglu_infer(out) if act == "swiglu" else out


def norm_linear_reference(x, norm_weight, w, bias=None, *, eps, act=None):
    out = linear_reference(rms_norm_reference(x, norm_weight, eps=eps), w, bias)
    return swiglu_reference(out) if act == "swiglu" else out


register_op("norm_linear", infer=_norm_linear_infer, reference=norm_linear_reference,
            category=OpCategory.FUSED,
            doc="act(rms_norm(x) * norm_weight @ w.T + bias): the pre-norm linear, act None or "
                "swiglu on the packed gate|up output; at decode the norm and the gate run inside "
                "the GEMV")


def _silu_mul_infer(a: Meta, b: Meta) -> Meta:
    out = binary_infer(a, b)
    require(out.shape == a.shape or out.shape is None,
            f"silu_mul: {a} and {b} must have the same shape")
    return out


def silu_mul_reference(a, b):
    return in_fp32(UNARY_FLOAT["silu"])(a) * b


register_op("silu_mul", infer=_silu_mul_infer, reference=silu_mul_reference,
            category=OpCategory.FUSED, doc="silu(a) * b for separate gate and up tensors")
