"""Values: the edges of a network.

A :class:`Value` is a symbolic tensor. It has a unique identity (two values are never equal because
they share a name), an optional name, and a dtype and shape when they are known. Leaves have no
producer: graph inputs, weights (which carry real data) and Python-scalar constants.
``tgraph.nn.tensor.Tensor`` subclasses it with the operator overloads model code uses.
"""
from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

import torch

from tgraph.ir.shape import Shape, format_shape

if TYPE_CHECKING:
    from tgraph.ir.node import Node

_ids = itertools.count()


class ValueKind(enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    CONST = "const"
    INTERMEDIATE = "intermediate"


class Value:
    """A symbolic tensor (or Python scalar constant) in a network."""

    __slots__ = ("id", "name", "dtype", "shape", "kind", "producer", "index", "data", "host",
                 "__weakref__")

    id: int
    name: str | None
    dtype: torch.dtype | None
    shape: Shape
    kind: ValueKind
    producer: Node | None
    index: int
    data: Any
    host: bool

    @classmethod
    def make(
        cls,
        kind: ValueKind,
        name: str | None = None,
        dtype: torch.dtype | None = None,
        shape: Shape = None,
        producer: Node | None = None,
        index: int = 0,
        data: Any = None,
        host: bool = False,
    ) -> Value:
        """Create a value without running a subclass's user-facing ``__init__``."""
        v = object.__new__(cls)
        v._setup(kind, name, dtype, shape, producer, index, data, host)
        return v

    def _setup(self, kind: ValueKind, name: str | None, dtype: torch.dtype | None, shape: Shape,
               producer: Node | None, index: int, data: Any, host: bool) -> None:
        self.id = next(_ids)
        self.name = name
        self.dtype = dtype
        self.shape = tuple(shape) if shape is not None else None
        self.kind = kind
        self.producer = producer
        self.index = index
        self.data = data
        self.host = host

    # Identity semantics: subclasses overload ``==`` symbolically, so hashing must stay by id.
    __hash__ = object.__hash__

    @property
    def is_leaf(self) -> bool:
        return self.producer is None

    @property
    def is_scalar_const(self) -> bool:
        return self.kind is ValueKind.CONST

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def describe(self) -> str:
        """``name: dtype[shape]`` for messages and printing."""
        if self.kind is ValueKind.CONST:
            return repr(self.data)
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        return f"{self.label()}: {dtype}{format_shape(self.shape)}"

    def label(self) -> str:
        if self.kind is ValueKind.CONST:
            return repr(self.data)
        if self.name:
            return self.name
        return f"%{self.id}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"


def scalar_dtype(value: Any) -> torch.dtype:
    """The dtype torch gives a Python scalar when it is not promoted by a tensor operand."""
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()
