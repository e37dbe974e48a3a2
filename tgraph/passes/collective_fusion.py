"""``AllReduceAddRmsNorm``: the tensor-parallel block boundary in one op.

A row-parallel linear ends in ``all_reduce``; the decoder then adds the residual and normalises
the sum for the next block. This pass rewrites ``all_reduce(x)`` followed by the residual add and
the RMSNorm into one ``all_reduce_add_rms_norm`` that returns the normed tensor and the new
residual. It matches both spellings the pipeline can hold at its position: the ``add_rms_norm``
that ``AddRmsNorm`` made (the reduced value on either side), and a plain add + ``rms_norm`` (when
``AddRmsNorm`` is disabled).

The matcher refuses a match whose reduced value is read by anything else (it would be removed).
The pass also decides, per match, whether the fast kernel may reduce ``x``'s buffer in place
(``reduce_in_place``): only when ``x`` owns its buffer (an intermediate that is not a view), is
no marked output and the collective is its only reader, so nothing can see the overwrite.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tgraph.ir.network import Network
from tgraph.ir.ops import get_op
from tgraph.ir.value import Value, ValueKind
from tgraph.nn import functional as F
from tgraph.passes.pattern import Match, Pattern, PatternPass

FUSED_OP = "all_reduce_add_rms_norm"

# The collective's attrs are copied from the matched node, not compared with the pattern's.
_COLLECTIVE_ATTRS = ("world_size", "capturable")


def _reduce(x: Any) -> Any:
    # NOTE: recorded with placeholder attrs (patterns have no process group); see _COLLECTIVE_ATTRS.
    return F.record("all_reduce", [x], world_size=1, capturable=False)


def _add_then_norm(x, residual, w, eps):
    summed = _reduce(x) + residual
    return F.rms_norm(summed, w, eps), summed


def _reduced_first(x, residual, w, eps):
    out = F.record("add_rms_norm", [_reduce(x), residual, w], eps=eps)
    return out[0], out[1]


def _reduced_second(x, residual, w, eps):
    out = F.record("add_rms_norm", [residual, _reduce(x), w], eps=eps)
    return out[0], out[1]


def _check(m: Match) -> bool:
    """Only what the fused kernel takes: equal float shapes and dtypes, a 1-D weight."""
    x, residual, w = m.bindings["x"], m.bindings["residual"], m.bindings["w"]
    if x.shape is None or x.shape != residual.shape or x.dtype != residual.dtype:
        return False
    return x.dtype is not None and x.dtype.is_floating_point and w.rank == 1


def owns_dead_buffer(net: Network, x: Value, reader_ids: set[int]) -> bool:
    """Whether ``x``'s buffer may be overwritten by the nodes ``reader_ids``.

    Args:
        net: the network.
        x: the value.
        reader_ids: ids of the nodes allowed to read ``x``.
    Returns:
        True when ``x`` is an intermediate that owns its buffer (not a view), is no marked output
        and only ``reader_ids`` read it.
    """
    if x.kind is not ValueKind.INTERMEDIATE or x.producer is None or net.is_output(x):
        return False
    if get_op(x.producer.op).alias_input(x.index) is not None:
        return False
    return all(u.id in reader_ids for u in net.users(x))


class _CollectivePattern(Pattern):
    """A pattern whose replacement also receives the matched collective's attrs and the
    in-place decision, which need the matched nodes and the network."""

    def __init__(self, name: str, pattern: Callable[..., Any]) -> None:
        self._extra: dict[str, Any] = {}
        super().__init__(name, pattern, self._replace, scalars=("eps",),
                         ignore_attrs=_COLLECTIVE_ATTRS, extra_check=_check)

    def _replace(self, x, residual, w, eps):
        return F.record(FUSED_OP, [x, residual, w], eps=eps, **self._extra)

    def apply(self, net: Network, m: Match) -> bool:
        (reduce_node,) = m.graph_nodes("all_reduce")
        x = m.bindings["x"]
        self._extra = {k: reduce_node.attrs[k] for k in _COLLECTIVE_ATTRS if k in reduce_node.attrs}
        self._extra["reduce_in_place"] = owns_dead_buffer(net, x, {reduce_node.id})
        try:
            return super().apply(net, m)
        finally:
            self._extra = {}


class AllReduceAddRmsNorm(PatternPass):
    """``all_reduce`` + residual add + RMSNorm -> ``all_reduce_add_rms_norm``.

    It must run after ``AddRmsNorm`` (which it also accepts as input) and before any pass that
    could fold the add into another kernel (``PointwiseFusion``).
    """

    def __init__(self) -> None:
        super().__init__("AllReduceAddRmsNorm", [
            _CollectivePattern("all_reduce_add_rms_norm", _reduced_second),
            _CollectivePattern("all_reduce_add_rms_norm", _reduced_first),
            _CollectivePattern("all_reduce_add_rms_norm", _add_then_norm),
        ])
