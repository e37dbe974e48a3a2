"""Routed experts for a few tokens (decode): each token reads only its top-k experts' weights.

Two launches after the routing (softmax, top-k and renormalisation by torch ops, no host
synchronisation, so the step stays capturable):

1. gate|up with SwiGLU: a program per (token, chosen expert, block of intermediate rows)
   streams those rows of the expert's gate and up weights against the token's activations and
   writes ``silu(gate) * up`` for the pair;
2. down with the weighted combine: a program per (token, block of hidden rows) loops over the
   token's experts, streams the rows of each one's down weight against that expert's SwiGLU
   output and accumulates ``p_e * (w2[e] @ h_e)`` in fp32, writing the token's output once.

Both are elementwise-FMA GEMVs over ``[BLOCK_N, BLOCK_K]`` tiles (as the bf16 GEMV of one row),
so a step reads ``top_k / experts`` of the experts' bytes; the reference of :mod:`tgraph.ir.ops.moe`
reads all of them. Many tokens (prefill) take the reference for now.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.ir.ops.moe import route
from tgraph.kernels.triton.checks import check_device, check_tensor
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["moe_decode"]


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w13_ptr, h_ptr, H, INTER, TOP_K,
                    stride_xt, stride_we, stride_wn, stride_ht,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pair = tl.program_id(0)  # token * TOP_K + choice
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    pdl_wait(PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate_rows = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        xv = tl.load(x_ptr + token * stride_xt + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        m = mask_n[:, None] & mask_k[None, :]
        acc_g += tl.load(gate_rows + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * xv
        acc_u += tl.load(up_rows + offs_k[None, :], mask=m, other=0.0).to(tl.float32) * xv
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_ht + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_combine_kernel(h_ptr, ids_ptr, p_ptr, w2_ptr, out_ptr, H, INTER, TOP_K,
                         stride_ht, stride_we, stride_wn, stride_ot,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    pdl_wait(PDL)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(0, TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        share = tl.load(p_ptr + pair)
        rows = w2_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < INTER
            hv = tl.load(h_ptr + pair * stride_ht + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            acc += tl.load(rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :],
                           other=0.0).to(tl.float32) * hv
        out += share * tl.sum(acc, axis=1)
    tl.store(out_ptr + token * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, out: torch.Tensor, top_k: int, renormalize: bool,
               block_n: int = 16, block_k: int = 256) -> torch.Tensor:
    """``out = moe(x, router_logits, w13, w2)`` reading only the chosen experts' weights.

    Args:
        x: ``[T, H]`` activations (fp16/bf16/fp32), rows contiguous.
        router_logits: ``[T, E]``.
        w13: ``[E, 2 * I, H]`` gate rows then up rows per expert, in x's dtype.
        w2: ``[E, H, I]``.
        out: ``[T, H]`` in x's dtype; written, never allocated.
        top_k: experts per token.
        renormalize: scale each token's chosen probabilities to sum to one.
        block_n, block_k: the GEMV tiles.

    Returns:
        ``out``.
    """
    op = "moe_decode"
    check_tensor(op, "x", x, 2)
    check_tensor(op, "router_logits", router_logits, 2)
    check_tensor(op, "w13", w13, 3)
    check_tensor(op, "w2", w2, 3)
    check_tensor(op, "out", out, 2)
    t, h = x.shape
    e, two_inter, h13 = w13.shape
    inter = two_inter // 2
    if h13 != h or tuple(w2.shape) != (e, h, inter) or tuple(router_logits.shape) != (t, e) \
            or tuple(out.shape) != (t, h) or w13.dtype != x.dtype or w2.dtype != x.dtype \
            or out.dtype != x.dtype or not w13.is_contiguous() or not w2.is_contiguous():
        raise ValueError(f"{op}: expected x [T, H], router_logits [T, E], contiguous w13 "
                         f"[E, 2I, H] and w2 [E, H, I] in x's dtype, out like x; got x "
                         f"{list(x.shape)} {x.dtype}, logits {list(router_logits.shape)}, w13 "
                         f"{list(w13.shape)} {w13.dtype}, w2 {list(w2.shape)} {w2.dtype}, out "
                         f"{list(out.shape)} {out.dtype}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be between 1 and the {e} experts, got {top_k}")
    check_device(op, {"x": x, "router_logits": router_logits, "w13": w13, "w2": w2, "out": out})
    if t == 0:
        return out
    weights, ids = route(router_logits, top_k, renormalize)
    ids = ids.to(torch.int32).contiguous()
    weights = weights.contiguous()
    hidden = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = pdl_kwargs(x)
    _gate_up_kernel[(t * top_k, triton.cdiv(inter, block_n))](
        x, ids, w13, hidden, h, inter, top_k, x.stride(0), w13.stride(0), w13.stride(1),
        hidden.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl)
    _down_combine_kernel[(t, triton.cdiv(h, block_n))](
        hidden, ids, weights, w2, out, h, inter, top_k, hidden.stride(0), w2.stride(0),
        w2.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl)
    return out
