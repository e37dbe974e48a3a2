"""The peer memory the P2P all-reduce reads (:mod:`tgraph.kernels.triton.peer_allreduce`): one
buffer per (device, group, size), allocated through torch's symmetric memory and mapped into
every rank of the group, made the first time an eligible all-reduce runs outside a capture.

Eligible: NCCL on CUDA, every rank of the group on this host with peer access to every other
rank's GPU, and torch's symmetric memory available. The ranks agree on that (one NCCL min over
their checks) before any of them allocates, so either all use peer memory or all keep NCCL.
NVLink multicast is never used (the kernel only loads and stores through peer mappings), so
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` changes nothing here.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from tgraph.kernels.triton.peer_allreduce import PeerBuffers, fill_polled
from tgraph.nn.distributed import env_info
from tgraph.tuning import AllReduceTuning

__all__ = ["path_for", "peer_buffers", "release_peer_buffers"]

log = logging.getLogger(__name__)

# (device index, group name, element size, settings) -> buffers, or None where peer memory is off.
_made: dict[tuple, PeerBuffers | None] = {}
# The symmetric allocations behind the buffers: they must outlive every captured graph using them.
_keep: list[object] = []


def _local_checks(device: torch.device) -> str:
    """Why this rank cannot use peer memory ('' when it can)."""
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"torch's symmetric memory is missing ({e})"
    info = env_info()
    if info.local_world_size != info.world_size:
        return "the ranks span several hosts"
    return ""


def _peer_access(device: torch.device, world_size: int) -> str:
    """Why some pair of the group's GPUs lacks peer access ('' when all have it)."""
    mine = torch.tensor([device.index], dtype=torch.int64, device=device)
    every = torch.empty(world_size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine)
    for other in every.tolist():
        if other != device.index and not torch.cuda.can_device_access_peer(device.index, other):
            return f"GPU {device.index} has no peer access to GPU {other}"
    return ""


def _agree(device: torch.device, ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _create(device: torch.device, tuning: AllReduceTuning, itemsize: int) -> PeerBuffers | None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    why = _local_checks(device)
    if not _agree(device, not why):
        log.info("tensor-parallel all-reduce stays on NCCL: %s", why or "another rank said no")
        return None
    why = _peer_access(device, world_size)
    if not _agree(device, not why):
        log.info("tensor-parallel all-reduce stays on NCCL: %s", why or "another rank said no")
        return None
    from torch.distributed import _symmetric_memory as symm_mem

    largest = max(tuning.one_shot_max_bytes, tuning.two_shot_max_bytes)
    half = -(-largest * world_size // 256) * 256  # every rank's message side by side
    polled = -(-tuning.polled_max_bytes * world_size // 256) * 256
    data_offset, polled_offset, total = PeerBuffers.layout(world_size, tuning.programs, half,
                                                           polled)
    buf = symm_mem.empty(total, dtype=torch.uint8, device=device)
    state = torch.zeros(2, tuning.programs, dtype=torch.int32, device=device)
    counters = torch.zeros(tuning.programs, dtype=torch.int32, device=device)
    buffers = PeerBuffers(torch.zeros(world_size, dtype=torch.int64, device=device), counters,
                          rank, world_size, tuning.programs, data_offset, half, polled_offset,
                          polled, itemsize, state)
    buf.zero_()  # the flags start at 0 on every rank before any peer can raise one
    fill_polled(buf, buffers)
    torch.cuda.synchronize(device)
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    dist.barrier()
    _keep.extend((buf, handle))
    buffers.bases.copy_(torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64))
    log.info("tensor-parallel all-reduce over peer memory: %d ranks, messages up to %d bytes",
             world_size, largest)
    return buffers


def path_for(nbytes: int, tuning: AllReduceTuning) -> str:
    """``"polled"`` (one-shot without flags), ``"one-shot"``, ``"two-shot"`` or ``"nccl"`` for
    a message of ``nbytes`` bytes."""
    if nbytes <= tuning.polled_max_bytes:
        return "polled"
    if nbytes <= tuning.one_shot_max_bytes:
        return "one-shot"
    return "two-shot" if nbytes <= tuning.two_shot_max_bytes else "nccl"


def peer_buffers(x: torch.Tensor, tuning: AllReduceTuning) -> PeerBuffers | None:
    """The group's peer memory for all-reducing ``x``, made on first use; ``None`` keeps NCCL
    (settings off, not NCCL on CUDA, no peer access, or first asked while capturing).

    A collective on first use: every rank must ask at the same point, which the engine's ranks
    do (they run the same graphs, and the first run of each is an uncaptured warm-up).
    """
    if not tuning.peer or not x.is_cuda or not dist.is_initialized():
        return None
    if dist.get_backend() != "nccl" or dist.get_world_size() < 2:
        return None
    key = (x.device.index, dist.group.WORLD.group_name, x.element_size(), tuning.programs,
           tuning.polled_max_bytes, tuning.one_shot_max_bytes, tuning.two_shot_max_bytes)
    if key not in _made:
        if torch.cuda.is_current_stream_capturing():
            return None
        _made[key] = _create(x.device, tuning, x.element_size())
    return _made[key]


def release_peer_buffers() -> None:
    """Forget every group's peer memory (before the process group is destroyed)."""
    _made.clear()
    _keep.clear()
