"""Elementwise ops: unary math, activations, binary arithmetic, comparisons, where, cast."""
from __future__ import annotations

import operator
from functools import reduce

import torch
import torch.nn.functional as torch_F

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require
from tgraph.ir.shape import broadcast_shapes

_KIND_RANK = {"bool": 0, "int": 1, "float": 2}


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_floating_point:
        return "float"
    return "int"


def promote(*metas: Meta) -> torch.dtype | None:
    """torch's type promotion, with Python scalars as weakly typed operands."""
    tensors = [m for m in metas if not m.scalar]
    if any(m.dtype is None for m in tensors):
        return None
    if tensors:
        result = reduce(torch.promote_types, [m.dtype for m in tensors])
    else:
        result = reduce(torch.promote_types, [m.dtype for m in metas])
    for m in metas:
        if m.scalar and _KIND_RANK[_kind(m.dtype)] > _KIND_RANK[_kind(result)]:
            result = torch.get_default_dtype() if _kind(m.dtype) == "float" else torch.int64
    return result


def _float_dtype(dtype: torch.dtype | None) -> torch.dtype | None:
    if dtype is None:
        return None
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _unary_float(x: Meta) -> Meta:
    require(not x.scalar, "operand must be a tensor")
    return Meta(x.shape, _float_dtype(x.dtype))


def _unary_same(x: Meta) -> Meta:
    require(not x.scalar, "operand must be a tensor")
    return Meta(x.shape, x.dtype)


def binary_infer(a: Meta, b: Meta) -> Meta:
    require(not (a.scalar and b.scalar), "at least one operand must be a tensor")
    return Meta(broadcast_shapes(a.shape, b.shape), promote(a, b))


def _true_div(a: Meta, b: Meta) -> Meta:
    out = binary_infer(a, b)
    return Meta(out.shape, _float_dtype(out.dtype))


def _compare(a: Meta, b: Meta) -> Meta:
    return Meta(binary_infer(a, b).shape, torch.bool)


def _tensor(x, like: torch.Tensor) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=like.device)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch_F.gelu(x, approximate="tanh")


def in_fp32(fn):
    """Compute a transcendental in fp32 and round once, as fused kernels do."""
    def ref(x: torch.Tensor) -> torch.Tensor:
        out_dtype = _float_dtype(x.dtype)
        return fn(x.to(torch.float32)).to(out_dtype)
    ref.__name__ = getattr(fn, "__name__", "ref")
    return ref


UNARY_FLOAT = {
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "silu": torch_F.silu,
    "gelu": torch_F.gelu,
    "gelu_tanh": _gelu_tanh,
    "reciprocal": torch.reciprocal,
}
for _name, _fn in UNARY_FLOAT.items():
    register_op(_name, infer=_unary_float, reference=in_fp32(_fn), category=OpCategory.POINTWISE)

register_op("neg", infer=_unary_same, reference=operator.neg, category=OpCategory.POINTWISE)
register_op("abs", infer=_unary_same, reference=torch.abs, category=OpCategory.POINTWISE)
register_op("relu", infer=_unary_same, reference=torch.relu, category=OpCategory.POINTWISE)
register_op("logical_not", infer=lambda x: Meta(x.shape, torch.bool),
            reference=torch.logical_not, category=OpCategory.POINTWISE)

register_op("add", infer=binary_infer, reference=operator.add, category=OpCategory.POINTWISE,
            commutative=True)
register_op("mul", infer=binary_infer, reference=operator.mul, category=OpCategory.POINTWISE,
            commutative=True)
register_op("sub", infer=binary_infer, reference=operator.sub, category=OpCategory.POINTWISE)
register_op("div", infer=_true_div, reference=operator.truediv, category=OpCategory.POINTWISE)
register_op("pow", infer=binary_infer, reference=operator.pow, category=OpCategory.POINTWISE)
register_op("maximum", infer=binary_infer, commutative=True, category=OpCategory.POINTWISE,
            reference=lambda a, b: torch.maximum(_tensor(a, b), _tensor(b, a)))
register_op("minimum", infer=binary_infer, commutative=True, category=OpCategory.POINTWISE,
            reference=lambda a, b: torch.minimum(_tensor(a, b), _tensor(b, a)))

for _name, _fn in {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                   "gt": operator.gt, "ge": operator.ge}.items():
    register_op(_name, infer=_compare, reference=_fn, category=OpCategory.POINTWISE,
                commutative=_name in ("eq", "ne"))


def _where_infer(cond: Meta, a: Meta, b: Meta) -> Meta:
    require(cond.dtype in (None, torch.bool), f"where: condition must be bool, got {cond}")
    return Meta(broadcast_shapes(cond.shape, a.shape, b.shape), promote(a, b))


register_op("where", infer=_where_infer, reference=torch.where, category=OpCategory.POINTWISE)


def _cast_infer(x: Meta, *, dtype: torch.dtype) -> Meta:
    require(isinstance(dtype, torch.dtype), f"cast: dtype must be a torch.dtype, got {dtype!r}")
    return Meta(x.shape, dtype)


# copy=True: a cast to the same dtype is a new tensor, never its input (outputs are not views)
register_op("cast", infer=_cast_infer, reference=lambda x, *, dtype: x.to(dtype, copy=True),
            category=OpCategory.POINTWISE)
