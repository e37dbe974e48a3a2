"""Memory planning: intermediate buffers placed in one arena by liveness, so that buffers whose
lifetimes do not overlap share memory.

Views (reshape, slice, split...) get no buffer of their own: they keep their base buffer alive
until the view's last reader. Planning runs per binding of the dynamic dims (it is cheap), from the
concrete shapes of that binding.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tgraph.ir.network import Network
from tgraph.ir.ops import get_op
from tgraph.ir.value import Value

ALIGNMENT = 256


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class MemoryPlan:
    """Where each intermediate buffer lives in the arena.

    Attributes:
        offsets: byte offset of each planned value in the arena.
        sizes: bytes of each planned value.
        arena_bytes: the arena's size: the peak of simultaneously live intermediates (aligned).
        naive_bytes: what one buffer per value would take.
    """

    offsets: dict[Value, int] = field(default_factory=dict)
    sizes: dict[Value, int] = field(default_factory=dict)
    arena_bytes: int = 0
    naive_bytes: int = 0


def alias_base(net: Network, value: Value) -> Value:
    """The value whose buffer ``value`` lives in (itself unless it is a view)."""
    while value.producer is not None:
        src = get_op(value.producer.op).alias_input(value.index)
        if src is None:
            break
        nxt = value.producer.inputs[src]
        if nxt is None:
            break
        value = nxt
    return value


def lifetimes(net: Network, exclude: set[Value] = frozenset()) -> dict[Value, tuple[int, int]]:
    """``base value -> (first step, last step)`` for every buffer-owning intermediate.

    A base stays live until the last reader of any view of it; marked outputs stay live to the end.
    """
    end = len(net.nodes)
    spans: dict[Value, list[int]] = {}
    for i, node in enumerate(net.nodes):
        op = get_op(node.op)
        for out in node.outputs:
            if op.alias_input(out.index) is None and out not in exclude:
                spans[out] = [i, i]
        for v in node.inputs:
            if v is None:
                continue
            base = alias_base(net, v)
            if base in spans:
                spans[base][1] = max(spans[base][1], i)
    for v in net.outputs.values():
        base = alias_base(net, v)
        if base in spans:
            spans[base][1] = end
    return {v: (a, b) for v, (a, b) in spans.items()}


def plan_memory(net: Network, shapes: dict[Value, tuple[tuple[int, ...], torch.dtype]],
                exclude: set[Value] = frozenset()) -> MemoryPlan:
    """Assign arena offsets by a greedy best-fit over live intervals (largest buffers first).

    Args:
        net: the network (its node order is the execution order).
        shapes: the concrete shape and dtype of every intermediate for this binding.
        exclude: values that get no arena buffer (e.g. outputs written to user tensors).
    """
    spans = lifetimes(net, exclude)
    plan = MemoryPlan()
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    order = sorted(spans, key=lambda v: (-_nbytes(shapes[v]), spans[v][0]))
    for v in order:
        size = _align(_nbytes(shapes[v]))
        first, last = spans[v]
        busy = sorted((o, s) for o, s, a, b in placed if not (b < first or last < a))
        offset = 0
        best = None
        for o, s in busy:
            if o - offset >= size and (best is None or o - offset < best[1]):
                best = (offset, o - offset)
            offset = max(offset, o + s)
        chosen = best[0] if best else offset
        placed.append((chosen, size, first, last))
        plan.offsets[v] = chosen
        plan.sizes[v] = _nbytes(shapes[v])
        plan.arena_bytes = max(plan.arena_bytes, chosen + size)
        plan.naive_bytes += size
    return plan


def _nbytes(meta: tuple[tuple[int, ...], torch.dtype]) -> int:
    shape, dtype = meta
    n = 1
    for d in shape:
        n *= d
    return n * (torch.finfo(dtype).bits if dtype.is_floating_point else
                torch.iinfo(dtype).bits if dtype != torch.bool else 8) // 8
