"""Networks: an ordered list of nodes (always a valid topological order), the values flowing
between them, and the marked outputs. Passes rewrite networks through the methods here, which
keep the use lists consistent."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import networkx as nx

from tgraph.errors import GraphError, RecordError
from tgraph.ir.node import Node
from tgraph.ir.ops import Meta, get_op
from tgraph.ir.shape import ShapeRuleError
from tgraph.ir.value import Value, ValueKind, scalar_dtype

if TYPE_CHECKING:
    from tgraph.engine import Engine


def meta_of(v: Value | None) -> Meta | None:
    """The shape-rule view of a value (``None`` for an absent optional input)."""
    if v is None:
        return None
    if v.kind is ValueKind.CONST:
        return Meta((), scalar_dtype(v.data), scalar=True)
    return Meta(v.shape, v.dtype)


class Network:
    """A recorded computation.

    Args:
        name: shown when printing and in errors.
        value_cls: the class of the values this network creates (``tgraph.nn`` passes its
            ``Tensor`` so that every value recorded by model code has operator overloads).
    """

    def __init__(self, name: str = "network", value_cls: type[Value] = Value) -> None:
        self.name = name
        self.value_cls = value_cls
        self.nodes: list[Node] = []
        self.outputs: dict[str, Value] = {}
        self._users: dict[Value, list[Node]] | None = None
        self._node_ids: set[int] = set()
        self._insert_before: Node | None = None
        # Notes passes leave for the engine (e.g. which weights a fusion concatenated).
        self.annotations: dict[str, Any] = {}

    # ---- recording --------------------------------------------------------------------------

    def add_node(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
                 source: str = "", before: Node | None = None) -> Node:
        """Record ``op`` on ``inputs`` (appended, or inserted before ``before``).

        Raises:
            RecordError: when the op's shape/dtype rule rejects the inputs; the message names the
                op, every input with its shape and dtype, and ``source``.
        """
        attrs = dict(attrs or {})
        opdef = get_op(op)
        for v in inputs:
            if v is not None and v.producer is not None and v.producer.id not in self._node_ids:
                raise RecordError(
                    f"{op}: input {v.describe()} was produced in another network, not in "
                    f"{self.name!r}" + (f"\n  at {source}" if source else ""))
        try:
            metas = opdef.infer_metas([meta_of(v) for v in inputs], attrs)
        except ShapeRuleError as err:
            listed = "\n".join(f"    {i}: {'None' if v is None else v.describe()}"
                               for i, v in enumerate(inputs))
            where = f"\n  at {source}" if source else ""
            attr_text = f" with {Node(op, [], attrs).format_attrs()}" if attrs else ""
            raise RecordError(f"{op}{attr_text}: {err}\n  inputs:\n{listed}{where}") from None
        node = Node(op, inputs, attrs, source)
        node.outputs = [
            self.value_cls.make(ValueKind.INTERMEDIATE, dtype=m.dtype, shape=m.shape,
                                producer=node, index=i)
            for i, m in enumerate(metas)
        ]
        before = before or self._insert_before
        if before is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(self.nodes.index(before), node)
        self._node_ids.add(node.id)
        self._users = None
        return node

    def mark_output(self, value: Value, name: str) -> None:
        """Make ``value`` an output of the network under ``name``."""
        if not isinstance(value, Value):
            raise GraphError(f"mark_output({name!r}): expected a symbolic tensor, got "
                             f"{type(value).__name__}")
        if value.kind is ValueKind.CONST:
            raise GraphError(f"mark_output({name!r}): a Python scalar cannot be an output")
        if name in self.outputs:
            raise GraphError(f"output name {name!r} is already marked in {self.name!r}")
        if value.producer is not None and value.producer.id not in self._node_ids:
            raise GraphError(f"mark_output({name!r}): {value.describe()} belongs to another "
                             "network")
        self.outputs[name] = value

    # ---- queries ------------------------------------------------------------------------------

    def _leaves(self, kind: ValueKind) -> list[Value]:
        seen: dict[Value, None] = {}
        for node in self.nodes:
            for v in node.inputs:
                if v is not None and v.kind is kind:
                    seen.setdefault(v)
        for v in self.outputs.values():
            if v.kind is kind:
                seen.setdefault(v)
        return list(seen)

    @property
    def inputs(self) -> list[Value]:
        """Graph inputs (leaves without data), in order of first use."""
        return self._leaves(ValueKind.INPUT)

    @property
    def weights(self) -> list[Value]:
        """Weights (leaves that carry data), in order of first use."""
        return self._leaves(ValueKind.WEIGHT)

    def users(self, value: Value) -> list[Node]:
        """Nodes that read ``value``, in network order."""
        if self._users is None:
            users: dict[Value, list[Node]] = defaultdict(list)
            for node in self.nodes:
                for v in node.inputs:
                    if v is not None and (not users[v] or users[v][-1] is not node):
                        users[v].append(node)
            self._users = users
        return self._users.get(value, [])

    def is_output(self, value: Value) -> bool:
        return any(v is value for v in self.outputs.values())

    def contains(self, node: Node) -> bool:
        return node.id in self._node_ids

    # ---- rewriting ------------------------------------------------------------------------------

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Make every reader of ``old`` (nodes and marked outputs) read ``new`` instead."""
        for node in self.users(old):
            node.inputs = [new if v is old else v for v in node.inputs]
        for name, v in self.outputs.items():
            if v is old:
                self.outputs[name] = new
        self._users = None

    def set_input(self, node: Node, index: int, value: Value | None) -> None:
        node.inputs[index] = value
        self._users = None

    def remove_nodes(self, nodes: Iterable[Node]) -> None:
        """Drop nodes; their outputs must no longer be read."""
        dead = {n.id for n in nodes}
        for node in self.nodes:
            if node.id in dead:
                continue
            for v in node.inputs:
                if v is not None and v.producer is not None and v.producer.id in dead:
                    raise GraphError(f"cannot remove {v.producer.op}: {node.op} still reads it")
        for v in self.outputs.values():
            if v.producer is not None and v.producer.id in dead:
                raise GraphError(f"cannot remove {v.producer.op}: its output is marked")
        self.nodes = [n for n in self.nodes if n.id not in dead]
        self._node_ids -= dead
        self._users = None

    @contextmanager
    def inserting_before(self, anchor: Node | None) -> Iterator[None]:
        """Nodes added inside the block go before ``anchor`` (at the end when None)."""
        saved, self._insert_before = self._insert_before, anchor
        try:
            yield
        finally:
            self._insert_before = saved

    def move_before(self, node: Node, anchor: Node) -> None:
        """Reorder ``node`` to sit just before ``anchor`` (the caller keeps the order valid)."""
        self.nodes.remove(node)
        self.nodes.insert(self.nodes.index(anchor), node)

    def verify(self) -> None:
        """Check that every input is defined before it is read and every output exists."""
        defined: set[int] = set()
        for node in self.nodes:
            for v in node.inputs:
                if v is not None and v.producer is not None and v.producer.id not in defined:
                    raise GraphError(f"{node.op} reads {v.describe()} before it is produced")
            defined.add(node.id)
        for name, v in self.outputs.items():
            if v.producer is not None and v.producer.id not in defined:
                raise GraphError(f"output {name!r} is produced by a node not in the network")
        names: dict[str, Value] = {}
        for v in self.inputs + self.weights:
            if v.name is None:
                raise GraphError(f"an {v.kind.value} of {self.name!r} has no name: {v.describe()}")
            other = names.setdefault(v.name, v)
            if other is not v:
                raise GraphError(f"two different leaves of {self.name!r} are named {v.name!r}: "
                                 f"{other.describe()} ({other.kind.value}) and {v.describe()} "
                                 f"({v.kind.value})")

    def clone(self, name: str | None = None) -> tuple[Network, dict[Value, Value]]:
        """Copy nodes and intermediate values; leaves (inputs, weights, constants) are shared.

        Returns:
            the copy and a map from this network's values to the copy's.
        """
        other = Network(name or self.name, self.value_cls)
        mapping: dict[Value, Value] = {}
        for node in self.nodes:
            inputs = [None if v is None else mapping.get(v, v) for v in node.inputs]
            copy = Node(node.op, inputs, node.attrs, node.source)
            copy.outputs = [
                self.value_cls.make(ValueKind.INTERMEDIATE, name=v.name, dtype=v.dtype,
                                    shape=v.shape, producer=copy, index=v.index)
                for v in node.outputs
            ]
            for old, new in zip(node.outputs, copy.outputs):
                mapping[old] = new
            other.nodes.append(copy)
            other._node_ids.add(copy.id)
        other.outputs = {k: mapping.get(v, v) for k, v in self.outputs.items()}
        other.annotations = {k: dict(v) if isinstance(v, dict) else v
                             for k, v in self.annotations.items()}
        return other, mapping

    # ---- views ------------------------------------------------------------------------------

    def to_networkx(self) -> nx.MultiDiGraph:
        """A networkx view: one graph node per op node and per leaf, one edge per value read.

        Node keys are ``("node", id)`` / ``("leaf", id)``; each edge carries the ``value``.
        """
        g = nx.MultiDiGraph(name=self.name)
        for node in self.nodes:
            g.add_node(("node", node.id), op=node.op, node=node)
            for i, v in enumerate(node.inputs):
                if v is None or v.kind is ValueKind.CONST:
                    continue
                src = ("node", v.producer.id) if v.producer else ("leaf", v.id)
                if v.producer is None:
                    g.add_node(src, op=v.kind.value, value=v)
                g.add_edge(src, ("node", node.id), value=v, index=i)
        return g

    def to_dot(self) -> str:
        """Graphviz DOT text of the network (render with ``dot -Tsvg``)."""
        def q(text: str) -> str:
            return '"' + text.replace('"', r'\"') + '"'

        lines = [f"digraph {q(self.name)} {{", "  rankdir=TB;", "  node [fontname=monospace];"]
        for leaf in self.inputs + self.weights:
            shape = "ellipse" if leaf.kind is ValueKind.INPUT else "note"
            lines.append(f"  v{leaf.id} [label={q(leaf.describe())}, shape={shape}];")
        for node in self.nodes:
            label = node.op + (f"\\n{node.format_attrs()}" if node.attrs else "")
            lines.append(f"  n{node.id} [label={q(label)}, shape=box];")
            for v in node.inputs:
                if v is None or v.kind is ValueKind.CONST:
                    continue
                src = f"n{v.producer.id}" if v.producer else f"v{v.id}"
                lines.append(f"  {src} -> n{node.id} [label={q(v.describe())}];")
        for name, v in self.outputs.items():
            lines.append(f"  out_{abs(hash(name))} [label={q('output ' + name)}, shape=ellipse];")
            src = f"n{v.producer.id}" if v.producer else f"v{v.id}"
            lines.append(f"  {src} -> out_{abs(hash(name))} [label={q(v.describe())}];")
        lines.append("}")
        return "\n".join(lines)

    def local_labels(self) -> dict[Value, str]:
        """Short labels ``%0, %1, ...`` for unnamed intermediates, numbered in network order."""
        labels: dict[Value, str] = {}
        for node in self.nodes:
            for v in node.outputs:
                labels[v] = v.name or f"%{len(labels)}"
        return labels

    def __str__(self) -> str:
        labels = self.local_labels()

        def label(v: Value | None) -> str:
            return "None" if v is None else labels.get(v) or v.label()

        def describe(v: Value) -> str:
            text = v.describe()
            return label(v) + text[text.index(":"):] if ":" in text else text

        head = (f'network "{self.name}" ({len(self.inputs)} inputs, {len(self.weights)} weights, '
                f"{len(self.nodes)} nodes)")
        lines = [head]
        for v in self.inputs:
            lines.append(f"  input  {v.describe()}" + ("  (host)" if v.host else ""))
        for v in self.weights:
            lines.append(f"  weight {v.describe()}")
        for node in self.nodes:
            outs = ", ".join(describe(v) for v in node.outputs)
            args = [label(v) for v in node.inputs]
            if node.attrs:
                args.append(node.format_attrs())
            lines.append(f"  {outs} = {node.op}({', '.join(args)})")
        for name, v in self.outputs.items():
            lines.append(f"  output {name} = {label(v)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Network {self.name!r}: {len(self.nodes)} nodes>"

    # ---- building ------------------------------------------------------------------------------

    def build_engine(self, **options: Any) -> Engine:
        """Run the pass pipeline on a copy of this network and build an :class:`Engine`.

        See :func:`tgraph.engine.build_engine` for the options. The network itself is not changed;
        if it is the default network it is replaced by a fresh one.
        """
        # NOTE: the engine sits above the IR; importing it here, at call time, keeps the IR
        # importable on its own while giving users the ``net.build_engine()`` spelling.
        from tgraph.engine import build_engine

        return build_engine(self, **options)
