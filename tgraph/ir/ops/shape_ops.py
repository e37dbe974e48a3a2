"""Shape and memory ops: views (reshape, permute, slice...), split, cat, gather, contiguous."""
from __future__ import annotations

from typing import Any

import torch

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_int
from tgraph.ir.shape import (
    ShapeRuleError,
    dims_conflict,
    format_shape,
    merge_dims,
    normalize_dim,
    reshape_target,
)
from tgraph.quant import is_quantized


def _reshape_infer(x: Meta, *, shape: tuple) -> Meta:
    return Meta(reshape_target(x.shape, tuple(shape)), x.dtype)


register_op("reshape", infer=_reshape_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, shape: x.reshape(shape))


def _permute_infer(x: Meta, *, dims: tuple[int, ...]) -> Meta:
    if x.shape is None:
        return Meta(None, x.dtype)
    rank = len(x.shape)
    norm = [normalize_dim(d, rank) for d in dims]
    require(sorted(norm) == list(range(rank)),
            f"permute dims {tuple(dims)} are not a permutation of {rank} dims")
    return Meta(tuple(x.shape[d] for d in norm), x.dtype)


register_op("permute", infer=_permute_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, dims: x.permute(*dims))


def _transpose_infer(x: Meta, *, dim0: int, dim1: int) -> Meta:
    if x.shape is None:
        return Meta(None, x.dtype)
    rank = len(x.shape)
    a, b = normalize_dim(dim0, rank), normalize_dim(dim1, rank)
    shape = list(x.shape)
    shape[a], shape[b] = shape[b], shape[a]
    return Meta(tuple(shape), x.dtype)


register_op("transpose", infer=_transpose_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, dim0, dim1: x.transpose(dim0, dim1))


def slice_length(size, start: int, end: int | None, step: int):
    """Length of ``range(size)[start:end:step]`` for an int size; symbolic when it stays whole."""
    if isinstance(size, int):
        return len(range(size)[start:end:step])
    if start == 0 and end is None and step == 1:
        return size
    return None


def _slice_infer(x: Meta, *, dim: int, start: int, end: int | None, step: int = 1) -> Meta:
    require(step > 0, f"slice step must be positive, got {step}")
    if x.shape is None:
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape))
    shape = list(x.shape)
    shape[d] = slice_length(shape[d], start, end, step)
    return Meta(tuple(shape), x.dtype)


def _slice_ref(x, *, dim, start, end, step=1):
    index = [slice(None)] * x.dim()
    index[dim] = slice(start, end, step)
    return x[tuple(index)]


register_op("slice", infer=_slice_infer, reference=_slice_ref, category=OpCategory.VIEW,
            view_of=0)


def _select_infer(x: Meta, *, dim: int, index: int) -> Meta:
    if x.shape is None:
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape))
    size = x.shape[d]
    if isinstance(size, int):
        require(-size <= index < size,
                f"index {index} is out of range for dim {dim} of size {size}")
    return Meta(x.shape[:d] + x.shape[d + 1:], x.dtype)


register_op("select", infer=_select_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, dim, index: x.select(dim, index))


def _unsqueeze_infer(x: Meta, *, dim: int) -> Meta:
    if x.shape is None:
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape) + 1)
    return Meta(x.shape[:d] + (1,) + x.shape[d:], x.dtype)


register_op("unsqueeze", infer=_unsqueeze_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, dim: x.unsqueeze(dim))


def _squeeze_infer(x: Meta, *, dim: int) -> Meta:
    if x.shape is None:
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape))
    require(not dims_conflict(x.shape[d], 1), f"squeeze dim {dim} has size {x.shape[d]}, not 1")
    return Meta(x.shape[:d] + x.shape[d + 1:], x.dtype)


register_op("squeeze", infer=_squeeze_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, dim: x.squeeze(dim))

register_op("contiguous", infer=lambda x: Meta(x.shape, x.dtype), category=OpCategory.MEMORY,
            reference=lambda x: x.clone(memory_format=torch.contiguous_format))


def _split_infer(x: Meta, *, sizes: tuple[int, ...], dim: int) -> list[Meta]:
    require(all(isinstance(s, int) and s >= 0 for s in sizes),
            f"split sizes must be non-negative ints, got {sizes}")
    if x.shape is None:
        return [Meta(None, x.dtype) for _ in sizes]
    d = normalize_dim(dim, len(x.shape))
    size = x.shape[d]
    require(not dims_conflict(size, sum(sizes)),
            f"split sizes {tuple(sizes)} sum to {sum(sizes)}, but dim {dim} has size {size}")
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        outs.append(Meta(tuple(shape), x.dtype))
    return outs


register_op("split", infer=_split_infer, category=OpCategory.VIEW, view_of=0,
            reference=lambda x, *, sizes, dim: tuple(torch.split(x, list(sizes), dim)))


def _cat_infer(*xs: Meta, dim: int) -> Meta:
    require(len(xs) >= 1, "cat needs at least one tensor")
    dtypes = {m.dtype for m in xs if m.dtype is not None}
    require(len(dtypes) <= 1, "cat inputs must share a dtype, got " + ", ".join(map(str, xs)))
    dtype = dtypes.pop() if dtypes else None
    known = [m.shape for m in xs if m.shape is not None]
    if len(known) < len(xs):
        return Meta(None, dtype)
    rank = len(known[0])
    require(all(len(s) == rank for s in known), "cat inputs must share a rank, got "
            + ", ".join(format_shape(s) for s in known))
    d = normalize_dim(dim, rank)
    out = []
    for i in range(rank):
        dims = [s[i] for s in known]
        if i == d:
            out.append(sum(dims) if all(isinstance(v, int) for v in dims) else None)
        else:
            merged = dims[0]
            for v in dims[1:]:
                try:
                    merged = merge_dims(merged, v)
                except ShapeRuleError:
                    raise ShapeRuleError(
                        f"cat inputs differ in dim {i} (not the cat dim {dim}): "
                        + ", ".join(format_shape(s) for s in known)) from None
            out.append(merged)
    return Meta(tuple(out), dtype)


register_op("cat", infer=_cat_infer, category=OpCategory.MEMORY,
            reference=lambda *xs, dim: torch.cat(xs, dim))


def _gather_infer(x: Meta, index: Meta, *, dim: int) -> Meta:
    require_int(index, "gather index")
    if x.shape is None or index.shape is None:
        return Meta(None, x.dtype)
    d = normalize_dim(dim, len(x.shape))
    return Meta(x.shape[:d] + index.shape + x.shape[d + 1:], x.dtype)


def _gather_ref(x, index, *, dim):
    d = dim % x.dim()
    flat = torch.index_select(x, d, index.reshape(-1).long())
    return flat.reshape(x.shape[:d] + index.shape + x.shape[d + 1:])


register_op("gather", infer=_gather_infer, reference=_gather_ref, category=OpCategory.MEMORY,
            doc="numpy.take along one dim: rows of x picked by index (any index shape)")


def _embedding_infer(ids: Meta, weight: Meta) -> Meta:
    require_int(ids, "embedding ids")
    if weight.shape is not None:
        require(len(weight.shape) == 2, f"embedding weight must be 2-D, got {weight}")
    if ids.shape is None or weight.shape is None:
        return Meta(None, weight.dtype)
    return Meta(ids.shape + (weight.shape[1],), weight.dtype)


def _embedding_ref(ids: torch.Tensor, weight: Any) -> torch.Tensor:
    if is_quantized(weight):  # only the looked-up rows are dequantized
        return weight.rows(ids.long())
    return torch.nn.functional.embedding(ids.long(), weight)


register_op("embedding", infer=_embedding_infer, category=OpCategory.MEMORY,
            reference=_embedding_ref)
