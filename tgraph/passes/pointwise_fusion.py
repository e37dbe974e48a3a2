"""PointwiseFusion: connected groups of pointwise ops (and last-dim reductions) become one
``fused_pointwise`` node, which the Triton backend runs as one generated kernel.

It runs after the hand-written fusions (SiluFusion, RmsNormFusion, AddRmsNorm, SwiGLU,
LinearEpilogue...), so it only picks up what they leave: hand-spelled softmaxes, activations,
scalings, masks.

How groups form (on the dataflow graph, never on list adjacency):

- A *candidate* is a node of a fusible pointwise op, or a ``sum``/``mean``/``amax`` over the last
  dim with ``keepdim``, whose tensors are float (or bool masks), have a known rank and no unknown
  dims, and do not live on the host.
- Every candidate has a *full shape* ``S``: its output shape, or for a reduction (and pointwise
  nodes computing on its ``[..., 1]`` result) the shape of the rows it reduces. A producer and a
  consumer with the same ``S`` may share a group; the groups grow greedily in network order.
- A merge is refused when it would make a cycle (a node outside the group reads a group value
  and feeds a group node), or when an external input broadcasts against ``S`` in a way other than
  "same shape", "broadcast along leading dims" (a ``[N]`` weight against ``[M, N]``) or "a single
  element".
- A reduction joins only if a pointwise node of its group reads its result; groups of one node
  are left alone.

A group value read outside the group, or marked as a network output, becomes an output of the
fused node: nothing is recomputed and nothing is dropped.
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass

import torch

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import OpCategory, get_op
from tgraph.ir.ops.fused_pointwise import (
    BOOL_RESULT_OPS,
    FUSIBLE_DTYPES,
    FUSIBLE_OPS,
    MAX_REDUCTION_WIDTH,
    REDUCE_OPS,
    PointwiseProgram,
)
from tgraph.ir.value import Value, ValueKind
from tgraph.passes.manager import Pass

logger = logging.getLogger("tgraph.passes")

__all__ = ["PointwiseFusion"]


@dataclass(frozen=True)
class _Info:
    """What the grouping needs to know of a candidate node."""

    full: tuple  # the shape S the group's kernel iterates over
    row: bool  # the output is S reduced over its last dim (``S[:-1] + (1,)``)


def _known(shape: tuple | None) -> bool:
    return shape is not None and all(d is not None for d in shape)


def _row_shape(full: tuple) -> tuple:
    return tuple(full[:-1]) + (1,)


def _input_ok(shape: tuple, full: tuple) -> bool:
    """Whether an external input of ``shape`` broadcasts against ``full`` in a way the kernel
    takes: the same shape, a suffix of it after leading ones (leading-dim broadcast), or one
    element."""
    if tuple(shape) == tuple(full):
        return True
    stripped = list(shape)
    while stripped and stripped[0] == 1:
        stripped.pop(0)
    if not stripped:
        return True
    if len(stripped) > len(full):
        return False
    return tuple(stripped) == tuple(full[len(full) - len(stripped):])


def _operand_ok(v: Value | None) -> bool:
    if v is None:
        return False
    if v.kind is ValueKind.CONST:
        return isinstance(v.data, (bool, int, float))
    return not v.host and v.dtype in FUSIBLE_DTYPES and _known(v.shape)


def _reduces_last_dim(node: Node) -> bool:
    x = node.inputs[0]
    dim = node.attrs.get("dim")
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    rank = len(x.shape)
    if not isinstance(dim, int) or rank == 0 or not -rank <= dim < rank:
        return False
    width = x.shape[-1]
    # NOTE: the kernel keeps a whole row in one block, so the width must be known and bounded;
    # a width of 1 would make the reduction a no-op that is not worth a row kernel.
    return (dim % rank == rank - 1 and bool(node.attrs.get("keepdim"))
            and isinstance(width, int) and 1 < width <= MAX_REDUCTION_WIDTH
            and x.dtype is not None and x.dtype.is_floating_point)


def _classify(node: Node, infos: dict[Node, _Info]) -> _Info | None:
    """The candidate info of ``node``, or None when it can't join a fused kernel."""
    if len(node.outputs) != 1 or not node.inputs:
        return None
    out = node.outputs[0]
    if out.dtype not in FUSIBLE_DTYPES or not _known(out.shape):
        return None
    if not all(_operand_ok(v) for v in node.inputs):
        return None
    if node.op in REDUCE_OPS:
        if len(node.inputs) != 1 or node.inputs[0].kind is ValueKind.CONST \
                or not _reduces_last_dim(node):
            return None
        return _Info(tuple(node.inputs[0].shape), row=True)
    if node.op != "cast":
        if node.op not in FUSIBLE_OPS or get_op(node.op).category is not OpCategory.POINTWISE:
            return None
        if out.dtype == torch.bool and node.op not in BOOL_RESULT_OPS:
            return None
    shape = tuple(out.shape)
    for v in node.inputs:
        p = v.producer
        info = infos.get(p) if p is not None else None
        if info is not None and info.row and _row_shape(info.full) == shape and info.full != shape:
            return _Info(info.full, row=True)
    return _Info(shape, row=False)


def _positions(net: Network) -> dict[int, int]:
    return {n.id: i for i, n in enumerate(net.nodes)}


def _creates_cycle(net: Network, members: list[Node], pos: dict[int, int]) -> bool:
    """Whether a node outside ``members`` reads a member's value and (transitively) feeds a member.

    Walks the dataflow from the members' outside readers; nodes after the last member are not
    followed, since in a topological order they cannot feed it.
    """
    ids = {m.id for m in members}
    last = max(pos[m.id] for m in members)
    stack = [u for m in members for v in m.outputs for u in net.users(v) if u.id not in ids]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if n.id in seen or pos[n.id] > last:
            continue
        seen.add(n.id)
        for v in n.outputs:
            for u in net.users(v):
                if u.id in ids:
                    return True
                stack.append(u)
    return False


def _valid(net: Network, members: list[Node], full: tuple, pos: dict[int, int]) -> bool:
    ids = {m.id for m in members}
    for m in members:
        for v in m.inputs:
            if v is None or v.kind is ValueKind.CONST:
                continue
            if v.producer is not None and v.producer.id in ids:
                continue
            if not _input_ok(v.shape, full):
                return False
    return not _creates_cycle(net, members, pos)


def _restore_topological_order(net: Network) -> None:
    """Reorder nodes so every value is produced before it is read, keeping the existing order
    wherever it is already valid (a stable topological sort)."""
    pos = _positions(net)
    if all(v is None or v.producer is None or pos[v.producer.id] < pos[n.id]
           for n in net.nodes for v in n.inputs):
        return
    by_id = {n.id: n for n in net.nodes}
    indegree = {n.id: 0 for n in net.nodes}
    readers: dict[int, set[int]] = {n.id: set() for n in net.nodes}
    for n in net.nodes:
        for v in n.inputs:
            if v is not None and v.producer is not None and n.id not in readers[v.producer.id]:
                readers[v.producer.id].add(n.id)
                indegree[n.id] += 1
    ready = [(pos[i], i) for i, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[Node] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(by_id[i])
        for r in readers[i]:
            indegree[r] -= 1
            if indegree[r] == 0:
                heapq.heappush(ready, (pos[r], r))
    if len(order) != len(net.nodes):
        raise RuntimeError("PointwiseFusion: the network has a cycle after fusion")
    for i, node in enumerate(order):
        if net.nodes[i] is not node:
            net.move_before(node, net.nodes[i])


class PointwiseFusion(Pass):
    """Replaces connected groups of pointwise nodes by one ``fused_pointwise`` node each.

    ``run`` returns the number of groups fused.
    """

    name = "PointwiseFusion"

    def run(self, net: Network) -> int:
        infos: dict[Node, _Info] = {}
        for node in net.nodes:
            info = _classify(node, infos)
            if info is not None:
                infos[node] = info
        count = 0
        for members in self._groups(net, infos):
            if self._fuse(net, members):
                count += 1
        return count

    # ---- grouping ---------------------------------------------------------------------------

    def _groups(self, net: Network, infos: dict[Node, _Info]) -> list[list[Node]]:
        pos = _positions(net)
        group_of: dict[int, int] = {}
        groups: dict[int, list[Node]] = {}
        for gid, node in enumerate(n for n in net.nodes if n in infos):
            full = infos[node].full
            groups[gid] = [node]
            group_of[node.id] = gid
            producer_groups: list[int] = []
            for v in node.inputs:
                p = v.producer if v is not None else None
                if p is None or p not in infos or infos[p].full != full:
                    continue
                g = group_of[p.id]
                if g != gid and g not in producer_groups:
                    producer_groups.append(g)
            # Retry until nothing merges: a producer group refused alone (an odd input that
            # another producer group supplies) may fit once that other group has joined.
            changed = True
            while changed and producer_groups:
                changed = False
                for g in list(producer_groups):
                    merged = groups[gid] + groups[g]
                    if _valid(net, merged, full, pos):
                        groups[gid] = merged
                        for m in groups.pop(g):
                            group_of[m.id] = gid
                        producer_groups.remove(g)
                        changed = True
        result = []
        for members in groups.values():
            members = self._drop_trailing_reductions(members)
            if len(members) >= 2:
                result.append(sorted(members, key=lambda n: pos[n.id]))
        result.sort(key=lambda ms: pos[ms[0].id])
        return result

    @staticmethod
    def _drop_trailing_reductions(members: list[Node]) -> list[Node]:
        """A reduction whose result no group node reads is a plain reduction kernel, not fusion
        work; dropping such a leaf keeps the group connected and acyclic."""
        ids = {m.id for m in members}
        read = {v for m in members for v in m.inputs
                if v is not None and v.producer is not None and v.producer.id in ids}
        return [m for m in members if m.op not in REDUCE_OPS or m.outputs[0] in read]

    # ---- rewriting --------------------------------------------------------------------------

    def _fuse(self, net: Network, members: list[Node]) -> bool:
        pos = _positions(net)
        members = sorted(members, key=lambda n: pos[n.id])
        # Earlier groups are single nodes now; contracting them may have closed a cycle.
        if _creates_cycle(net, members, pos):
            return False
        ids = {m.id for m in members}
        inputs: list[Value] = []
        instrs: list[tuple] = []
        slot: dict[Value, int] = {}
        consts: dict[tuple[str, str], int] = {}

        def operand(v: Value) -> int:
            if v.kind is ValueKind.CONST:
                key = (type(v.data).__name__, repr(v.data))
                if key not in consts:
                    consts[key] = len(instrs)
                    instrs.append(("const", v.data))
                return consts[key]
            if v not in slot:
                slot[v] = len(instrs)
                instrs.append(("load", len(inputs)))
                inputs.append(v)
            return slot[v]

        for m in members:
            if m.op in REDUCE_OPS:
                ins = ("reduce", m.op, operand(m.inputs[0]))
            elif m.op == "cast":
                ins = ("cast", operand(m.inputs[0]), m.attrs["dtype"])
            else:
                ins = ("op", m.op, tuple(operand(v) for v in m.inputs),
                       tuple(sorted(m.attrs.items())))
            slot[m.outputs[0]] = len(instrs)
            instrs.append(ins)

        outputs = [m.outputs[0] for m in members
                   if net.is_output(m.outputs[0])
                   or any(u.id not in ids for u in net.users(m.outputs[0]))]
        if not outputs:
            return False  # nothing reads the group: dead code is DCE's business
        program = PointwiseProgram(tuple(instrs), tuple(slot[v] for v in outputs))
        last = pos[members[-1].id]
        anchor = net.nodes[last + 1] if last + 1 < len(net.nodes) else None
        node = net.add_node("fused_pointwise", inputs, {"program": program},
                            source=members[0].source, before=anchor)
        for new, old in zip(node.outputs, outputs):
            if new.shape != old.shape or new.dtype != old.dtype:
                # The program's rule disagrees with the nodes it replaces: keep the nodes.
                logger.warning("PointwiseFusion: %s infers %s, the group had %s; not fused",
                               program, new.describe(), old.describe())
                net.remove_nodes([node])
                return False
        for new, old in zip(node.outputs, outputs):
            new.name = old.name
            net.replace_all_uses(old, new)
        net.remove_nodes(members)
        _restore_topological_order(net)
        return True
