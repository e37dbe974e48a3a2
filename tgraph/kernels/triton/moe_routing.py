"""Routing for the expert kernels, with no host synchronisation (capturable).

- :func:`route_topk`: every token's top-k experts by the softmax of its router logits (fp32),
  renormalised on request, as :func:`tgraph.ir.ops.moe.route` computes them (ties go to the
  lower expert index).
- :func:`sort_by_expert`: the (token, choice) pairs grouped by expert and cut into blocks of
  ``block_m`` pairs of one expert each, what a grouped GEMM walks: block ``b`` holds the pairs
  ``order[pos[b] : min(pos[b] + block_m, end[b])]`` of expert ``expert[b]`` (``expert[b] ==
  E``: an unused block; the launch sizes the grid for the most blocks any routing can need).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["ONE_PROGRAM_LIMIT", "ExpertBlocks", "max_blocks", "route_topk", "sort_by_expert"]

ONE_PROGRAM_LIMIT = 4096  # the most pairs one program's registers sort (8 warps, 16 keys each)


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
                  E_PAD: tl.constexpr, PDL: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    mask_t = offs_t < T
    pdl_wait(PDL)
    logits = tl.load(logits_ptr + offs_t[:, None] * stride_lt + cols[None, :],
                     mask=mask_t[:, None] & (cols < E)[None, :], other=0.0).to(tl.float32)
    logits = tl.where((cols < E)[None, :], logits, float("-inf"))  # padding: probability 0
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # One max per choice: the probability's bits (non-negative floats order as ints) above the
    # complemented column, so ties go to the lower expert and the argmax comes with the value.
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - cols)[None, :]
    choice = tl.arange(0, K_PAD)
    weights = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        idx = E_PAD - 1 - (best & 0xFFFFFFFF).to(tl.int32)
        value = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        weights = tl.where(choice[None, :] == j, value[:, None], weights)
        ids = tl.where(choice[None, :] == j, idx[:, None], ids)
        key = tl.where(cols[None, :] == idx[:, None], -1, key)
    if RENORM:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = offs_t[:, None] * TOP_K + choice[None, :]
    mask = mask_t[:, None] & (choice < TOP_K)[None, :]
    tl.store(w_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weights ``[T, top_k]`` (descending) and int32 expert ids of every token."""
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        block_t = 1 if t <= 64 else 16  # a few tokens: a program (one warp) each
        _route_kernel[(triton.cdiv(t, block_t),)](
            router_logits, weights, ids, t, e, router_logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize, BLOCK_T=block_t,
            E_PAD=triton.next_power_of_2(e), num_warps=1 if block_t == 1 else 4,
            **pdl_kwargs(router_logits))
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    pdl_wait(PDL)
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    # Each pair's rank among its expert's pairs, in whatever order the atomics land: a
    # block's rows are independent, so the order inside an expert never changes a result.
    rank = tl.atomic_add(counts_ptr + ids, 1, mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _lay_out_blocks(counts, experts, live, blk_expert_ptr, blk_pos_ptr, blk_end_ptr, MAX_BLOCKS,
                    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Cut each expert's ``counts`` places into blocks of ``BLOCK_M``; store every block's
    expert (``E`` past the last used one), first place and its expert's end; return the
    experts' first places."""
    seg_end = tl.cumsum(counts, axis=0)
    seg_start = seg_end - counts
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    blk_last = tl.cumsum(blocks, axis=0)
    blk_first = blk_last - blocks
    for b0 in range(0, MAX_BLOCKS, CHUNK):
        bs = b0 + tl.arange(0, CHUNK)
        owner = tl.sum(((blk_last[None, :] <= bs[:, None]) & live[None, :]).to(tl.int32),
                       axis=1)
        mine = experts[None, :] == owner[:, None]  # no column where the block is unused
        first = tl.sum(tl.where(mine, blk_first[None, :], 0), axis=1)
        start = tl.sum(tl.where(mine, seg_start[None, :], 0), axis=1)
        end = tl.sum(tl.where(mine, seg_end[None, :], 0), axis=1)
        keep = bs < MAX_BLOCKS
        tl.store(blk_expert_ptr + bs, owner, mask=keep)
        tl.store(blk_pos_ptr + bs, start + (bs - first) * BLOCK_M, mask=keep)
        tl.store(blk_end_ptr + bs, end, mask=keep)
    return seg_start


@triton.jit
def _blocks_kernel(counts_ptr, seg_start_ptr, blk_expert_ptr, blk_pos_ptr, blk_end_ptr, E,
                   MAX_BLOCKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                   E_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    live = experts < E
    counts = tl.load(counts_ptr + experts, mask=live, other=0)
    seg_start = _lay_out_blocks(counts, experts, live, blk_expert_ptr, blk_pos_ptr, blk_end_ptr,
                                MAX_BLOCKS, BLOCK_M, CHUNK)
    tl.store(seg_start_ptr + experts, seg_start, mask=live)


@triton.jit
def _group_kernel(ids_ptr, order_ptr, blk_expert_ptr, blk_pos_ptr, blk_end_ptr, N, E,
                  MAX_BLOCKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, N_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, N_PAD)
    valid = offs < N
    pdl_wait(PDL)
    ids = tl.load(ids_ptr + offs, mask=valid, other=0)
    # Sorting (expert, pair) keys groups the pairs by expert in pair order; padding sorts last.
    key = tl.sort(tl.where(valid, ids, E_PAD) * N_PAD + offs)
    tl.store(order_ptr + offs, key % N_PAD, mask=valid)
    experts = tl.arange(0, E_PAD)
    _lay_out_blocks(tl.histogram(ids, E_PAD, mask=valid), experts, experts < E, blk_expert_ptr,
                    blk_pos_ptr, blk_end_ptr, MAX_BLOCKS, BLOCK_M, CHUNK)


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, seg_start_ptr, order_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    place = tl.load(seg_start_ptr + ids, mask=mask, other=0) + tl.load(rank_ptr + offs,
                                                                        mask=mask, other=0)
    tl.store(order_ptr + place, offs.to(tl.int32), mask=mask)


class ExpertBlocks:
    """The pairs grouped by expert (see the module docstring).

    Attributes:
        order: int32 ``[N]`` pair indices (``token * top_k + choice``) grouped by expert.
        expert: int32 ``[max_blocks]`` each block's expert (``E``: unused).
        pos: int32 ``[max_blocks]`` each block's first place in ``order``.
        end: int32 ``[max_blocks]`` the end of its expert's places in ``order``.
        block_m: pairs per block.
    """

    def __init__(self, order, expert, pos, end, block_m: int) -> None:
        self.order, self.expert, self.pos, self.end, self.block_m = \
            order, expert, pos, end, block_m

    @property
    def num_blocks(self) -> int:
        return self.expert.shape[0]


def max_blocks(pairs: int, experts: int, block_m: int) -> int:
    """The most blocks of ``block_m`` pairs of one expert that ``pairs`` pairs can fill."""
    return triton.cdiv(pairs, block_m) + min(experts, pairs)


def sort_by_expert(ids: torch.Tensor, experts: int, block_m: int,
                   one_program_max_pairs: int = 0) -> ExpertBlocks:
    """Group the pairs of ``ids`` (int32 ``[T, top_k]``) by expert, in blocks of ``block_m``.

    Up to ``one_program_max_pairs`` pairs (at most :data:`ONE_PROGRAM_LIMIT`) one program sorts
    them (in pair order inside an expert) and lays the blocks out, one launch; more are counted
    and ranked with atomics (in no fixed order inside an expert), laid out by one program and
    scattered: four launches.
    """
    flat = ids.reshape(-1)
    n = flat.shape[0]
    nb = max_blocks(n, experts, block_m)
    dev = ids.device
    blocks = ExpertBlocks(torch.empty(n, dtype=torch.int32, device=dev),
                          *(torch.empty(nb, dtype=torch.int32, device=dev) for _ in range(3)),
                          block_m=block_m)
    walk = (blocks.order, blocks.expert, blocks.pos, blocks.end)
    e_pad = triton.next_power_of_2(experts)
    if n <= min(one_program_max_pairs, ONE_PROGRAM_LIMIT):
        n_pad = max(16, triton.next_power_of_2(n))
        _group_kernel[(1,)](flat, *walk, n, experts, nb, BLOCK_M=block_m, CHUNK=64,
                            N_PAD=n_pad, E_PAD=e_pad, num_warps=4 if n_pad <= 1024 else 8,
                            **pdl_kwargs(ids))
        return blocks
    counts = torch.zeros(experts, dtype=torch.int32, device=dev)
    rank = torch.empty(n, dtype=torch.int32, device=dev)
    seg_start = torch.empty(experts, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(n, 256),)
    _count_kernel[grid](flat, counts, rank, n, BLOCK=256, num_warps=4, **pdl_kwargs(ids))
    _blocks_kernel[(1,)](counts, seg_start, *walk[1:], experts, nb, BLOCK_M=block_m, CHUNK=64,
                         E_PAD=e_pad, num_warps=4)
    _scatter_kernel[grid](flat, rank, seg_start, blocks.order, n, BLOCK=256, num_warps=4)
    return blocks
