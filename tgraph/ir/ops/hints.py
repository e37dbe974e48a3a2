"""Ops that change how fast a network runs, never what it computes.

``l2_prefetch(x, w0[, w1[, w2]], *, halves)`` returns ``x`` unchanged (a view) and, on
a GPU that supports it, starts bringing the weights ``w0..`` into L2 on a side stream, so that
the linears reading them later find them there (see :mod:`tgraph.kernels.triton.prefetch` and
the ``L2Prefetch`` pass). ``x`` ties the prefetch to its place in the step: it is launched after
the kernel producing ``x`` and before the node reading it. ``halves[i]`` is 2 for a packed
gate|up weight (a prefix is taken from both halves) and 1 otherwise. How much of L2 the bytes
may take is a launch setting (``tgraph.tuning.PrefetchTuning``), not part of the op.
"""
from __future__ import annotations

from tgraph.ir.ops.registry import Meta, OpCategory, register_op, require, require_rank

MAX_WEIGHTS = 3


def _prefetch_infer(x: Meta, *weights: Meta, halves: tuple[int, ...]) -> Meta:
    require(1 <= len(weights) <= MAX_WEIGHTS,
            f"l2_prefetch takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    require(len(halves) == len(weights) and all(h in (1, 2) for h in halves),
            f"l2_prefetch: halves must give 1 or 2 for each of the {len(weights)} weights, "
            f"got {halves}")
    for w in weights:
        require_rank(w, 2, "l2_prefetch weight")
    return Meta(x.shape, x.dtype)


def _prefetch_reference(x, *weights, halves):
    return x  # a prefetch computes nothing


register_op("l2_prefetch", infer=_prefetch_infer, reference=_prefetch_reference,
            category=OpCategory.MEMORY, view_of=0, launches=True,
            doc="x unchanged; the weights start streaming into L2 on a side stream (a hint)")
