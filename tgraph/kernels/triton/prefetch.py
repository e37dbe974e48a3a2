"""L2 prefetch of weights: start streaming a later kernel's weights into L2 while latency-bound
kernels run.

A decode step at batch 1 alternates between kernels that stream a large weight at HBM bandwidth
(gate|up, down) and kernels whose time is latency, not bytes (q/k/v of a small model, attention,
its reduce, o): during the latter HBM sits mostly idle. A prefetch launched at the start of the
latency-bound stretch asks the memory system to bring the following weights into L2 (Hopper's
``cp.async.bulk.prefetch.L2``: one instruction per chunk, executed by the copy engine, nothing
returned to the SM), so the bandwidth-bound kernels after it read L2 instead of HBM.

A prefetch kernel lasts until its bytes have arrived (~7 us for 26 MB on an H100), so nothing in
the step's chain of PDL launches may wait for it: :func:`prefetch_ahead` launches it on a side
stream (:mod:`tgraph.kernels.side_streams`) that the step joins at its end. A prefetch is a
hint: off Hopper, under the Triton interpreter, or for a weight that is not contiguous, nothing
is launched and the results are the same.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tgraph import envs
from tgraph.quant import QuantizedWeight
from tgraph.tuning import PrefetchTuning

__all__ = ["prefetch_l2", "prefetch_ahead", "select_ahead", "prefetch_supported", "CHUNK_BYTES",
           "CHUNKS_PER_PROGRAM"]

# Bytes per prefetch instruction and instructions per program (one per thread of one warp).
# Many programs spread the requests over many SMs' copy engines.
CHUNK_BYTES = 16384
CHUNKS_PER_PROGRAM = 32
_MAX_WEIGHTS = 4
_ALIGN = 16  # the instruction wants 16-byte aligned addresses and sizes


@triton.jit
def _prefetch_range(base, nbytes, chunk0, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    offs = (chunk0 + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    size = (size // 16) * 16
    # A zero size issues nothing (the predicate), so ragged tails need no mask.
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(w0, n0, w1, n1, w2, n2, w3, n3, programs0, programs1, programs2,
                     NUM: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # Programs are laid out weight after weight: [0, programs0) for w0, then w1, ...
    pid = tl.program_id(0)
    if pid < programs0:
        _prefetch_range(w0, n0, pid * BLOCK, CHUNK, BLOCK)
    elif NUM > 1 and pid < programs1:
        _prefetch_range(w1, n1, (pid - programs0) * BLOCK, CHUNK, BLOCK)
    elif NUM > 2 and pid < programs2:
        _prefetch_range(w2, n2, (pid - programs1) * BLOCK, CHUNK, BLOCK)
    elif NUM > 3:
        _prefetch_range(w3, n3, (pid - programs2) * BLOCK, CHUNK, BLOCK)


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def prefetch_supported(t: torch.Tensor) -> bool:
    """Whether :func:`prefetch_l2` launches anything for tensors on ``t``'s device."""
    if not t.is_cuda or envs.TRITON_INTERPRET:
        return False
    return _device_supports(t.device.index or 0)


def _byte_view(w: torch.Tensor) -> torch.Tensor | None:
    """``w``'s bytes from its first 16-byte aligned address, or None if it is not contiguous."""
    if not w.is_contiguous() or w.numel() == 0:
        return None
    flat = w.reshape(-1).view(torch.uint8)
    skip = (-w.data_ptr()) % _ALIGN
    return flat[skip:] if flat.numel() > skip else None


def prefetch_l2(*weights: torch.Tensor) -> int:
    """Ask L2 to fetch ``weights`` (up to four tensors on one CUDA device) from a kernel on the
    current stream; returns the programs launched (0 where prefetching is unsupported, see the
    module docstring).

    The launch is asynchronous and nothing waits for the bytes: a later kernel that reads them
    finds them in L2, or in flight, or (if evicted meanwhile) in HBM.
    """
    if not weights:
        return 0
    if len(weights) > _MAX_WEIGHTS:
        raise ValueError(f"prefetch_l2: at most {_MAX_WEIGHTS} weights per launch, "
                         f"got {len(weights)}")
    device = weights[0].device
    if any(w.device != device for w in weights):
        raise ValueError("prefetch_l2: all weights must be on one device, got "
                         f"{sorted({str(w.device) for w in weights})}")
    if not prefetch_supported(weights[0]):
        return 0
    views = [v for v in (_byte_view(w) for w in weights) if v is not None]
    if not views:
        return 0
    per_program = CHUNK_BYTES * CHUNKS_PER_PROGRAM
    ends, total = [], 0
    for v in views:
        total += triton.cdiv(v.numel(), per_program)
        ends.append(total)
    args: list = []
    for i in range(_MAX_WEIGHTS):
        v = views[min(i, len(views) - 1)]
        args += [v, v.numel() if i < len(views) else 0]
    bounds = (ends + [total] * _MAX_WEIGHTS)[:3]
    with torch.cuda.device(device):
        _prefetch_kernel[(total,)](*args, *bounds, NUM=len(views), CHUNK=CHUNK_BYTES,
                                   BLOCK=CHUNKS_PER_PROGRAM, num_warps=1)
    return total


@functools.cache
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))


def _leading_rows(w: torch.Tensor, nbytes: int, halves: int) -> list[torch.Tensor]:
    """The first rows of ``w`` (of each of its ``halves``) that fit ``nbytes`` in all."""
    rows = w.shape[0] // halves
    row_bytes = w[0].numel() * w.element_size()
    take = min(rows, nbytes // max(row_bytes * halves, 1))
    if take <= 0:
        return []
    return [w[h * rows:h * rows + take] for h in range(halves)]


def select_ahead(x: torch.Tensor, weights: tuple[torch.Tensor, ...], halves: tuple[int, ...],
                 budget: int) -> list[torch.Tensor]:
    """The tensors :func:`prefetch_ahead` asks for: ``weights`` in order, whole or their leading
    rows, at most ``budget`` bytes and :data:`_MAX_WEIGHTS` tensors, stopping at a weight that is
    not on ``x``'s device. ``halves[i] == 2`` marks a packed gate|up weight: its prefix is taken
    from both halves, the rows a gated linear's first programs read."""
    left = budget
    parts: list[torch.Tensor] = []
    for w, h in zip(weights, halves):
        if left <= 0 or w.device != x.device:
            break
        if isinstance(w, QuantizedWeight):  # its packed codes, row for row (scales are small)
            w = w.qdata
        taken = _leading_rows(w, left, h)[:_MAX_WEIGHTS - len(parts)]
        parts += taken
        left -= sum(t.numel() * t.element_size() for t in taken)
    return parts


def prefetch_ahead(x: torch.Tensor, weights: tuple[torch.Tensor, ...], halves: tuple[int, ...],
                   tuning: PrefetchTuning) -> int:
    """Prefetch ``weights`` (see :func:`select_ahead`) up to ``tuning.l2_fraction`` of L2, on the
    side stream of ``x``'s device (:mod:`tgraph.kernels.side_streams`), when ``x`` has at most
    ``tuning.max_rows`` rows; returns the bytes asked for (0 when nothing is launched)."""
    if x.dim() == 0 or x.shape[0] > tuning.max_rows or not prefetch_supported(x):
        return 0
    budget = int(tuning.l2_fraction * _l2_bytes(x.device.index or 0))
    parts = select_ahead(x, weights, halves, budget)
    if not parts:
        return 0
    from tgraph.kernels.side_streams import forked

    with forked(x.device):
        prefetch_l2(*parts)
    return sum(t.numel() * t.element_size() for t in parts)
