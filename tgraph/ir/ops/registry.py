"""The op registry: one entry per op with its shape/dtype rule and its torch reference.

Adding an op is one :func:`register_op` call plus a functional wrapper of a few lines in
``tgraph.nn.functional``. The reference implementation is the CPU backend, the ``eager`` graph
mode and the oracle every fast kernel is tested against.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tgraph.ir.shape import Shape, ShapeRuleError, format_shape


@dataclass(frozen=True)
class Meta:
    """What a shape rule knows of one operand: shape, dtype, and whether it is a Python scalar.

    Python scalars have weak dtypes (``bf16_tensor + 1.0`` stays bf16), as in torch.
    """

    shape: Shape
    dtype: torch.dtype | None
    scalar: bool = False

    def __str__(self) -> str:
        if self.scalar:
            return "scalar"
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        return f"{dtype}{format_shape(self.shape)}"


class OpCategory(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    VIEW = "view"
    MEMORY = "memory"
    LINALG = "linalg"
    NORM = "norm"
    ROPE = "rope"
    ATTENTION = "attention"
    CACHE = "cache"
    COLLECTIVE = "collective"
    FUSED = "fused"


InferFn = Callable[..., "Meta | Sequence[Meta]"]


@dataclass(frozen=True)
class OpDef:
    """A registered op.

    Attributes:
        name: unique op name, the ``op`` of every node that applies it.
        infer: ``infer(*input_metas, **attrs)`` returns the output meta(s) or raises
            :class:`ShapeRuleError`. Runs at record time (symbolic dims) and at bind time (ints).
        reference: ``reference(*inputs, **attrs)`` computes the op with torch; absent optional
            inputs are passed as ``None`` and scalar constants as Python numbers.
        category: what kind of op it is (passes and the partitioner look at this).
        view_of: for views, which input every output aliases (an int), or one input per output
            (a tuple); the engine allocates no buffer for such outputs.
        mutates: inputs written in place (e.g. the KV cache); nodes that mutate are never removed.
        commutative: the pattern matcher may swap the two inputs.
        launches: the op's outputs are views, but its kernel does work on the side (a prefetch),
            so the engine runs it rather than treating the node as a free view.
    """

    name: str
    infer: InferFn
    reference: Callable[..., Any]
    category: OpCategory
    view_of: int | tuple[int | None, ...] | None = None
    mutates: tuple[int, ...] = ()
    commutative: bool = False
    doc: str = field(default="", compare=False)
    launches: bool = False

    def infer_metas(self, metas: Sequence[Meta], attrs: dict[str, Any]) -> list[Meta]:
        """Run the rule and always return a list of output metas."""
        out = self.infer(*metas, **attrs)
        return [out] if isinstance(out, Meta) else list(out)

    def alias_input(self, output_index: int) -> int | None:
        """Index of the input that output ``output_index`` is a view of, if any."""
        if self.view_of is None:
            return None
        if isinstance(self.view_of, int):
            return self.view_of
        return self.view_of[output_index]

    @property
    def has_side_effects(self) -> bool:
        return bool(self.mutates) or self.category is OpCategory.COLLECTIVE


_REGISTRY: dict[str, OpDef] = {}


def register_op(
    name: str,
    *,
    infer: InferFn,
    reference: Callable[..., Any],
    category: OpCategory,
    view_of: int | tuple[int | None, ...] | None = None,
    mutates: tuple[int, ...] = (),
    commutative: bool = False,
    doc: str = "",
    launches: bool = False,
) -> OpDef:
    """Register an op; raises if the name is taken."""
    if name in _REGISTRY:
        raise ValueError(f"op {name!r} is already registered")
    op = OpDef(name, infer, reference, category, view_of, mutates, commutative, doc, launches)
    _REGISTRY[name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown op {name!r}; registered ops: {known}") from None


def all_ops() -> list[OpDef]:
    return list(_REGISTRY.values())


# ---- helpers shared by the rule definitions ---------------------------------------------------


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ShapeRuleError(message)


def require_rank(meta: Meta, ranks: int | tuple[int, ...], what: str) -> None:
    if meta.shape is None:
        return
    ranks = (ranks,) if isinstance(ranks, int) else ranks
    require(len(meta.shape) in ranks,
            f"{what} must have rank {' or '.join(map(str, ranks))}, got {meta}")


def require_float(meta: Meta, what: str) -> None:
    if meta.dtype is not None and not meta.scalar:
        require(meta.dtype.is_floating_point, f"{what} must be floating point, got {meta}")


def require_int(meta: Meta, what: str) -> None:
    if meta.dtype is not None:
        require(meta.dtype in (torch.int32, torch.int64),
                f"{what} must be int32 or int64, got {meta}")


def require_same_dtype(a: Meta, b: Meta, what: str) -> None:
    if a.dtype is not None and b.dtype is not None:
        require(a.dtype == b.dtype, f"{what} must have the same dtype, got {a} and {b}")


def dim_of(meta: Meta, i: int):
    """Dim ``i`` (may be negative) of a meta, or None if the rank is unknown."""
    if meta.shape is None:
        return None
    return meta.shape[i]
