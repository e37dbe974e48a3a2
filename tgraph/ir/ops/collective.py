"""Collective ops for tensor parallelism: ``all_reduce`` (sum) and ``all_gather`` (along a dim).

The references call ``torch.distributed`` on the default process group (NCCL on GPU, gloo on
CPU), so the same graph runs in ``eager`` mode, on the CPU backend and as the fallback of the
Triton backend. Each node stores the group size it was recorded for (``world_size``): the shape
rule of ``all_gather`` needs it, and the references refuse to run in a group of another size
instead of silently producing a tensor of the wrong width.

Collectives are never removed or merged by the clean-up passes (``OpDef.has_side_effects``) and,
unless a node sets ``capturable=True``, the partitioner gives each one a host segment of its own
so that it runs outside CUDA graphs.

``all_reduce_add_rms_norm`` is the fused op the ``AllReduceAddRmsNorm`` pass introduces for the
tensor-parallel block boundary (``all_reduce`` of a row-parallel output, the residual add and the
next RMSNorm). It is a collective too: same side effects, same host segment unless capturable.

NOTE: ``reduce_scatter`` is not defined: no layer needs it yet, and gloo (the CPU backend the
tests run on) does not implement it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tgraph.ir.ops.fused import add_rms_norm_infer, add_rms_norm_reference
from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require
from tgraph.ir.shape import normalize_dim


def _check_world_size(world_size: object, op: str) -> None:
    require(isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1,
            f"{op}: world_size must be a positive int, got {world_size!r}")


def _check_tensor(x: Meta, op: str) -> None:
    require(not x.scalar, f"{op} needs a tensor, got a scalar")
    if x.dtype is not None:
        require(x.dtype != torch.bool, f"{op} cannot reduce or gather bool tensors, got {x}")


def _all_reduce_infer(x: Meta, *, world_size: int, capturable: bool = False) -> Meta:
    _check_tensor(x, "all_reduce")
    _check_world_size(world_size, "all_reduce")
    return Meta(x.shape, x.dtype)


def _all_gather_infer(x: Meta, *, dim: int, world_size: int, capturable: bool = False) -> Meta:
    _check_tensor(x, "all_gather")
    _check_world_size(world_size, "all_gather")
    if x.shape is None:
        # The dim is checked at bind time, when the rank is known.
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape))
    size = x.shape[d]
    shape = list(x.shape)
    # A symbolic gathered dim has no name for "world_size x symbol": it stays unknown until
    # the engine binds it (the rule runs again with ints then).
    shape[d] = size * world_size if isinstance(size, int) else None
    return Meta(tuple(shape), x.dtype)


def check_group_size(op: str, world_size: int) -> None:
    """Refuse to run when there is no process group or it is not the one recorded for."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{op}: torch.distributed is not initialized; call "
                           "tgraph.nn.distributed.init_process_group() in every rank first "
                           "(launch with torchrun)")
    actual = dist.get_world_size()
    if actual != world_size:
        raise RuntimeError(f"{op} was recorded for world size {world_size} but the process group "
                           f"has {actual} ranks")


def _all_reduce_ref(x: torch.Tensor, *, world_size: int, capturable: bool = False
                    ) -> torch.Tensor:
    check_group_size("all_reduce", world_size)
    # NOTE: torch's all_reduce works in place; the input may still be read by other nodes.
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def _all_gather_ref(x: torch.Tensor, *, dim: int, world_size: int, capturable: bool = False
                    ) -> torch.Tensor:
    check_group_size("all_gather", world_size)
    x = x.contiguous()
    # The list form works on every backend (gloo has no all_gather_into_tensor everywhere).
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)


register_op("all_reduce", infer=_all_reduce_infer, reference=_all_reduce_ref,
            category=OpCategory.COLLECTIVE,
            doc="Sum of the input over every rank of the default process group.")
register_op("all_gather", infer=_all_gather_infer, reference=_all_gather_ref,
            category=OpCategory.COLLECTIVE,
            doc="Every rank's input concatenated along ``dim`` in rank order.")


def _all_reduce_add_rms_norm_infer(x: Meta, residual: Meta, weight: Meta, *, eps: float,
                                   world_size: int, capturable: bool = False,
                                   reduce_in_place: bool = False) -> tuple[Meta, Meta]:
    _check_tensor(x, "all_reduce_add_rms_norm")
    _check_world_size(world_size, "all_reduce_add_rms_norm")
    return add_rms_norm_infer(x, residual, weight, eps=eps)


def _all_reduce_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 *, eps: float, world_size: int, capturable: bool = False,
                                 reduce_in_place: bool = False
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    # The composition of the unfused references, so fused == unfused exactly on this backend.
    # ``reduce_in_place`` only tells fast kernels that ``x`` is dead afterwards; the reference
    # never writes its inputs.
    reduced = _all_reduce_ref(x, world_size=world_size)
    return add_rms_norm_reference(reduced, residual, weight, eps=eps)


register_op("all_reduce_add_rms_norm", infer=_all_reduce_add_rms_norm_infer,
            reference=_all_reduce_add_rms_norm_ref, category=OpCategory.COLLECTIVE,
            doc="(rms_norm(all_reduce(x) + residual) * weight, all_reduce(x) + residual): the "
                "tensor-parallel block boundary in one op")
