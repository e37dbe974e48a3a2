"""Linear fusions.

- ``HorizontalLinear``: linears that read the same input (q/k/v, gate/up) become one GEMM on the
  concatenated weights; the outputs are split back as views. The concatenated weight is a new
  weight of the engine (its name joins the parts with ``+``); the engine's notes say which
  weights it came from. Quantized weights merge only where their schemes agree (the packed data
  and scales are stacked, never dequantized); dense and quantized parts never merge.
- ``LinearEpilogue``: a bias add, residual add or activation right after a linear is folded into
  one ``linear_epilogue`` (the matmul kernel applies it before writing).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.value import Value, ValueKind
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass
from tgraph.passes.pattern import Match, Pattern, PatternPass
from tgraph.quant import QuantizedWeight, is_quantized

MERGED_WEIGHTS = "merged_weights"


def _mergeable(node: Node) -> bool:
    if node.op != "linear" or node.attrs["transpose_a"] or not node.attrs["transpose_b"] \
            or node.attrs.get("impl") is not None:
        return False
    w, bias = node.inputs[1], node.inputs[2]
    leaves = [w] + ([bias] if bias is not None else [])
    return all(v.kind is ValueKind.WEIGHT and v.data is not None for v in leaves)


class HorizontalLinear(Pass):
    name = "HorizontalLinear"

    def run(self, net: Network) -> int:
        groups: dict[Value, list[Node]] = defaultdict(list)
        for node in net.nodes:
            if _mergeable(node):
                groups[node.inputs[0]].append(node)
        count = 0
        for x, nodes in groups.items():
            first = nodes[0]
            nodes = [n for n in nodes if n.inputs[1].dtype == first.inputs[1].dtype
                     and (n.inputs[2] is None) == (first.inputs[2] is None)
                     and _same_layout(n.inputs[1].data, first.inputs[1].data)]
            data = [n.inputs[1].data for n in nodes]
            if len(nodes) < 2 or (is_quantized(data[0]) and not QuantizedWeight.stackable(data)):
                continue
            self._merge(net, x, nodes)
            count += 1
        return count

    def _merge(self, net: Network, x: Value, nodes: list[Node]) -> None:
        weights = [n.inputs[1] for n in nodes]
        biases = [n.inputs[2] for n in nodes]
        merged_w = self._concat(net, weights)
        merged_b = self._concat(net, biases) if biases[0] is not None else None
        sizes = [w.shape[0] for w in weights]
        with recording(net), net.inserting_before(nodes[0]):
            out = F.linear(x, merged_w, merged_b)
            parts = F.split(out, sizes, dim=-1)
        for node, part in zip(nodes, parts):
            net.replace_all_uses(node.outputs[0], part)
        net.remove_nodes(nodes)

    @staticmethod
    def _concat(net: Network, leaves: list[Value]) -> Value:
        name = "+".join(v.name for v in leaves)
        if is_quantized(leaves[0].data):
            data = QuantizedWeight.cat([v.data for v in leaves], name=name)
        else:
            data = torch.cat([v.data for v in leaves], dim=0)
        merged = net.value_cls.make(ValueKind.WEIGHT, name=name, dtype=data.dtype,
                                    shape=tuple(data.shape), data=data)
        net.annotations.setdefault(MERGED_WEIGHTS, {})[name] = [v.name for v in leaves]
        return merged


def _same_layout(a: object, b: object) -> bool:
    """Whether two weights' data stack into one: both dense, or quantized alike."""
    if is_quantized(a) or is_quantized(b):
        return is_quantized(a) and a.mergeable_with(b)
    return True


def _residual_check(m: Match) -> bool:
    (lin,) = m.graph_nodes("linear")
    out, residual = lin.outputs[0], m.bindings["residual"]
    return (not lin.attrs["transpose_a"] and out.shape is not None and out.shape == residual.shape
            and out.dtype == residual.dtype)


def _bias_check(m: Match) -> bool:
    (lin,) = m.graph_nodes("linear")
    b = m.bindings["b"]
    return (not lin.attrs["transpose_a"] and b.rank == 1 and lin.outputs[0].dtype == b.dtype
            and lin.outputs[0].shape is not None
            and b.shape[0] == lin.outputs[0].shape[-1])


def _plain_linear_check(m: Match) -> bool:
    (lin,) = m.graph_nodes("linear")
    return not lin.attrs["transpose_a"]


def _epilogue(x, w, bias=None, residual=None, *, transpose_b=True, act=None):
    return F.record("linear_epilogue", [x, w, bias, residual], transpose_b=transpose_b, act=act)


def _patterns() -> list[Pattern]:
    patterns = []
    for tb in (True, False):
        patterns.append(Pattern(
            f"linear_residual_tb{int(tb)}",
            lambda x, w, bias, residual, tb=tb: F.linear(x, w, bias, transpose_b=tb) + residual,
            lambda x, w, bias, residual, tb=tb: _epilogue(x, w, bias, residual, transpose_b=tb),
            extra_check=_residual_check))
        patterns.append(Pattern(
            f"linear_residual_nobias_tb{int(tb)}",
            lambda x, w, residual, tb=tb: F.linear(x, w, None, transpose_b=tb) + residual,
            lambda x, w, residual, tb=tb: _epilogue(x, w, None, residual, transpose_b=tb),
            extra_check=_residual_check))
        patterns.append(Pattern(
            f"linear_bias_tb{int(tb)}",
            lambda x, w, b, tb=tb: F.linear(x, w, None, transpose_b=tb) + b,
            lambda x, w, b, tb=tb: F.linear(x, w, b, transpose_b=tb),
            extra_check=_bias_check))
        for act in ("silu", "gelu", "gelu_tanh", "relu", "sigmoid"):
            for with_bias in (False, True):
                if with_bias:
                    def pat(x, w, bias, tb=tb, act=act):
                        return F.record(act, [F.linear(x, w, bias, transpose_b=tb)])

                    def rep(x, w, bias, tb=tb, act=act):
                        return _epilogue(x, w, bias, None, transpose_b=tb, act=act)
                else:
                    def pat(x, w, tb=tb, act=act):
                        return F.record(act, [F.linear(x, w, None, transpose_b=tb)])

                    def rep(x, w, tb=tb, act=act):
                        return _epilogue(x, w, None, None, transpose_b=tb, act=act)
                patterns.append(Pattern(f"linear_{act}_b{int(with_bias)}_tb{int(tb)}", pat, rep,
                                        extra_check=_plain_linear_check))
    return patterns


class LinearEpilogue(PatternPass):
    def __init__(self) -> None:
        super().__init__("LinearEpilogue", _patterns())
