"""A dataflow-aware pattern matcher.

A pattern is a function written with tgraph ops over placeholder tensors; it is recorded once into
a private network. Matching walks the graph backwards from an anchor node through real dataflow
edges (never through "the next node in the list"), binds placeholders to values by identity, and
refuses a match when an intermediate of the pattern is read outside the match or is a marked
output, so a fusion never removes a value something else still needs.

Example::

    silu = Pattern("silu", lambda x: x * F.sigmoid(x), lambda x: F.silu(x))
    PatternPass("SiluFusion", [silu]).run(net)
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import get_op
from tgraph.ir.value import Value, ValueKind
from tgraph.nn.functional import constant
from tgraph.nn.network_manager import new_network, recording
from tgraph.nn.tensor import Tensor
from tgraph.passes.manager import Pass


class _AnyScalar:
    """Placeholder data of a scalar wildcard in a pattern."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<scalar {self.name}>"


@dataclass
class Match:
    """One occurrence of a pattern in a network.

    Attributes:
        bindings: placeholder name -> the bound graph value (or Python number for scalars).
        nodes: pattern node -> matched graph node.
        outputs: the graph values that play the pattern's outputs, in order.
    """

    pattern: Pattern
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: dict[Node, Node] = field(default_factory=dict)
    outputs: list[Value] = field(default_factory=list)

    def graph_nodes(self, op: str) -> list[Node]:
        """Matched graph nodes of one op, in the order the pattern recorded them."""
        return [self.nodes[p] for p in self.pattern.net.nodes if p.op == op and p in self.nodes]


class Pattern:
    """A pattern, its replacement and an optional check.

    Args:
        name: for provenance.
        pattern: ``fn(*placeholders) -> Tensor | tuple[Tensor, ...]`` written in tgraph ops.
        replacement: ``fn(**bindings) -> Tensor | tuple`` with one output per pattern output;
            tensor placeholders arrive as graph values, scalar placeholders as Python numbers.
        scalars: parameters of ``pattern`` that match any Python-scalar constant.
        ignore_attrs: attribute names not compared (check them in ``extra_check`` instead).
        extra_check: ``fn(match) -> bool``; refuse matches whose dtype/shape the replacement
            kernel cannot take.
    """

    def __init__(self, name: str, pattern: Callable[..., Any], replacement: Callable[..., Any],
                 *, scalars: Sequence[str] = (), ignore_attrs: Sequence[str] = (),
                 extra_check: Callable[[Match], bool] | None = None) -> None:
        self.name = name
        self.replacement = replacement
        self.extra_check = extra_check
        self.ignore_attrs = set(ignore_attrs)
        params = [name for name, p in inspect.signature(pattern).parameters.items()
                  if p.default is inspect.Parameter.empty]
        self.placeholders: dict[Value, str] = {}
        args = []
        for p in params:
            v = constant(0.0) if p in scalars else Tensor(p)
            if p in scalars:
                v.data = _AnyScalar(p)
            self.placeholders[v] = p
            args.append(v)
        with recording(new_network(f"pattern:{name}")) as net:
            out = pattern(*args)
        self.outputs: list[Value] = list(out) if isinstance(out, tuple) else [out]
        self.net = net
        self.anchor: Node = max((v.producer for v in self.outputs),
                                key=lambda n: net.nodes.index(n))

    # ---- matching --------------------------------------------------------------------------------

    def match_at(self, net: Network, node: Node) -> Match | None:
        """Try to match with the pattern's anchor on ``node``."""
        if node.op != self.anchor.op:
            return None
        m = Match(self)
        if not self._match_node(self.anchor, node, m):
            return None
        for pv in self.outputs:
            gnode = m.nodes.get(pv.producer)
            if gnode is None:
                return None
            m.outputs.append(gnode.outputs[pv.index])
        if not self._dataflow_ok(net, m):
            return None
        if self.extra_check is not None and not self.extra_check(m):
            return None
        return m

    def _match_value(self, pv: Value | None, gv: Value | None, m: Match) -> bool:
        if pv is None:
            return gv is None
        if pv in self.placeholders:
            name = self.placeholders[pv]
            if isinstance(pv.data, _AnyScalar):
                if gv is None or gv.kind is not ValueKind.CONST:
                    return False
                bound = m.bindings.setdefault(name, gv.data)
                return bound == gv.data
            if gv is None or gv.kind is ValueKind.CONST:
                return False
            return m.bindings.setdefault(name, gv) is gv
        if gv is None:
            return False
        if pv.kind is ValueKind.CONST:
            return gv.kind is ValueKind.CONST and gv.data == pv.data \
                and isinstance(gv.data, bool) == isinstance(pv.data, bool)
        if pv.producer is None or gv.producer is None or pv.index != gv.index:
            return False
        return self._match_node(pv.producer, gv.producer, m)

    def _match_node(self, pn: Node, gn: Node, m: Match) -> bool:
        if pn in m.nodes:
            return m.nodes[pn] is gn
        if pn.op != gn.op or len(pn.inputs) != len(gn.inputs) or gn in m.nodes.values():
            return False
        if not self._attrs_equal(pn, gn, m):
            return False
        m.nodes[pn] = gn
        orders = [list(range(len(pn.inputs)))]
        if get_op(pn.op).commutative and len(pn.inputs) == 2:
            orders.append([1, 0])
        for order in orders:
            saved_b, saved_n = dict(m.bindings), dict(m.nodes)
            if all(self._match_value(pn.inputs[i], gn.inputs[j], m)
                   for i, j in zip(range(len(pn.inputs)), order)):
                return True
            m.bindings, m.nodes = saved_b, saved_n
        del m.nodes[pn]
        return False

    def _attrs_equal(self, pn: Node, gn: Node, m: Match) -> bool:
        keys = (set(pn.attrs) | set(gn.attrs)) - self.ignore_attrs
        x = gn.inputs[0] if gn.inputs else None
        rank = x.rank if x is not None else None
        for k in keys:
            a, b = pn.attrs.get(k), gn.attrs.get(k)
            if isinstance(a, Value):
                # A scalar wildcard used as an attribute (e.g. rms_norm's eps) binds its value.
                name = self.placeholders.get(a)
                if name is None or isinstance(b, Value) or b is None:
                    return False
                if m.bindings.setdefault(name, b) != b:
                    return False
                continue
            if k == "dim" and isinstance(a, int) and isinstance(b, int) and rank:
                a, b = a % rank, b % rank
            if a != b:
                return False
        return True

    def _dataflow_ok(self, net: Network, m: Match) -> bool:
        matched = {g.id for g in m.nodes.values()}
        for v in m.bindings.values():
            # A placeholder stands for a value from outside the match; binding it to something
            # the match computes (``silu(h) * silu(h)`` as ``silu(gate) * up``) would delete it.
            if isinstance(v, Value) and v.producer is not None and v.producer.id in matched:
                return False
        exposed = set(m.outputs)
        for g in m.nodes.values():
            for v in g.outputs:
                if v in exposed:
                    continue
                if net.is_output(v) or any(u.id not in matched for u in net.users(v)):
                    return False
        return True

    # ---- rewriting -------------------------------------------------------------------------------

    def apply(self, net: Network, m: Match) -> bool:
        """Replace the match; returns False (changing nothing) if no insertion point is valid."""
        position = {n.id: i for i, n in enumerate(net.nodes)}
        matched = {g.id for g in m.nodes.values()}
        latest_def = max((position[v.producer.id] for v in m.bindings.values()
                          if isinstance(v, Value) and v.producer is not None), default=-1)
        external_uses = [position[u.id] for v in m.outputs for u in net.users(v)
                         if u.id not in matched]
        first_use = min(external_uses, default=len(net.nodes))
        if latest_def >= first_use:
            return False
        anchor = net.nodes[latest_def + 1] if latest_def + 1 < len(net.nodes) else None
        kwargs = {name: m.bindings[name] for name in self.placeholders.values()}
        with recording(net), net.inserting_before(anchor):
            new = self.replacement(**kwargs)
        new_outputs = list(new) if isinstance(new, tuple) else [new]
        if len(new_outputs) != len(m.outputs):
            raise ValueError(f"pattern {self.name}: replacement returned {len(new_outputs)} "
                             f"outputs, the pattern has {len(m.outputs)}")
        for old, repl in zip(m.outputs, new_outputs):
            net.replace_all_uses(old, repl)
        net.remove_nodes([g for g in m.nodes.values()])
        return True


class PatternPass(Pass):
    """Applies a list of patterns (variants of one rewrite) until none matches."""

    def __init__(self, name: str, patterns: Sequence[Pattern]) -> None:
        self.name = name
        self.patterns = list(patterns)

    def run(self, net: Network) -> int:
        count = 0
        for pattern in self.patterns:
            for node in list(net.nodes):
                if not net.contains(node):
                    continue
                m = pattern.match_at(net, node)
                if m is not None and pattern.apply(net, m):
                    count += 1
        return count
