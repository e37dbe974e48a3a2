"""Clean-up passes: no-op removal, common-subexpression elimination, dead-code elimination."""
from __future__ import annotations

from typing import Any

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import get_op
from tgraph.ir.shape import slice_length_is_whole
from tgraph.ir.value import Value, ValueKind
from tgraph.passes.manager import Pass


def _const(v: Value | None, value: float) -> bool:
    return v is not None and v.kind is ValueKind.CONST and not isinstance(v.data, bool) \
        and v.data == value


def _noop_source(node: Node) -> Value | None:
    """The input a no-op node merely passes through, or None if the node does real work."""
    x = node.inputs[0] if node.inputs else None
    if x is None or len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    same_meta = out.dtype == x.dtype and out.shape == x.shape and x.shape is not None \
        and x.kind is not ValueKind.CONST
    if not same_meta:
        return None
    op, a = node.op, node.attrs
    if op == "cast":
        return x
    if op == "reshape" and tuple(a["shape"]) == x.shape:
        return x
    if op == "permute" and tuple(d % len(x.shape) for d in a["dims"]) == tuple(range(len(x.shape))):
        return x
    if op == "transpose" and a["dim0"] % len(x.shape) == a["dim1"] % len(x.shape):
        return x
    if op == "slice" and slice_length_is_whole(x.shape[a["dim"]], a["start"], a["end"], a["step"]):
        return x
    if op == "cat" and len(node.inputs) == 1:
        return x
    if op in ("add", "sub") and _const(node.inputs[1], 0):
        return x
    if op in ("mul", "div") and _const(node.inputs[1], 1):
        return x
    if op == "add" and _const(x, 0) or op == "mul" and _const(x, 1):
        return node.inputs[1]
    return None


class NoOpRemoval(Pass):
    """Removes identity reshapes, casts, slices, permutes and ``x + 0`` / ``x * 1``."""

    name = "NoOpRemoval"

    def run(self, net: Network) -> int:
        count = 0
        for node in list(net.nodes):
            src = _noop_source(node)
            if src is None or src.shape != node.outputs[0].shape \
                    or src.dtype != node.outputs[0].dtype:
                continue
            net.replace_all_uses(node.outputs[0], src)
            count += 1
        if count:
            DeadCodeElimination().run(net)
        return count


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(i) for i in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x


def _value_key(v: Value | None) -> Any:
    if v is None:
        return None
    if v.kind is ValueKind.CONST:
        return ("const", type(v.data).__name__, v.data)
    return v.id


class CommonSubexpressionElimination(Pass):
    """Merges nodes that apply the same op with the same attrs to the same inputs."""

    name = "CSE"

    def run(self, net: Network) -> int:
        seen: dict[Any, Node] = {}
        count = 0
        for node in list(net.nodes):
            if get_op(node.op).has_side_effects:
                continue
            key = (node.op, tuple(_value_key(v) for v in node.inputs), _freeze(node.attrs))
            try:
                earlier = seen.setdefault(key, node)
            except TypeError:  # an unhashable attr: leave the node alone
                continue
            if earlier is node:
                continue
            for old, new in zip(node.outputs, earlier.outputs):
                net.replace_all_uses(old, new)
            count += 1
        if count:
            DeadCodeElimination().run(net)
        return count


class DeadCodeElimination(Pass):
    """Removes nodes whose outputs nobody reads (nodes with side effects always stay)."""

    name = "DCE"

    def run(self, net: Network) -> int:
        live: set[int] = set()
        needed: set[Value] = set(net.outputs.values())
        for node in reversed(net.nodes):
            if get_op(node.op).has_side_effects or any(v in needed for v in node.outputs):
                live.add(node.id)
                needed.update(v for v in node.inputs if v is not None)
        dead = [n for n in net.nodes if n.id not in live]
        if dead:
            net.remove_nodes(dead)
        return len(dead)
