"""Triton-backend wrappers of the collective ops: they write into the engine's planned buffers.

``torch.distributed`` collectives work in place, so each wrapper moves the data into its output
buffer once (or reuses a dead input) and reduces or gathers there; the references instead clone,
collect and are then copied into the buffer. ``all_reduce_add_rms_norm`` reduces, then runs the
Triton ``add_rms_norm`` kernel on the reduced buffer: the add and the norm follow the collective
with no copy kernel in between when the pass marked ``x`` as dead afterwards.

On NCCL these launches are enqueued on the current stream and may be captured in a CUDA graph
(nodes with ``capturable=True``); gloo runs them on the host. Decode-sized all-reduces on one
host go over peer memory instead (:mod:`tgraph.kernels.triton.peer_allreduce`, one kernel with
the add + norm fused; ``llm.engine.tuning.all_reduce``), NCCL staying the fallback.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tgraph.ir.ops.collective import check_group_size
from tgraph.kernels.registry import KernelSpec
from tgraph.kernels.triton.peer_allreduce import (
    PeerBuffers,
    fits,
    fits_polled,
    peer_all_reduce,
)
from tgraph.kernels.triton_backend.common import Outs, reference_into, rows
from tgraph.kernels.triton_backend.peer_memory import path_for, peer_buffers
from tgraph.tuning import Tuning

__all__ = ["KERNELS", "all_gather_into", "all_reduce_add_rms_norm_into", "all_reduce_into"]


def _peer_route(x: torch.Tensor, tuning: Tuning) -> tuple[PeerBuffers | None, str]:
    """``(buffers, path)`` when ``x`` goes over peer memory (:func:`path_for`), else
    ``(None, "nccl")``."""
    path = path_for(x.numel() * x.element_size(), tuning.all_reduce)
    if path == "nccl":
        return None, path
    buffers = peer_buffers(x, tuning.all_reduce)
    if buffers is not None and path == "polled" and not fits_polled(buffers, x):
        path = "one-shot"
    if buffers is None or not fits(buffers, x):
        return None, "nccl"
    return buffers, path


def all_reduce_into(outs: Outs, x: torch.Tensor, *, world_size: int, tuning: Tuning,
                    capturable: bool = False) -> torch.Tensor:
    """``outs[0] = sum of x over the ranks``: over peer memory when small (one kernel), else one
    copy into the buffer reduced in place by NCCL.

    Args:
        outs: one buffer of ``x``'s shape and dtype.
        x: this rank's partial result (left unchanged: other nodes may still read it).
        world_size: the group size recorded on the node (checked against the live group).
        tuning: the engine's settings (``all_reduce``: the peer-memory path).
        capturable: unused here (it only steers partitioning).
    Returns:
        ``outs[0]``.
    """
    check_group_size("all_reduce", world_size)
    out = outs[0]
    buffers, path = _peer_route(x, tuning)
    if buffers is not None and out.is_contiguous():
        peer_all_reduce(buffers, x, out, two_shot=path == "two-shot", polled=path == "polled")
        return out
    out.copy_(x)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather_into(outs: Outs, x: torch.Tensor, *, dim: int, world_size: int,
                    capturable: bool = False) -> torch.Tensor:
    """``outs[0] = cat(every rank's x, dim)``, gathered straight into the buffer when ``dim`` is
    the leading dim, else into a ``[world_size, *x.shape]`` scratch then laid out along ``dim``.

    Args:
        outs: one buffer of the gathered shape.
        x: this rank's slice.
        dim: the concatenation dim (may be negative).
        world_size: the group size recorded on the node.
        capturable: unused here (it only steers partitioning).
    Returns:
        ``outs[0]``.
    """
    check_group_size("all_gather", world_size)
    out = outs[0]
    x = x.contiguous()
    d = dim % x.dim()
    # [ws, *x.shape] in rank order; for d == 0 that is exactly the output's memory.
    stacked_shape = (world_size, *x.shape)
    leading = d == 0 and out.is_contiguous()
    stacked = out.view(stacked_shape) if leading else torch.empty(
        stacked_shape, dtype=x.dtype, device=x.device)
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(stacked, x)
    else:
        # gloo: the list form, writing into contiguous views of the stacked buffer.
        dist.all_gather(list(stacked.unbind(0)), x)
    if not leading:
        # out viewed as [..., ws, x.shape[d], ...] takes the rank dim right before d.
        split = (*x.shape[:d], world_size, x.shape[d], *x.shape[d + 1:])
        out.view(split).copy_(stacked.movedim(0, d))
    return out


def all_reduce_add_rms_norm_into(outs: Outs, x: torch.Tensor, residual: torch.Tensor,
                                 weight: torch.Tensor, *, eps: float, world_size: int,
                                 tuning: Tuning, capturable: bool = False,
                                 reduce_in_place: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x``, then add the residual and RMS-normalise: over peer memory in one kernel
    when small, else NCCL in place and the Triton ``add_rms_norm`` on the reduced buffer.

    Args:
        outs: ``[normed, new_residual]`` buffers of ``x``'s shape.
        x: this rank's partial result ``[..., N]``.
        residual: the residual stream ``[..., N]``.
        weight: the norm's ``[N]`` scale.
        eps: the norm's epsilon.
        world_size: the group size recorded on the node.
        tuning: the engine's settings (``all_reduce``: the peer-memory path).
        capturable: unused here (it only steers partitioning).
        reduce_in_place: the pass found that nothing reads ``x`` after this node, so its buffer
            is reduced in place; otherwise ``x`` is first copied into the new-residual buffer
            (which the norm kernel may then update in place).
    Returns:
        ``(normed, new_residual)``: ``outs[0]`` and ``outs[1]``.
    """
    op = "all_reduce_add_rms_norm"
    check_group_size(op, world_size)
    out, residual_out = outs
    if weight.dtype != x.dtype:
        return reference_into(op)(outs, x, residual, weight, eps=eps,
                                        world_size=world_size)
    buffers, path = _peer_route(x, tuning)
    if buffers is not None and out.is_contiguous() and residual_out.is_contiguous():
        peer_all_reduce(buffers, x, out, two_shot=path == "two-shot", polled=path == "polled",
                        residual=residual, weight=weight, eps=eps, residual_out=residual_out)
        return out, residual_out
    if reduce_in_place and x.is_contiguous():
        reduced = x
    else:
        residual_out.copy_(x)
        reduced = residual_out
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    from tgraph.kernels.triton.norms import add_rms_norm

    n = x.shape[-1]
    # residual_out may alias the kernel's x (the copy path): each row is read before written.
    add_rms_norm(rows(reduced), rows(residual), weight, eps, out.view(-1, n),
                 residual_out.view(-1, n))
    return out, residual_out


KERNELS = (
    KernelSpec("all_reduce", all_reduce_into, tuned=True),
    KernelSpec("all_gather", all_gather_into),
    KernelSpec("all_reduce_add_rms_norm", all_reduce_add_rms_norm_into, tuned=True),
)
