"""Partitioning: split the node sequence into segments.

A *device* segment is a run of nodes that only read device tensors and can be recorded as one CUDA
graph. A node that needs host values (it reads a ``host`` input) or is a collective the capture
can't hold starts a *host* segment of its own; device work resumes after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import OpCategory, get_op


@dataclass
class Segment:
    """A run of consecutive nodes; ``capturable`` segments may become one CUDA graph."""

    nodes: list[Node] = field(default_factory=list)
    capturable: bool = True
    reason: str = ""

    def __repr__(self) -> str:
        kind = "device" if self.capturable else f"host ({self.reason})"
        return f"<Segment {kind}: {len(self.nodes)} nodes>"


def needs_host(node: Node) -> str:
    """Why ``node`` cannot be captured in a CUDA graph ('' when it can)."""
    for v in node.inputs:
        if v is not None and v.host:
            return f"{node.op} reads host value {v.label()}"
    if get_op(node.op).category is OpCategory.COLLECTIVE and not node.attrs.get("capturable"):
        return f"{node.op} is a collective"
    return ""


def partition(net: Network, host_reason: Callable[[Node], str] = needs_host) -> list[Segment]:
    """Group nodes into device segments separated by host nodes (one segment each)."""
    segments: list[Segment] = []
    for node in net.nodes:
        reason = host_reason(node)
        if reason:
            segments.append(Segment([node], capturable=False, reason=reason))
        elif segments and segments[-1].capturable:
            segments[-1].nodes.append(node)
        else:
            segments.append(Segment([node]))
    return segments
