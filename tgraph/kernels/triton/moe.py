"""Routed experts for a few tokens (decode): each token reads only its top-k experts' weights.

After the routing kernel (:func:`~tgraph.kernels.triton.moe_routing.route_topk`):

1. gate|up with SwiGLU: a program per (token, chosen expert, block of intermediate rows)
   streams those rows of the expert's gate and up weights against the token's activations and
   writes ``silu(gate) * up`` for the pair;
2. down with the weighted combine: a program per (token, block of hidden rows) loops over the
   token's experts, streams the rows of each one's down weight against that expert's SwiGLU
   output and accumulates ``p_e * (w2[e] @ h_e)`` in fp32, writing the token's output once.
   With ``split`` (a few tokens, where a program per token would leave most of the GPU idle) a
   program per (pair, block of hidden rows) writes its weighted share in fp32 and
   :func:`combine_pairs` adds a token's shares.

Both are elementwise-FMA GEMVs over ``[BLOCK_N, BLOCK_K]`` tiles (16-bit tiles summed in runs of
``FOLD`` columns into a narrow accumulator);
quantized experts are multiplied on their codes, each tile's scales folded once per row
(:mod:`tgraph.kernels.triton.moe_tiles`). A step reads ``top_k / experts`` of the experts'
bytes. Many tokens take the grouped kernels of
:mod:`tgraph.kernels.triton.moe_grouped`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.checks import check_device, check_tensor
from tgraph.kernels.triton.gemv_tiles import fold_columns
from tgraph.kernels.triton.moe_routing import route_topk
from tgraph.kernels.triton.moe_tiles import expert_dot, expert_tile, expert_weight
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.quant import QuantizedWeight, is_quantized

__all__ = ["check_moe_operands", "combine_pairs", "moe_decode", "moe_decode_shares", "tl_dtype"]

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """Triton's name for a float dtype."""
    return _TL[dtype]


# Dense tiles are summed in runs of 8 columns: one thread's 16-byte load of 16-bit weights
# (fp32 experts, the interpreter's, fold the same 8; see gemv_tiles.fold_columns).
FOLD: tl.constexpr = tl.constexpr(8)


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, b_ptr, h_ptr, H, INTER, TOP_K,
                    stride_xt, stride_w, stride_s, stride_ht,
                    QUANT: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                    ZERO: tl.constexpr, OFFSETS: tl.constexpr, QROWS: tl.constexpr,
                    QCOLS: tl.constexpr, DTYPE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)  # token * TOP_K + choice
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    pdl_wait(PDL)
    expert = tl.load(ids_ptr + pair)
    gate_rows = expert * (2 * INTER) + offs_n
    if QUANT:  # codes times activations, each tile's scales folded once per row
        g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=offs_k < H,
                         other=0.0).to(tl.float32)
            g += expert_dot(w_ptr, s_ptr, b_ptr, gate_rows, mask_n, k0, H, stride_w, stride_s,
                            xv, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS, BLOCK_N, BLOCK_K)
            u += expert_dot(w_ptr, s_ptr, b_ptr, gate_rows + INTER, mask_n, k0, H, stride_w,
                            stride_s, xv, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS,
                            BLOCK_N, BLOCK_K)
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // FOLD), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // FOLD), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=offs_k < H, other=0.0)
            xv = xv.to(tl.float32)[None, :]
            tile_g = expert_tile(w_ptr, s_ptr, b_ptr, gate_rows, mask_n, k0, H, stride_w,
                                 stride_s, False, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS,
                                 BLOCK_N, BLOCK_K, DTYPE)
            acc_g += fold_columns(tile_g.to(tl.float32) * xv, BLOCK_N, BLOCK_K, FOLD)
            tile_u = expert_tile(w_ptr, s_ptr, b_ptr, gate_rows + INTER, mask_n, k0, H,
                                 stride_w, stride_s, False, KIND, NATIVE_FP8, ZERO, OFFSETS,
                                 QROWS, QCOLS, BLOCK_N, BLOCK_K, DTYPE)
            acc_u += fold_columns(tile_u.to(tl.float32) * xv, BLOCK_N, BLOCK_K, FOLD)
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_ht + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, p_ptr, w_ptr, s_ptr, b_ptr, out_ptr, H, INTER, TOP_K,
                 stride_ht, stride_w, stride_s, stride_ot,
                 QUANT: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                 ZERO: tl.constexpr, OFFSETS: tl.constexpr, QROWS: tl.constexpr,
                 QCOLS: tl.constexpr, DTYPE: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # SPLIT: program 0 axis runs over pairs, each writing its fp32 share; else over tokens.
    first = tl.program_id(0) if SPLIT else tl.program_id(0) * TOP_K
    count = 1 if SPLIT else TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    pdl_wait(PDL)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, count):
        pair = first + j
        expert = tl.load(ids_ptr + pair)
        share = tl.load(p_ptr + pair)
        rows = expert * H + offs_n
        if QUANT:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                hv = tl.load(h_ptr + pair * stride_ht + offs_k, mask=offs_k < INTER, other=0.0)
                y += expert_dot(w_ptr, s_ptr, b_ptr, rows, mask_n, k0, INTER, stride_w,
                                stride_s, hv.to(tl.float32), KIND, NATIVE_FP8, ZERO, OFFSETS,
                                QROWS, QCOLS, BLOCK_N, BLOCK_K)
        else:
            acc = tl.zeros((BLOCK_N, BLOCK_K // FOLD), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                hv = tl.load(h_ptr + pair * stride_ht + offs_k, mask=offs_k < INTER, other=0.0)
                tile = expert_tile(w_ptr, s_ptr, b_ptr, rows, mask_n, k0, INTER, stride_w,
                                   stride_s, False, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS,
                                   QCOLS, BLOCK_N, BLOCK_K, DTYPE)
                acc += fold_columns(tile.to(tl.float32) * hv.to(tl.float32)[None, :], BLOCK_N,
                                    BLOCK_K, FOLD)
            y = tl.sum(acc, axis=1)
        out += share * y
    tl.store(out_ptr + tl.program_id(0) * stride_ot + offs_n,
             out.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _combine_kernel(y_ptr, out_ptr, H, TOP_K, stride_yp, stride_ot, BLOCK_N: tl.constexpr,
                    PDL: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * stride_yp + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + token * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def combine_pairs(y: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """``out[t] = sum_j y[t * top_k + j]``: the fp32 weighted shares of a token's experts,
    added in choice order and rounded once."""
    t, h = out.shape
    block_n = 256
    _combine_kernel[(t, triton.cdiv(h, block_n))](y, out, h, top_k, y.stride(0), out.stride(0),
                                                  BLOCK_N=block_n, num_warps=4,
                                                  **pdl_kwargs(out))
    return out


def check_moe_operands(op: str, x: torch.Tensor, router_logits: torch.Tensor,
                       w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
                       out: torch.Tensor | None, top_k: int) -> tuple[int, int, int, int]:
    """``(T, H, E, I)`` of the operands, checked: x ``[T, H]``, logits ``[T, E]``, experts
    ``[E, 2I, H]`` / ``[E, H, I]`` contiguous in x's dtype or quantized ``[E * 2I, H]`` /
    ``[E * H, I]``, out (None: none given) like x."""
    check_tensor(op, "x", x, 2)
    check_tensor(op, "router_logits", router_logits, 2)
    if out is None:
        out = x
    check_tensor(op, "out", out, 2)
    t, h = x.shape
    e = router_logits.shape[1]
    quant = is_quantized(w13)
    if quant != is_quantized(w2):
        raise ValueError(f"{op}: w13 and w2 must be both dense or both quantized, got "
                         f"{type(w13).__name__} and {type(w2).__name__}")
    if quant:
        two_inter = w13.shape[0] // e
        inter = two_inter // 2
        ok = tuple(w13.shape) == (e * two_inter, h) and tuple(w2.shape) == (e * h, inter)
    else:
        for name, w in (("w13", w13), ("w2", w2)):
            check_tensor(op, name, w, 3)
        two_inter, inter = w13.shape[1], w13.shape[1] // 2
        ok = tuple(w13.shape) == (e, two_inter, h) and tuple(w2.shape) == (e, h, inter) \
            and w13.dtype == w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()
    if not ok or two_inter % 2 or router_logits.shape[0] != t or tuple(out.shape) != (t, h) \
            or out.dtype != x.dtype:
        raise ValueError(f"{op}: expected x [T, H], router_logits [T, E], experts w13 [E, 2I, H] "
                         f"and w2 [E, H, I] contiguous in x's dtype (or both quantized as "
                         f"[E * 2I, H] and [E * H, I]), out like x; got x {list(x.shape)} "
                         f"{x.dtype}, logits {list(router_logits.shape)}, w13 {list(w13.shape)} "
                         f"{w13.dtype}, w2 {list(w2.shape)} {w2.dtype}, out {list(out.shape)} "
                         f"{out.dtype}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be between 1 and the {e} experts, got {top_k}")
    device_of = {"x": x, "router_logits": router_logits, "out": out,
                 "w13": w13.qdata if quant else w13, "w2": w2.qdata if quant else w2}
    check_device(op, device_of)
    return t, h, e, inter


def moe_decode(x: torch.Tensor, router_logits: torch.Tensor,
               w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
               out: torch.Tensor, top_k: int, renormalize: bool, block_n: int = 16,
               block_k: int = 256, split: bool = False) -> torch.Tensor:
    """``out = moe(x, router_logits, w13, w2)`` reading only the chosen experts' weights.

    Args:
        x: ``[T, H]`` activations (fp16/bf16/fp32), rows contiguous.
        router_logits: ``[T, E]``.
        w13: ``[E, 2 * I, H]`` gate rows then up rows per expert, in x's dtype, or a quantized
            ``[E * 2 * I, H]`` of those rows.
        w2: ``[E, H, I]`` (quantized: ``[E * H, I]``).
        out: ``[T, H]`` in x's dtype; written, never allocated.
        top_k: experts per token.
        renormalize: scale each token's chosen probabilities to sum to one.
        block_n, block_k: the GEMV tiles.
        split: one program per (token, expert) for the down projection, then a combine.

    Returns:
        ``out``.
    """
    dims = check_moe_operands("moe_decode", x, router_logits, w13, w2, out, top_k)
    if dims[0] == 0:
        return out
    if split:
        return combine_pairs(_experts(dims, x, router_logits, w13, w2, None, top_k, renormalize,
                                      block_n, block_k), out, top_k)
    return _experts(dims, x, router_logits, w13, w2, out, top_k, renormalize, block_n, block_k)


def moe_decode_shares(x: torch.Tensor, router_logits: torch.Tensor,
                      w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
                      top_k: int, renormalize: bool, block_n: int = 16,
                      block_k: int = 256) -> torch.Tensor:
    """The experts of :func:`moe_decode` without the combine: fp32 ``[T * top_k, H]``, row
    ``t * top_k + j`` token ``t``'s ``j``-th expert output times its routing weight (what
    :func:`combine_pairs` or :func:`~tgraph.kernels.triton.norms.add_parts_rms_norm` adds up)."""
    dims = check_moe_operands("moe_decode_shares", x, router_logits, w13, w2, None, top_k)
    if dims[0] == 0:
        return torch.empty(0, dims[1], dtype=torch.float32, device=x.device)
    return _experts(dims, x, router_logits, w13, w2, None, top_k, renormalize, block_n, block_k)


def _experts(dims, x, router_logits, w13, w2, out, top_k, renormalize, block_n, block_k):
    """Route, gate|up with SwiGLU, then down with the routing weights: into ``out`` (a program
    per token adding its experts), or, with ``out`` None, into new fp32 per-pair shares."""
    t, h, e, inter = dims
    weights, ids = route_topk(router_logits, top_k, renormalize)
    g = expert_weight(w13, e * 2 * inter, block_k)
    d = expert_weight(w2, e * h, block_k)
    hidden = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_kwargs(x)
    dtype = tl_dtype(x.dtype)
    _gate_up_kernel[(t * top_k, triton.cdiv(inter, block_n))](
        x, ids, g.data, g.scale, g.offset, hidden, h, inter, top_k, x.stride(0), g.stride_w,
        g.stride_s, hidden.stride(0), **g.constexprs, DTYPE=dtype, BLOCK_N=block_n,
        BLOCK_K=g.block_k, num_warps=4, **pdl)
    split = out is None
    target = torch.empty(t * top_k, h, dtype=torch.float32, device=x.device) if split else out
    _down_kernel[(target.shape[0], triton.cdiv(h, block_n))](
        hidden, ids, weights, d.data, d.scale, d.offset, target, h, inter, top_k, hidden.stride(0),
        d.stride_w, d.stride_s, target.stride(0), **d.constexprs, DTYPE=dtype, SPLIT=split,
        BLOCK_N=block_n, BLOCK_K=d.block_k, num_warps=4, **pdl)
    return target
