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

Small one-shot messages skip the flags (:func:`peer_all_reduce` with ``lamport``): three more
buffers start filled with negative zeros, a rank pushes its rows with every negative zero made
positive, and the receiver polls its local slots until no negative zero is left, so the data
itself says it has arrived (no release/acquire round trip). A program clears what it read in its
previous call, which no peer writes again before this program's next call has pushed its own
rows (a kernel later, so the clearing stores are complete).

Each rank must launch the kernel the same number of times with the same grid (the engine's
ranks run the same graphs), and all ranks must reach it: like NCCL, a missing rank hangs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tgraph.kernels.triton.pdl import pdl_kwargs, pdl_wait

__all__ = ["MAX_ROW", "PeerBuffers", "fill_polled", "fits", "fits_polled", "peer_all_reduce"]

# The longest row one program sums from registers (the fused norm needs the whole row).
MAX_ROW = 16384
# The integer view of each dtype and its negative zero: "not arrived yet" in a polled buffer.
_BITS = {torch.bfloat16: (tl.int16, -(1 << 15)), torch.float16: (tl.int16, -(1 << 15)),
         torch.float32: (tl.int32, -(1 << 31))}


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
        lamport_offset: byte offset of the first of the three polled buffers.
        lamport_bytes: bytes of one polled buffer (0: none).
        lamport_itemsize: the element size their negative zeros were written for.
        lamport_state: int32 ``[2, programs]``: each program's last polled buffer and the
            elements it filled in each of its slots there.
    """

    bases: torch.Tensor
    counters: torch.Tensor
    rank: int
    world_size: int
    programs: int
    data_offset: int
    half_bytes: int
    lamport_offset: int = 0
    lamport_bytes: int = 0
    lamport_itemsize: int = 2
    lamport_state: torch.Tensor | None = None

    @property
    def slot_bytes(self) -> int:
        """Bytes of one (source rank, program) slot in a data half."""
        return self.half_bytes // (self.programs * self.world_size) // 16 * 16

    @property
    def lamport_slot_bytes(self) -> int:
        """Bytes of one (source rank, program) slot in a polled buffer."""
        return self.lamport_bytes // (self.programs * self.world_size) // 16 * 16

    @staticmethod
    def layout(world_size: int, programs: int, half_bytes: int,
               lamport_bytes: int = 0) -> tuple[int, int, int]:
        """``(data_offset, lamport_offset, total_bytes)`` of the buffer every rank allocates."""
        flags = 2 * programs * world_size * 4
        data_offset = -(-flags // 256) * 256  # 256-byte aligned rows for wide loads
        lamport_offset = data_offset + 2 * half_bytes
        return data_offset, lamport_offset, lamport_offset + 3 * lamport_bytes


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
def _epilogue(s, row, cols, mask, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps, stride_res,
              stride_out, stride_res_out, NORM: tl.constexpr):
    """Store the reduced row ``s`` (fp32 of x's dtype), or the residual add + RMSNorm on it."""
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


@triton.jit
def _lamport_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bases_ptr, state_ptr,
    M, N, eps, stride_x, stride_res, stride_out, stride_res_out,
    OFFSET: tl.constexpr, BUF: tl.constexpr, SLOT: tl.constexpr, P: tl.constexpr,
    RANK: tl.constexpr, WS: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, SENTINEL: tl.constexpr, PDL: tl.constexpr,
):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    dtype = x_ptr.dtype.element_ty
    prev = tl.load(state_ptr + pid)
    buf = (prev + 1) % 3
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    for row in range(pid, M, G):
        v = tl.load(x_ptr + row * stride_x + cols, mask=mask).to(BITS, bitcast=True)
        v = tl.where(v == SENTINEL, 0, v)  # -0.0 -> +0.0: a negative zero means "not yet"
        at = (row // G) * N + cols
        for r in tl.static_range(WS):
            base = (tl.load(bases_ptr + r) + OFFSET).to(tl.pointer_type(BITS))
            tl.store(base + buf * BUF + (RANK * P + pid) * SLOT + at, v, mask=mask)
    mine = (tl.load(bases_ptr + RANK) + OFFSET).to(tl.pointer_type(BITS))
    # Clear what this program read in its previous call (its rows times N in each slot).
    used = tl.load(state_ptr + P + pid)
    for src in tl.static_range(WS):
        old = mine + prev * BUF + (src * P + pid) * SLOT
        for start in range(0, used, BLOCK_N):
            tl.store(old + start + cols, tl.full([BLOCK_N], SENTINEL, BITS),
                     mask=start + cols < used)
    for row in range(pid, M, G):
        at = (row // G) * N + cols
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for src in tl.static_range(WS):
            ptrs = mine + buf * BUF + (src * P + pid) * SLOT + at
            v = tl.load(ptrs, mask=mask, other=0, volatile=True)
            while tl.max((v == SENTINEL).to(tl.int32), axis=0) > 0:
                v = tl.load(ptrs, mask=mask, other=0, volatile=True)
            acc += v.to(dtype, bitcast=True).to(tl.float32)
        # Rounded to x's dtype first: the reduced tensor NCCL would hand back.
        _epilogue(acc.to(dtype).to(tl.float32), row, cols, mask, res_ptr, w_ptr, out_ptr,
                  res_out_ptr, N, eps, stride_res, stride_out, stride_res_out, NORM)
    tl.store(state_ptr + pid, buf)
    tl.store(state_ptr + P + pid, tl.cdiv(M - pid, G) * N)


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
        _epilogue(s, row, cols, mask, res_ptr, w_ptr, out_ptr, res_out_ptr, N, eps, stride_res,
                  stride_out, stride_res_out, NORM)
    tl.store(counter_ptr + pid, c)


def _slot_need(buffers: PeerBuffers, x: torch.Tensor) -> int:
    """Bytes ``x`` needs in one slot (0: rows that do not suit the kernel)."""
    if x.dim() == 0 or x.numel() == 0 or x.stride(-1) != 1 or not 0 < x.shape[-1] <= MAX_ROW:
        return 0
    n = x.shape[-1]
    return -(-(x.numel() // n) // buffers.programs) * n * x.element_size()


def fits(buffers: PeerBuffers, x: torch.Tensor) -> bool:
    """Whether ``x``'s rows (of its last dim) fit the programs' slots and one program's row."""
    return 0 < _slot_need(buffers, x) <= buffers.slot_bytes


def fits_polled(buffers: PeerBuffers, x: torch.Tensor) -> bool:
    """Whether ``x`` fits the polled (flagless one-shot) buffers."""
    return (x.element_size() == buffers.lamport_itemsize and x.dtype in _BITS
            and 0 < _slot_need(buffers, x) <= buffers.lamport_slot_bytes)


def peer_all_reduce(buffers: PeerBuffers, x: torch.Tensor, out: torch.Tensor, *,
                    two_shot: bool = False, polled: bool = False,
                    residual: torch.Tensor | None = None,
                    weight: torch.Tensor | None = None, eps: float = 0.0,
                    residual_out: torch.Tensor | None = None) -> None:
    """``out = sum of x over the ranks`` through peer memory, or with ``residual`` / ``weight``
    the fused ``residual_out = sum + residual; out = rms_norm(residual_out) * weight``.

    Args:
        buffers: the group's peer memory (:class:`PeerBuffers`).
        x: ``[M, N]`` this rank's partial result, last dim contiguous (read only).
        out: ``[M, N]`` result; may alias ``x`` only without the norm.
        two_shot: reduce 1/world_size of the columns per rank and push them (larger messages).
        polled: one-shot through the polled buffers, without flags (:func:`fits_polled`).
        residual, weight, eps, residual_out: the fused add + RMSNorm (all or none).
    Raises:
        ValueError: a message that does not fit (:func:`fits`) or mismatched shapes.
    """
    if not (fits_polled if polled else fits)(buffers, x):
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
    num_warps = 4 if block_n <= 4096 else 8
    if polled:
        bits, sentinel = _BITS[x.dtype]
        es = x.element_size()
        _lamport_kernel[(min(buffers.programs, m),)](
            x2, res2, weight, out2, res_out2, buffers.bases, buffers.lamport_state,
            m, n, float(eps), x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
            OFFSET=buffers.lamport_offset, BUF=buffers.lamport_bytes // es,
            SLOT=buffers.lamport_slot_bytes // es, P=buffers.programs, RANK=buffers.rank,
            WS=ws, NORM=norm, BLOCK_N=block_n, BITS=bits, SENTINEL=sentinel,
            num_warps=num_warps, **pdl_kwargs(out),
        )  # fmt: skip
        return
    flags_b = buffers.programs * ws * 4
    # Rows are dealt round-robin over `programs`; fewer rows launch fewer programs.
    _peer_all_reduce_kernel[(min(buffers.programs, m),)](
        x2, res2, weight, out2, res_out2, buffers.bases, buffers.counters,
        m, n, float(eps), x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
        DATA_OFFSET=buffers.data_offset, HALF=buffers.half_bytes // x.element_size(),
        SLOT=buffers.slot_bytes // x.element_size(), P=buffers.programs,
        FLAGS_B=flags_b, RANK=buffers.rank, WS=ws, TWO_SHOT=two_shot, NORM=norm,
        BLOCK_N=block_n, num_warps=num_warps, **pdl_kwargs(out),
    )  # fmt: skip


def fill_polled(buffer: torch.Tensor, buffers: PeerBuffers) -> None:
    """Write the "not arrived" negative zeros of ``buffers.lamport_itemsize``-byte elements over
    the three polled buffers of this rank's ``buffer`` (uint8, the whole allocation)."""
    region = buffer[buffers.lamport_offset:buffers.lamport_offset + 3 * buffers.lamport_bytes]
    if buffers.lamport_itemsize == 4:
        region.view(torch.int32).fill_(-(1 << 31))
    else:
        region.view(torch.int16).fill_(-(1 << 15))
