"""Norm fusions.

- ``AddRmsNorm``: a residual add followed by an RMSNorm of the sum becomes one ``add_rms_norm``
  that returns both the normed tensor and the new residual.
- ``NormLinear``: an RMSNorm read only by linears moves into those linears (``norm_linear``),
  the residual add before it into the previous linear's epilogue, and a SwiGLU after it into
  the same kernel.
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.value import Value
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass, rewrite_each
from tgraph.passes.pattern import Match, Pattern, PatternPass


def _check(m: Match) -> bool:
    x, residual, w = m.bindings["x"], m.bindings["residual"], m.bindings["w"]
    if x.shape is None or x.shape != residual.shape or x.dtype != residual.dtype:
        return False  # the kernel takes no broadcasting
    return x.dtype is not None and x.dtype.is_floating_point and w.rank == 1


def _pattern(x, residual, w, eps):
    summed = x + residual
    return F.rms_norm(summed, w, eps), summed


def _replacement(x, residual, w, eps):
    return F.record("add_rms_norm", [x, residual, w], eps=eps)


class AddRmsNorm(PatternPass):
    def __init__(self) -> None:
        super().__init__("AddRmsNorm", [Pattern("add_rms_norm", _pattern, _replacement,
                                                scalars=("eps",), extra_check=_check)])


def _plain_linear(node: Node, x: Value) -> bool:
    """``node`` is a ``linear`` that reads ``x`` as its activations, in the GEMV's layout."""
    return (node.op == "linear" and node.inputs[0] is x and node.inputs[1] is not x
            and not node.attrs["transpose_a"] and node.attrs["transpose_b"]
            and node.attrs.get("impl") is None
            and node.inputs[1].dtype == x.dtype)


class NormLinear(Pass):
    """The pre-norm linears of a decoder layer become GEMVs with the norm (and the gate) inside.

    Three rewrites, in this order, each only where the next one applies:

    1. ``add_rms_norm(linear(a), r)`` whose normed output feeds one linear becomes
       ``h = linear_epilogue(a, residual=r)`` and ``rms_norm(h)``: the residual add moves into the
       matmul's epilogue.
    2. ``rms_norm(h) -> linear`` becomes ``norm_linear(h, g, W)``: no norm kernel and no normed
       tensor; at decode the GEMV normalises ``h`` as it streams it. Only a norm read by a single
       linear (q/k/v and gate/up are merged by then): with several, larger M would run the norm
       once per linear.
    3. ``swiglu(norm_linear(h, g, W_gate_up))`` becomes ``norm_linear(..., act="swiglu")``.

    At decode (M <= 4) this removes the norm and SwiGLU launches of every layer; at larger M the
    ``norm_linear`` kernel runs the norm, the cuBLAS GEMM and the gate as before.
    """

    name = "NormLinear"

    def run(self, net: Network) -> int:
        return (rewrite_each(net, "add_rms_norm", self._split_add)
                + rewrite_each(net, "rms_norm", self._fuse_norm)
                + rewrite_each(net, "swiglu", self._fuse_gate))

    @staticmethod
    def _norm_ok(net: Network, x: Value, weight: Value | None, normed: Value) -> bool:
        users = net.users(normed)
        return (x.dtype is not None and x.dtype.is_floating_point and x.rank is not None
                and (weight is None or (weight.rank == 1 and weight.dtype == x.dtype))
                and normed.dtype == x.dtype and not net.is_output(normed)
                and len(users) == 1 and _plain_linear(users[0], normed))

    def _split_add(self, net: Network, node: Node) -> int:
        a, b, weight = node.inputs
        normed, summed = node.outputs
        if not self._norm_ok(net, summed, weight, normed):
            return 0
        # The sum is symmetric: either operand may be the linear's output.
        for x, residual in ((a, b), (b, a)):
            lin = x.producer
            if (lin is not None and lin.op == "linear" and not lin.attrs["transpose_a"]
                    and lin.attrs.get("impl") is None
                    and net.users(x) == [node] and not net.is_output(x) and x is not residual):
                break
        else:
            return 0
        with recording(net), net.inserting_before(node):
            new_sum = F.record("linear_epilogue",
                               [lin.inputs[0], lin.inputs[1], lin.inputs[2], residual],
                               transpose_b=lin.attrs["transpose_b"], act=None)
            new_normed = F.rms_norm(new_sum, weight, node.attrs["eps"])
        net.replace_all_uses(summed, new_sum)
        net.replace_all_uses(normed, new_normed)
        net.remove_nodes([node, lin])
        return 1

    def _fuse_norm(self, net: Network, node: Node) -> int:
        x, weight = node.inputs
        normed = node.outputs[0]
        if not self._norm_ok(net, x, weight, normed):
            return 0
        (lin,) = net.users(normed)  # _norm_ok: exactly one reader, a linear
        with recording(net), net.inserting_before(lin):
            out = F.record("norm_linear", [x, weight, lin.inputs[1], lin.inputs[2]],
                           eps=node.attrs["eps"], act=None)
        net.replace_all_uses(lin.outputs[0], out)
        net.remove_nodes([lin, node])
        return 1

    def _fuse_gate(self, net: Network, node: Node) -> int:
        (gate_up,) = node.inputs
        producer = gate_up.producer
        if (producer is None or producer.op != "norm_linear" or producer.attrs["act"] is not None
                or net.users(gate_up) != [node] or net.is_output(gate_up)):
            return 0
        with recording(net), net.inserting_before(node):
            out = F.record("norm_linear", list(producer.inputs), eps=producer.attrs["eps"],
                           act="swiglu")
        net.replace_all_uses(node.outputs[0], out)
        net.remove_nodes([node, producer])
        return 1
