"""Routed experts for many tokens (prefill, large batches): a grouped GEMM over the experts.

The (token, choice) pairs are sorted by expert and cut into blocks of one expert each
(:func:`~tgraph.kernels.triton.moe_routing.sort_by_expert`); then

1. gate|up with SwiGLU: a program per (block, tile of intermediate columns) gathers its pairs'
   token rows and multiplies them on the tensor cores by the tile of the expert's gate and up
   weights, writing ``silu(gate) * up`` per pair;
2. down with the routing weight in the epilogue: a program per (block, tile of hidden columns)
   multiplies the pairs' SwiGLU rows by the expert's down weight and writes ``p * y`` per pair
   in fp32;
3. :func:`~tgraph.kernels.triton.moe.combine_pairs` adds each token's shares.

Every expert's weights are read once per block of its pairs, instead of once per pair (the
decode kernels) or for every token (the op's reference). Everything stays on the device with
fixed grids (unused blocks exit at once), so it is capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.gemv import weight_descriptor
from tgraph.kernels.triton.moe import check_moe_operands, combine_pairs, tl_dtype
from tgraph.kernels.triton.moe_routing import route_topk, sort_by_expert
from tgraph.kernels.triton.moe_tiles import ExpertWeight, expert_tile, expert_weight
from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait
from tgraph.quant import QuantizedWeight

__all__ = ["grouped_block_m", "moe_grouped", "moe_grouped_shares"]


@triton.jit
def _block_pairs(order_ptr, blk_pos_ptr, blk_end_ptr, blk, BLOCK_M: tl.constexpr):
    """The int64 pair indices of block ``blk`` and which of its ``BLOCK_M`` rows hold one."""
    pos = tl.load(blk_pos_ptr + blk) + tl.arange(0, BLOCK_M)
    valid = pos < tl.load(blk_end_ptr + blk)
    return tl.load(order_ptr + pos, mask=valid, other=0).to(tl.int64), valid


@triton.jit
def _grouped_gate_up_kernel(x_ptr, order_ptr, blk_expert_ptr, blk_pos_ptr, blk_end_ptr,
                            w_ptr, w_desc, s_ptr, b_ptr, h_ptr, H, INTER, E, TOP_K,
                            stride_xt, stride_w, stride_s, stride_hp,
                            QUANT: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                            ZERO: tl.constexpr, OFFSETS: tl.constexpr, QROWS: tl.constexpr,
                            QCOLS: tl.constexpr, DTYPE: tl.constexpr, DOT: tl.constexpr,
                            PRECISION: tl.constexpr, W_DESC: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr):
    blk = tl.program_id(0)
    pdl_wait(PDL)
    expert = tl.load(blk_expert_ptr + blk)
    if expert < E:
        pair, valid = _block_pairs(order_ptr, blk_pos_ptr, blk_end_ptr, blk, BLOCK_M)
        token = pair // TOP_K
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < INTER
        gate_row0 = expert * (2 * INTER) + tl.program_id(1) * BLOCK_N
        gate_rows = gate_row0 + tl.arange(0, BLOCK_N)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + token[:, None] * stride_xt + offs_k[None, :],
                        mask=valid[:, None] & (offs_k < H)[None, :], other=0.0).to(DOT)
            if W_DESC:  # rows past the gate half read up rows: columns never stored
                wg = w_desc.load([gate_row0, k0]).to(DOT)
                wu = w_desc.load([gate_row0 + INTER, k0]).to(DOT)
            else:
                wg = expert_tile(w_ptr, s_ptr, b_ptr, gate_rows, mask_n, k0, H, stride_w,
                                 stride_s, QUANT, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS,
                                 BLOCK_N, BLOCK_K, DTYPE).to(DOT)
                wu = expert_tile(w_ptr, s_ptr, b_ptr, gate_rows + INTER, mask_n, k0, H,
                                 stride_w, stride_s, QUANT, KIND, NATIVE_FP8, ZERO, OFFSETS,
                                 QROWS, QCOLS, BLOCK_N, BLOCK_K, DTYPE).to(DOT)
            acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PRECISION)
        h = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + pair[:, None] * stride_hp + offs_n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _grouped_down_kernel(h_ptr, order_ptr, blk_expert_ptr, blk_pos_ptr, blk_end_ptr, p_ptr,
                         w_ptr, w_desc, s_ptr, b_ptr, y_ptr, H, INTER, E,
                         stride_hp, stride_w, stride_s, stride_yp,
                         QUANT: tl.constexpr, KIND: tl.constexpr, NATIVE_FP8: tl.constexpr,
                         ZERO: tl.constexpr, OFFSETS: tl.constexpr, QROWS: tl.constexpr,
                         QCOLS: tl.constexpr, DTYPE: tl.constexpr, DOT: tl.constexpr,
                         PRECISION: tl.constexpr, W_DESC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    blk = tl.program_id(0)
    pdl_wait(PDL)
    expert = tl.load(blk_expert_ptr + blk)
    if expert < E:
        pair, valid = _block_pairs(order_ptr, blk_pos_ptr, blk_end_ptr, blk, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        rows = expert * H + offs_n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(h_ptr + pair[:, None] * stride_hp + offs_k[None, :],
                        mask=valid[:, None] & (offs_k < INTER)[None, :], other=0.0).to(DOT)
            if W_DESC:  # rows past H read the next expert's: columns never stored
                w = w_desc.load([expert * H + tl.program_id(1) * BLOCK_N, k0]).to(DOT)
            else:
                w = expert_tile(w_ptr, s_ptr, b_ptr, rows, mask_n, k0, INTER, stride_w,
                                stride_s, QUANT, KIND, NATIVE_FP8, ZERO, OFFSETS, QROWS, QCOLS,
                                BLOCK_N, BLOCK_K, DTYPE).to(DOT)
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        share = tl.load(p_ptr + pair, mask=valid, other=0.0)
        tl.store(y_ptr + pair[:, None] * stride_yp + offs_n[None, :], acc * share[:, None],
                 mask=valid[:, None] & mask_n[None, :])


def _tma(op: ExpertWeight, block_n: int, wanted: bool):
    """A TMA descriptor of a 16-bit experts operand's flat rows, or None (pointer loads)."""
    if not wanted or op.constexprs["QUANT"]:
        return None
    return weight_descriptor(op.data, block_n, op.block_k, True)


def grouped_block_m(pairs: int, experts: int, largest: int) -> int:
    """Pairs per block: the smallest MMA tile (16) up to ``largest``, by the pairs an expert
    gets on average, so blocks of few pairs do not pad to large tiles."""
    block_m = 16
    while block_m < largest and block_m < pairs / experts:
        block_m *= 2
    return block_m


def moe_grouped(x: torch.Tensor, router_logits: torch.Tensor,
                w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
                out: torch.Tensor, top_k: int, renormalize: bool, *, block_m: int = 64,
                block_n: int = 64, block_k: int = 64, num_warps: int = 4,
                num_stages: int = 3, one_program_max_pairs: int = 0,
                tma_weights: bool = False) -> torch.Tensor:
    """``out = moe(x, router_logits, w13, w2)`` as a grouped GEMM (operands as
    :func:`~tgraph.kernels.triton.moe.moe_decode` takes them).

    Args:
        block_m: the largest block of pairs (:func:`grouped_block_m` picks the launch's).
        block_n, block_k, num_warps, num_stages: the GEMM tiles and pipeline.
        one_program_max_pairs: up to this many (token, expert) pairs one launch groups them
            (:func:`~tgraph.kernels.triton.moe_routing.sort_by_expert`).
        tma_weights: read 16-bit experts' weight tiles by TMA (Hopper, or the interpreter).
    """
    check_moe_operands("moe_grouped", x, router_logits, w13, w2, out, top_k)
    if x.shape[0] == 0:
        return out
    shares = moe_grouped_shares(x, router_logits, w13, w2, top_k, renormalize, block_m=block_m,
                                block_n=block_n, block_k=block_k, num_warps=num_warps,
                                num_stages=num_stages,
                                one_program_max_pairs=one_program_max_pairs,
                                tma_weights=tma_weights)
    return combine_pairs(shares, out, top_k)


def moe_grouped_shares(x: torch.Tensor, router_logits: torch.Tensor,
                       w13: torch.Tensor | QuantizedWeight, w2: torch.Tensor | QuantizedWeight,
                       top_k: int, renormalize: bool, *, block_m: int = 64, block_n: int = 64,
                       block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
                       one_program_max_pairs: int = 0, tma_weights: bool = False
                       ) -> torch.Tensor:
    """The experts of :func:`moe_grouped` without the combine: fp32 ``[T * top_k, H]`` weighted
    shares, laid out as :func:`~tgraph.kernels.triton.moe.moe_decode_shares` lays them out.
    With ``tma_weights``, 16-bit experts' tiles are read by TMA where the device has it."""
    t, h, e, inter = check_moe_operands("moe_grouped_shares", x, router_logits, w13, w2, None,
                                        top_k)
    if t == 0:
        return torch.empty(0, h, dtype=torch.float32, device=x.device)
    weights, ids = route_topk(router_logits, top_k, renormalize)
    blocks = sort_by_expert(ids, e, grouped_block_m(t * top_k, e, block_m),
                            one_program_max_pairs)
    g = expert_weight(w13, e * 2 * inter, block_k)
    d = expert_weight(w2, e * h, block_k)
    hidden = torch.empty(t * top_k, inter, dtype=x.dtype, device=x.device)
    shares = torch.empty(t * top_k, h, dtype=torch.float32, device=x.device)
    # The interpreter's 16-bit dot is wrong: it multiplies the rounded tiles in fp32.
    dot = torch.float32 if not x.is_cuda else x.dtype
    common = dict(DTYPE=tl_dtype(x.dtype), DOT=tl_dtype(dot),
                  PRECISION="ieee" if dot == torch.float32 else "tf32",
                  BLOCK_M=blocks.block_m, BLOCK_N=block_n, num_warps=num_warps,
                  **pdl_kwargs(x))
    if x.is_cuda:
        common["num_stages"] = num_stages
    walk = (blocks.order, blocks.expert, blocks.pos, blocks.end)
    g_desc, d_desc = (_tma(op, block_n, tma_weights) for op in (g, d))
    _grouped_gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, block_n))](
        x, *walk, g.data, g_desc or g.data, g.scale, g.offset, hidden, h, inter, e, top_k,
        x.stride(0), g.stride_w, g.stride_s, hidden.stride(0), **g.constexprs,
        W_DESC=g_desc is not None, BLOCK_K=g.block_k, **common)
    _grouped_down_kernel[(blocks.num_blocks, triton.cdiv(h, block_n))](
        hidden, *walk, weights, d.data, d_desc or d.data, d.scale, d.offset, shares, h, inter,
        e, hidden.stride(0), d.stride_w, d.stride_s, shares.stride(0), **d.constexprs,
        W_DESC=d_desc is not None, BLOCK_K=d.block_k, **common)
    return shares
