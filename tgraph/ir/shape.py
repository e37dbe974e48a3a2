"""Symbolic shapes.

A dim is an ``int`` (known), a ``str`` (a named symbol such as ``"num_tokens"``, bound to an int
when an engine runs) or ``None`` (unknown until the first ``forward``). A shape is a tuple of dims,
or ``None`` when even the rank is unknown. Shape rules use these helpers both at record time (where
some facts are symbolic) and at bind time (where every dim is an int), so one rule serves both.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Dim = int | str | None
Shape = tuple | None


class ShapeRuleError(ValueError):
    """Raised by a shape/dtype rule; the caller turns it into a user-facing error with context."""


def format_dim(d: Dim) -> str:
    return "?" if d is None else str(d)


def format_shape(shape: Shape) -> str:
    if shape is None:
        return "[?...]"
    return "[" + ", ".join(format_dim(d) for d in shape) + "]"


def dims_conflict(a: Dim, b: Dim) -> bool:
    """True only when two dims are certainly different (two different ints)."""
    return isinstance(a, int) and isinstance(b, int) and a != b


def merge_dims(a: Dim, b: Dim) -> Dim:
    """The most informative of two dims that must be equal (int > symbol > unknown)."""
    if dims_conflict(a, b):
        raise ShapeRuleError(f"dims {a} and {b} must be equal")
    for d in (a, b):
        if isinstance(d, int):
            return d
    return a if a is not None else b


def normalize_dim(dim: int, rank: int | None) -> int:
    """Turn a possibly negative dim index into a non-negative one, checking it is in range."""
    if rank is None:
        if dim < 0:
            raise ShapeRuleError(f"negative dim {dim} needs a known rank")
        return dim
    if not -rank <= dim < max(rank, 1):
        raise ShapeRuleError(f"dim {dim} is out of range for rank {rank}")
    return dim % rank if rank else 0


def broadcast_shapes(*shapes: Shape) -> Shape:
    """Numpy/torch broadcasting of symbolic shapes."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        result: Dim = 1
        for d in dims:
            if d == 1:
                continue
            if result == 1:
                result = d
            elif dims_conflict(result, d):
                raise ShapeRuleError(
                    "shapes " + ", ".join(format_shape(s) for s in shapes) + " do not broadcast"
                )
            else:
                result = merge_dims(result, d)
        out.append(result)
    return tuple(out)


def is_concrete(shape: Shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def resolve_dim(d: Dim, env: Mapping[str, int]) -> Dim:
    """Replace a symbol by its bound value, if it is bound."""
    if isinstance(d, str):
        return env.get(d, d)
    return d


def resolve_shape(shape: Shape, env: Mapping[str, int]) -> Shape:
    if shape is None:
        return None
    return tuple(resolve_dim(d, env) for d in shape)


def reshape_target(in_shape: Shape, target: tuple) -> Shape:
    """Infer the output shape of ``reshape(x, target)``; ``target`` may hold one ``-1``.

    With symbols, ``-1`` is solved when the symbolic parts cancel, e.g. ``[num_tokens, 4096]`` to
    ``(-1, 32, 128)`` gives ``[num_tokens, 32, 128]``; otherwise the dim stays unknown.
    """
    if sum(1 for d in target if d == -1) > 1:
        raise ShapeRuleError(f"reshape target {target} has more than one -1")
    for d in target:
        if isinstance(d, int) and d < -1:
            raise ShapeRuleError(f"reshape target {target} has a negative dim {d}")
    if in_shape is None:
        return tuple(None if d == -1 else d for d in target)
    in_int = math.prod(d for d in in_shape if isinstance(d, int))
    in_syms = sorted(d for d in in_shape if isinstance(d, str))
    in_unknown = any(d is None for d in in_shape)
    out_int = math.prod(d for d in target if isinstance(d, int) and d != -1)
    out_syms = sorted(d for d in target if isinstance(d, str))
    out_unknown = any(d is None for d in target)
    if -1 not in target:
        if not in_unknown and not out_unknown and in_syms == out_syms and in_int != out_int:
            raise ShapeRuleError(
                f"cannot reshape {format_shape(in_shape)} ({in_int} elements besides symbols) "
                f"to {format_shape(target)} ({out_int})"
            )
        return tuple(target)
    fill: Dim = None
    if not in_unknown and not out_unknown:
        rest = list(in_syms)
        for s in out_syms:
            if s in rest:
                rest.remove(s)
        if out_int == 0 or (not set(out_syms) <= set(in_syms)):
            fill = None
        elif not rest:
            if in_int % out_int:
                raise ShapeRuleError(
                    f"cannot reshape {format_shape(in_shape)} to {format_shape(target)}: "
                    f"{in_int} is not divisible by {out_int}"
                )
            fill = in_int // out_int
        elif len(rest) == 1 and in_int == out_int:
            fill = rest[0]
    return tuple(fill if d == -1 else d for d in target)


def slice_length_is_whole(size: Dim, start: int, end: int | None, step: int) -> bool:
    """True when ``[start:end:step]`` certainly keeps a whole dim of ``size``."""
    if step != 1 or start != 0:
        return False
    if end is None:
        return True
    return isinstance(size, int) and end >= size
