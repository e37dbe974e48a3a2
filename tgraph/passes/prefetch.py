"""``L2Prefetch``: at decode, start streaming a layer's later weights into L2 during its attention.

A batch-1 decode layer runs q/k/v, the attention and its reduce (latency-bound: a few hundred KB
of K/V), then o, gate|up and down, which stream tens of MB of weights. The pass puts an
``l2_prefetch`` node (see :mod:`tgraph.ir.ops.hints`) in front of each decode attention, naming
the weights of the linears between it and the next attention: the prefetch launches on a side
stream right after q/k/v, so HBM works on those weights while the attention runs, and o, gate|up
and down read them from L2. Prefill networks (attention with ``query_start_loc``) get none; the
kernel itself prefetches only for steps of few tokens (``PrefetchTuning.max_rows``) and on GPUs
that support it.
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops.hints import MAX_WEIGHTS
from tgraph.ir.value import Value, ValueKind
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass


def _is_decode_attention(node: Node) -> bool:
    if node.op == "rope_cache_attention":
        return True
    return node.op == "paged_attention" and (len(node.inputs) < 6 or node.inputs[5] is None)


def _weights_between(nodes: list[Node]) -> tuple[list[Value], list[int]]:
    """The 2-D weights the nodes read, in order (at most MAX_WEIGHTS), and their halves."""
    weights: list[Value] = []
    halves: list[int] = []
    for node in nodes:
        for v in node.inputs:
            if (v is None or v.kind is not ValueKind.WEIGHT or v.shape is None
                    or len(v.shape) != 2 or any(v is w for w in weights)):  # Tensor's == records
                continue
            weights.append(v)
            gated = node.op == "norm_linear" and node.attrs.get("act") == "swiglu"
            halves.append(2 if gated and v is node.inputs[2] else 1)
            if len(weights) == MAX_WEIGHTS:
                return weights, halves
    return weights, halves


class L2Prefetch(Pass):
    """An ``l2_prefetch`` of the following linears' weights before each decode attention."""

    name = "L2Prefetch"

    def run(self, net: Network) -> int:
        order = list(net.nodes)
        attention = [i for i, node in enumerate(order) if _is_decode_attention(node)]
        count = 0
        for j, i in enumerate(attention):
            end = attention[j + 1] if j + 1 < len(attention) else len(order)
            weights, halves = _weights_between(order[i + 1:end])
            if not weights:
                continue
            attn = order[i]
            with recording(net), net.inserting_before(attn):
                q = F.record("l2_prefetch", [attn.inputs[0], *weights], halves=tuple(halves))
            net.set_input(attn, 0, q)
            count += 1
        return count
