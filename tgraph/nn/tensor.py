"""The symbolic :class:`Tensor` model code computes with."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tgraph.ir.value import Value, ValueKind


class Tensor(Value):
    """A symbolic tensor: ops on it are recorded into the current network, not computed.

    ``Tensor("x")`` creates a graph input; dtype and shape may be given (dims are ints or named
    symbols such as ``"num_tokens"``) or left unknown and bound at the engine's first ``forward``.

    Args:
        name: the input's name, used as the key of ``Engine.forward``'s ``inputs``.
        dtype: torch dtype, if known.
        shape: tuple of dims (ints, symbol names, or None), if known.
        host: the value lives on the host and is passed in ``runtime_params`` (e.g. ``seq_len``).
    """

    __slots__ = ()

    def __init__(self, name: str | None = None, dtype: torch.dtype | None = None,
                 shape: Sequence[int | str | None] | None = None, *, host: bool = False) -> None:
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"Tensor dtype must be a torch.dtype, got {dtype!r}")
        if shape is not None:
            shape = tuple(shape)
            for d in shape:
                if not (d is None or isinstance(d, str) or (isinstance(d, int) and d >= 0)):
                    raise TypeError(f"Tensor {name!r}: dims must be non-negative ints, symbol "
                                    f"names or None, got {d!r} in {shape}")
        self._setup(ValueKind.INPUT, name, dtype, shape, None, 0, None, host)

    # Symbolic ``==`` below means hashing must stay by identity.
    __hash__ = Value.__hash__

    # ---- arithmetic -----------------------------------------------------------------------------
    def __add__(self, other: Any) -> Tensor:
        return F.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return F.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return F.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return F.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return F.mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return F.mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return F.div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return F.div(other, self)

    def __pow__(self, other: Any) -> Tensor:
        return F.pow(self, other)

    def __neg__(self) -> Tensor:
        return F.neg(self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return F.matmul(self, other)

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return F.eq(self, other)

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return F.ne(self, other)

    def __lt__(self, other: Any) -> Tensor:
        return F.lt(self, other)

    def __le__(self, other: Any) -> Tensor:
        return F.le(self, other)

    def __gt__(self, other: Any) -> Tensor:
        return F.gt(self, other)

    def __ge__(self, other: Any) -> Tensor:
        return F.ge(self, other)

    def __bool__(self) -> bool:
        raise TypeError(f"the truth value of symbolic tensor {self.label()} is not known while "
                        "recording; branch on Python values (e.g. is_prefill) instead")

    def __iter__(self):
        raise TypeError(f"symbolic tensor {self.label()} is not iterable; use F.split or indexing")

    # ---- shape ----------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Tensor:
        return F.getitem(self, key)

    @property
    def ndim(self) -> int | None:
        return self.rank

    def dim(self) -> int | None:
        return self.rank

    def size(self, dim: int | None = None):
        if dim is None:
            return self.shape
        if self.shape is None:
            return None
        return self.shape[dim]

    def reshape(self, *shape: Any) -> Tensor:
        return F.reshape(self, _as_shape(shape))

    def view(self, *shape: Any) -> Tensor:
        return F.reshape(self, _as_shape(shape))

    def permute(self, *dims: Any) -> Tensor:
        return F.permute(self, _as_shape(dims))

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        return F.transpose(self, dim0, dim1)

    def unsqueeze(self, dim: int) -> Tensor:
        return F.unsqueeze(self, dim)

    def squeeze(self, dim: int) -> Tensor:
        return F.squeeze(self, dim)

    def contiguous(self) -> Tensor:
        return self

    def to(self, dtype: torch.dtype) -> Tensor:
        return F.cast(self, dtype)

    def float(self) -> Tensor:
        return F.cast(self, torch.float32)

    # ---- math shortcuts --------------------------------------------------------------------------
    def sum(self, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
        return F.sum(self, dim, keepdim)

    def mean(self, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
        return F.mean(self, dim, keepdim)

    def amax(self, dim: int | tuple[int, ...], keepdim: bool = False) -> Tensor:
        return F.amax(self, dim, keepdim)

    def softmax(self, dim: int = -1) -> Tensor:
        return F.softmax(self, dim)

    def exp(self) -> Tensor:
        return F.exp(self)

    def sigmoid(self) -> Tensor:
        return F.sigmoid(self)

    def rsqrt(self) -> Tensor:
        return F.rsqrt(self)


def _as_shape(args: tuple) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


from tgraph.nn import functional as F  # noqa: E402  (functional needs Tensor defined first)
