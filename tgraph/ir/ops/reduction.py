"""Reductions over one or more dims, and softmax."""
from __future__ import annotations

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_float
from tgraph.ir.shape import normalize_dim


def _dims(dim: int | tuple[int, ...], rank: int | None) -> tuple[int, ...]:
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return tuple(sorted(normalize_dim(d, rank) for d in dims))


def _reduce_shape(x: Meta, dim, keepdim: bool):
    if x.shape is None:
        return None
    dims = _dims(dim, len(x.shape))
    if keepdim:
        return tuple(1 if i in dims else d for i, d in enumerate(x.shape))
    return tuple(d for i, d in enumerate(x.shape) if i not in dims)


def _sum_infer(x: Meta, *, dim, keepdim: bool = False) -> Meta:
    dtype = x.dtype
    if dtype is not None and not dtype.is_floating_point:
        dtype = torch.int64
    return Meta(_reduce_shape(x, dim, keepdim), dtype)


def _mean_infer(x: Meta, *, dim, keepdim: bool = False) -> Meta:
    require_float(x, "mean input")
    return Meta(_reduce_shape(x, dim, keepdim), x.dtype)


def _amax_infer(x: Meta, *, dim, keepdim: bool = False) -> Meta:
    return Meta(_reduce_shape(x, dim, keepdim), x.dtype)


register_op("sum", infer=_sum_infer, category=OpCategory.REDUCTION,
            reference=lambda x, *, dim, keepdim=False: torch.sum(x, dim, keepdim=keepdim))
register_op("mean", infer=_mean_infer, category=OpCategory.REDUCTION,
            reference=lambda x, *, dim, keepdim=False: torch.mean(x, dim, keepdim=keepdim))
register_op("amax", infer=_amax_infer, category=OpCategory.REDUCTION,
            reference=lambda x, *, dim, keepdim=False: torch.amax(x, dim, keepdim=keepdim))


def _softmax_infer(x: Meta, *, dim: int = -1) -> Meta:
    require(not x.scalar, "softmax needs a tensor")
    require_float(x, "softmax input")
    if x.shape is not None:  # with an unknown rank, the dim is checked at bind time
        normalize_dim(dim, len(x.shape))
    return Meta(x.shape, x.dtype)


register_op("softmax", infer=_softmax_infer, category=OpCategory.REDUCTION,
            reference=lambda x, *, dim=-1: torch.softmax(x.float(), dim).to(x.dtype))
