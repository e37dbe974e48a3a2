"""Partitioning: split the node sequence into segments.

A *device* segment is a run of nodes that only read device tensors and can be recorded as one CUDA
graph. A node that needs host values (it reads a ``host`` input, or syncs with the host like
``sdpa_attention``) or is a collective the capture can't hold starts a *host* segment of its own;
device work resumes after it.

A network spread over several devices (recorded with placements, see
``tgraph.nn.functional.placement``) is also split wherever the device changes: every segment runs
on one device (on CUDA: one CUDA graph per segment, captured on that device), and each
``to_device`` copy is a host segment of its own, run between the graphs. A cross-device copy
orders itself after the work queued on both devices (torch's peer copy does that), which a graph
captured on one device could not express.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tgraph.errors import GraphError
from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import OpCategory, get_op
from tgraph.ir.ops.transfer import placement_device
from tgraph.ir.value import Value, ValueKind
from tgraph.nn.functional import MAIN_DEVICE, PLACEMENT

# Ops that read device values on the host (lengths for a per-sequence loop): never captured.
HOST_SYNC_OPS = frozenset({"sdpa_attention"})


@dataclass
class Segment:
    """A run of consecutive nodes; ``capturable`` segments may become one CUDA graph.

    ``device`` is the placement label the segment runs on, for networks spread over several
    devices (``None`` otherwise).
    """

    nodes: list[Node] = field(default_factory=list)
    capturable: bool = True
    reason: str = ""
    device: str | None = None

    def __repr__(self) -> str:
        kind = "device" if self.capturable else f"host ({self.reason})"
        where = f" on {self.device}" if self.device else ""
        return f"<Segment {kind}{where}: {len(self.nodes)} nodes>"


@dataclass
class Placement:
    """Where every value of a multi-device network lives.

    Attributes:
        main: the main device's label (batch inputs, returned outputs).
        of: the label of every value (leaves and node outputs).
        devices: the labels used, main first, then in order of first use.
    """

    main: str
    of: dict[Value, str]
    devices: list[str]

    def node_device(self, node: Node) -> str:
        """The device a node runs on (that of its outputs)."""
        return self.of[node.outputs[0]]


def needs_host(node: Node) -> str:
    """Why ``node`` cannot be captured in a CUDA graph ('' when it can)."""
    for v in node.inputs:
        if v is not None and v.host:
            return f"{node.op} reads host value {v.label()}"
    if get_op(node.op).category is OpCategory.COLLECTIVE and not node.attrs.get("capturable"):
        return f"{node.op} is a collective"
    if node.op in HOST_SYNC_OPS:
        return f"{node.op} reads lengths on the host"
    return ""


def infer_placement(net: Network) -> Placement | None:
    """Propagate the recorded placements through ``net`` (after passes rewrote it).

    Leaves keep the labels recorded for them; a ``to_device`` node runs on its destination;
    every other node runs where its operands live (they must agree: the recording copied
    whatever crossed a device), or on the main device when it reads none of known placement.
    Leaves a pass created (a merged weight) take the device of the node reading them.

    Returns:
        The placement, or ``None`` for a network recorded without placements or that uses a
        single device (it then runs exactly as any single-device network).

    Raises:
        GraphError: a node reads values on two devices with no copy between them.
    """
    main = net.annotations.get(MAIN_DEVICE)
    if main is None:
        return None
    of: dict[Value, str] = dict(net.annotations.get(PLACEMENT, {}))
    for node in net.nodes:
        tensors = [v for v in node.inputs if v is not None and v.kind is not ValueKind.CONST]
        if node.op == "to_device":
            label = node.attrs["device"]
        else:
            known = list(dict.fromkeys(of[v] for v in tensors if v in of))
            if len(known) > 1:
                listed = ", ".join(f"{v.describe()} on {of[v]}" for v in tensors if v in of)
                where = f" (recorded at {node.source})" if node.source else ""
                raise GraphError(f"{node.op}{where} reads values on several devices with no "
                                 f"to_device copy between them: {listed}")
            label = known[0] if known else main
        for v in tensors:
            of.setdefault(v, label)
        for out in node.outputs:
            of[out] = label
    for v in net.outputs.values():
        of.setdefault(v, main)
    devices = list(dict.fromkeys([main, *of.values()]))
    if len(devices) == 1:
        return None
    return Placement(main, of, devices)


def place_outputs(net: Network, placement: Placement) -> int:
    """Copy every marked output that lives off the main device to it (outputs come back there).

    Returns:
        The number of copies added (``placement`` is updated with them).
    """
    added = 0
    for name, v in list(net.outputs.items()):
        if placement.of[v] == placement.main:
            continue
        copy = net.add_node("to_device", [v], {"device": placement.main}).outputs[0]
        placement.of[copy] = placement.main
        net.outputs[name] = copy
        added += 1
    return added


def group_transfers(net: Network, placement: Placement) -> int:
    """Move copies to the edges of the device runs they serve, so that each run is one segment.

    Recording makes a copy where a value is first read, which interleaves copies with the work
    of the reading device (a layer's first norm, then the rotary tables, then the block
    table...). Consider the maximal runs of consecutive non-copy nodes on one device: a copy
    *into* a run's device that sits inside the run moves to just before the run (its source
    lives on another device, so it was produced before the run), and a copy *out of* it moves
    to just after the run (its readers are on another device, so they come after the run).

    Returns:
        The number of copies moved.
    """
    nodes = net.nodes
    position = {n.id: i for i, n in enumerate(nodes)}
    moved = 0
    i = 0
    while i < len(nodes):
        if nodes[i].op == "to_device":
            i += 1
            continue
        device = placement.node_device(nodes[i])
        end = i  # the run: nodes[i..end], copies included, until a node on another device
        for j in range(i + 1, len(nodes)):
            if nodes[j].op != "to_device" and placement.node_device(nodes[j]) != device:
                break
            end = j
        before, body, after = [], [], []
        for node in nodes[i:end + 1]:
            if node.op != "to_device":
                body.append(node)
                continue
            src = node.inputs[0]
            produced_before = src.producer is None or position[src.producer.id] < i
            if placement.node_device(node) == device and produced_before:
                before.append(node)
            elif placement.node_device(node) != device:
                after.append(node)
            else:
                body.append(node)
        order = before + body + after
        if order != nodes[i:end + 1]:
            moved += sum(1 for a, b in zip(order, nodes[i:end + 1]) if a is not b and
                         a.op == "to_device")
            nodes[i:end + 1] = order
            position.update({n.id: k for k, n in enumerate(nodes[i:end + 1], start=i)})
        i = end + 1
    return moved


def partition(net: Network, host_reason: Callable[[Node], str] = needs_host,
              placement: Placement | None = None) -> list[Segment]:
    """Group nodes into device segments separated by host nodes (one segment each).

    Args:
        net: the network.
        host_reason: why a node must run outside CUDA graphs ('' when it need not).
        placement: for a multi-device network: segments are also split where the device
            changes, and each ``to_device`` is a host segment of its own.
    """
    segments: list[Segment] = []
    for node in net.nodes:
        reason = host_reason(node)
        device = None
        if placement is not None:
            device = placement.node_device(node)
            if node.op == "to_device" and not reason:
                src = node.inputs[0]
                reason = f"to_device {placement.of.get(src, placement.main)} -> {device}"
                last = segments[-1] if segments else None
                if last is not None and last.reason == reason:  # one segment per batch of copies
                    last.nodes.append(node)
                    continue
            elif not reason and placement_device(device).type == "cpu" \
                    and placement_device(placement.main).type == "cuda":
                # Work a rule moved off the GPU (experts on the CPU) runs between the graphs.
                reason = f"runs on {device}"
                last = segments[-1] if segments else None
                if last is not None and last.reason == reason:
                    last.nodes.append(node)
                    continue
        if reason:
            segments.append(Segment([node], capturable=False, reason=reason, device=device))
        elif segments and segments[-1].capturable and segments[-1].device == device:
            segments[-1].nodes.append(node)
        else:
            segments.append(Segment([node], device=device))
    return segments
