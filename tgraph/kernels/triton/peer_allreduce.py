"""All-reduce of decode-sized messages through the peers' GPU memory.

Every rank holds one buffer that all ranks can address (a :class:`PeerBuffers`: CUDA peer
memory, see :mod:`tgraph.kernels.triton_backend.peer_memory`), laid out alike on each::

    [flags A: programs x ranks int32][flags B: same][data half 0][data half 1]

and each data half holds one slot per (source rank, program). One kernel does the whole
collective. Rows are dealt to the programs round-robin; program ``p`` of every rank handles the
same rows and only ever waits for program ``p`` of the peers. Data is pushed (remote stores,
which need no round trip) and then read from local memory:

1. one-shot: store its rows of ``x`` into slot ``(rank, p)`` of every rank's data half;
   two-shot: store only columns share ``r`` of its rows into rank ``r``'s slot ``(rank, p)``;
   then raise flag A ``[p, rank]`` on every rank (a release store at system scope, after a
   barrier of the program's threads) and wait until every rank raised flag A ``[p, *]`` here;
2. one-shot: sum the rows of the local slots ``(*, p)`` in rank order, in fp32;
   two-shot: sum this rank's column share of the local slots and store the sum into every
   rank's slot ``(rank, p)`` (the share's own columns, free until now), then the same barrier on
   flags B; each share ``q`` of a full row is then in local slot ``(q, p)``;
3. the epilogue: store the sum (rounded to ``x``'s dtype, as NCCL's result is), or the fused
   residual add + RMSNorm of :func:`tgraph.kernels.triton.norms.add_rms_norm` on it.

The flags carry each program's call counter (kept in device memory, so a CUDA graph's replays
count too), compared with int32 wrap-around. A program's consecutive calls use alternate data
halves: a rank writes a peer's half of call ``n + 2`` only after that peer's same program reached
call ``n + 1``, so it no longer reads call ``n``'s; other programs never touch the slot. Every
rank sums in the same order, so all ranks get bit-identical results.

Each rank must launch the kernel the same number of times with the same grid (the engine's
ranks run the same graphs), and all ranks must reach it: like NCCL, a missing rank hangs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["PeerBuffers", "peer_all_reduce"]

# The longest row one program sums from registers (the fused norm needs the whole row).
MAX_ROW = 16384


@dataclass
class PeerBuffers:
    """What the kernel needs of a group's peer memory.

    Attributes:
        bases: int64 ``[world_size]`` device addresses of every rank's buffer, in rank order.
        counters: int32 ``[programs]`` this rank's call counter per program (starts at 0).
        rank: this rank's index in ``bases``.
        world_size: number of ranks.
        programs: the most programs a call launches (one per row up to this).
        data_offset: byte offset of data half 0 in every buffer.
        half_bytes: bytes of one data half (``world_size`` times the largest message).
    """

    bases: torch.Tensor
    counters: torch.Tensor
    rank: int
    world_size: int
    programs: int
    data_offset: int
    half_bytes: int

    @property
    def slot_bytes(self) -> int:
        """Bytes of one (source rank, program) slot in a data half."""
        return self.half_bytes // (self.programs * self.world_size) // 16 * 16

    @staticmethod
    def layout(world_size: int, programs: int, half_bytes: int) -> tuple[int, int]:
        """``(data_offset, total_bytes)`` of the buffer every rank allocates."""
        flags = 2 * programs * world_size * 4
        data_offset = -(-flags // 256) * 256  # 256-byte aligned rows for wide loads
        return data_offset, data_offset + 2 * half_bytes


@triton.jit
def _barrier(bases_ptr, flag_offset, pid, c, RANK: tl.constexpr, WS: tl.constexpr):
    """Raise flag ``[pid, RANK]`` to ``c`` on every rank, then wait for ``[pid, *] >= c`` here.

    The threads' barrier before the release store makes all of the program's earlier stores
    part of what the release publishes (PTX release is cumulative)."""
    tl.debug_barrier()
    for r in tl.static_range(WS):
        flags = (tl.load(bases_ptr + r) + flag_offset).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(flags + pid * WS + RANK, c, sem="release", scope="sys")
    mine = (tl.load(bases_ptr + RANK) + flag_offset).to(tl.pointer_type(tl.int32)) + pid * WS
    for r in tl.static_range(WS):
        seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
        while seen - c < 0:  # int32 wrap-around: a peer is at most one call ahead
            seen = tl.atomic_add(mine + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _slot(bases_ptr, rank, src, pid, DATA_OFFSET: tl.constexpr, half, SLOT: tl.constexpr,
          P: tl.constexpr, dtype: tl.constexpr):
    """Slot ``(src, pid)`` of ``rank``'s data half at element offset ``half``."""
    base = tl.load(bases_ptr + rank) + DATA_OFFSET
    return base.to(tl.pointer_type(dtype)) + half + (src * P + pid) * SLOT


@triton.jit
def _peer_all_reduce_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bases_ptr, counter_ptr,
    M, N, eps, stride_x, stride_res, stride_out, stride_res_out,
    DATA_OFFSET: tl.constexpr, HALF: tl.constexpr, SLOT: tl.constexpr, P: tl.constexpr,
    FLAGS_B: tl.constexpr, RANK: tl.constexpr, WS: tl.constexpr, TWO_SHOT: tl.constexpr,
    NORM: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    c = tl.load(counter_ptr + pid) + 1
    half = (c & 1).to(tl.int64) * HALF  # a slot's j-th row (row pid + j * G) sits at j * N
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    part = tl.cdiv(N, WS)
    share = cols // part  # the rank that reduces each column (two-shot)
    for row in range(pid, M, G):
        v = tl.load(x_ptr + row * stride_x + cols, mask=mask)
        at = (row // G) * N + cols
        for r in tl.static_range(WS):
            dst = _slot(bases_ptr, r, RANK, pid, DATA_OFFSET, half, SLOT, P, dtype)
            if TWO_SHOT:
                tl.store(dst + at, v, mask=mask & (share == r))
            else:
                tl.store(dst + at, v, mask=mask)
    _barrier(bases_ptr, 0, pid, c, RANK, WS)
    if TWO_SHOT:
        mine = mask & (share == RANK)
        for row in range(pid, M, G):
            at = (row // G) * N + cols
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for src in tl.static_range(WS):
                slot = _slot(bases_ptr, RANK, src, pid, DATA_OFFSET, half, SLOT, P, dtype)
                acc += tl.load(slot + at, mask=mine, other=0.0).to(tl.float32)
            for r in tl.static_range(WS):
                dst = _slot(bases_ptr, r, RANK, pid, DATA_OFFSET, half, SLOT, P, dtype)
                tl.store(dst + at, acc.to(dtype), mask=mine)
        _barrier(bases_ptr, FLAGS_B, pid, c, RANK, WS)
    for row in range(pid, M, G):
        at = (row // G) * N + cols
        if TWO_SHOT:
            # Each column's sum sits in the slot of the rank that reduced it.
            local = _slot(bases_ptr, RANK, 0, pid, DATA_OFFSET, half, SLOT, P, dtype)
            s = tl.load(local + share * (P * SLOT) + at, mask=mask).to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for src in tl.static_range(WS):
                slot = _slot(bases_ptr, RANK, src, pid, DATA_OFFSET, half, SLOT, P, dtype)
                acc += tl.load(slot + at, mask=mask).to(tl.float32)
            # Rounded to x's dtype first: the reduced tensor NCCL would hand back.
            s = acc.to(dtype).to(tl.float32)
        if NORM:
            norm_dtype = res_out_ptr.dtype.element_ty
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
            h = (s + r).to(norm_dtype)
            tl.store(res_out_ptr + row * stride_res_out + cols, h, mask=mask)
            hf = h.to(tl.float32)
            rstd = tl.math.rsqrt(tl.sum(hf * hf, axis=0) / N + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = (hf * rstd).to(norm_dtype).to(tl.float32) * w
            tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptr + row * stride_out + cols, s.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(counter_ptr + pid, c)


def fits(buffers: PeerBuffers, x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (of its last dim) fit the programs' slots and one program's row."""
    if x.dim() == 0 or x.numel() == 0 or x.stride(-1) != 1:
        return False
    n = x.shape[-1]
    rows_per_program = -(-(x.numel() // n) // buffers.programs)
    return 0 < n <= MAX_ROW and rows_per_program * n * x.element_size() <= buffers.slot_bytes


def peer_all_reduce(buffers: PeerBuffers, x: torch.Tensor, out: torch.Tensor, *,
                    two_shot: bool = False, residual: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual_out: torch.Tensor | None = None) -> None:
    """``out = sum of x over the ranks`` through peer memory, or with ``residual`` / ``weight``
    the fused ``residual_out = sum + residual; out = rms_norm(residual_out) * weight``.

    Args:
        buffers: the group's peer memory (:class:`PeerBuffers`).
        x: ``[M, N]`` this rank's partial result, last dim contiguous (read only).
        out: ``[M, N]`` result; may alias ``x`` only without the norm.
        two_shot: reduce 1/world_size of the columns per rank and push them (larger messages).
        residual, weight, eps, residual_out: the fused add + RMSNorm (all or none).
    Raises:
        ValueError: a message that does not fit (:func:`fits`) or mismatched shapes.
    """
    if not fits(buffers, x):
        raise ValueError(f"peer_all_reduce: {tuple(x.shape)} {x.dtype} does not fit "
                         f"{buffers.programs} slots of {buffers.slot_bytes} bytes (rows up to "
                         f"{MAX_ROW})")
    x2 = x.reshape(-1, x.shape[-1])
    out2 = out.view(-1, x.shape[-1])
    m, n = x2.shape
    norm = residual is not None
    if norm:
        if weight is None or residual_out is None:
            raise ValueError("peer_all_reduce: the fused norm needs residual, weight and "
                             "residual_out")
        res2 = residual.reshape(m, n)
        res_out2 = residual_out.view(m, n)
    else:
        res2 = res_out2 = out2
        weight = out2
    block_n = triton.next_power_of_2(n)
    ws = buffers.world_size
    flags_b = buffers.programs * ws * 4
    # Rows are dealt round-robin over `programs`; fewer rows launch fewer programs.
    _peer_all_reduce_kernel[(min(buffers.programs, m),)](
        x2, res2, weight, out2, res_out2, buffers.bases, buffers.counters,
        m, n, float(eps), x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        DATA_OFFSET=buffers.data_offset, HALF=buffers.half_bytes // x.element_size(),
        SLOT=buffers.slot_bytes // x.element_size(), P=buffers.programs,
        FLAGS_B=flags_b, RANK=buffers.rank, WS=ws, TWO_SHOT=two_shot, NORM=norm,
        BLOCK_N=block_n,
        num_warps=4 if block_n <= 4096 else 8, **pdl_kwargs(out),
    )  # fmt: skip
