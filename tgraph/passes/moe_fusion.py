"""Mixture-of-experts fusions.

- ``MoeAddRmsNorm``: ``add_rms_norm(moe(x, ...), residual)`` becomes ``moe_add_rms_norm``: the
  experts' weighted shares are added by the norm's kernel, so no combine kernel runs between
  the down projection and the block boundary.
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass, rewrite_each


class MoeAddRmsNorm(Pass):
    """``add_rms_norm`` whose branch operand is a ``moe`` output read by nothing else becomes
    ``moe_add_rms_norm`` (the residual stream's sum and the normed tensor, as before)."""

    name = "MoeAddRmsNorm"

    def run(self, net: Network) -> int:
        return rewrite_each(net, "add_rms_norm", self._fuse)

    @staticmethod
    def _fuse(net: Network, node: Node) -> int:
        a, b, weight = node.inputs
        # The sum is symmetric: either operand may be the experts' output.
        for x, residual in ((a, b), (b, a)):
            moe = x.producer
            if (moe is not None and moe.op == "moe" and x is not residual
                    and net.users(x) == [node] and not net.is_output(x)):
                break
        else:
            return 0
        with recording(net), net.inserting_before(node):
            normed, summed = F.record("moe_add_rms_norm", [*moe.inputs, residual, weight],
                                      top_k=moe.attrs["top_k"],
                                      renormalize=moe.attrs["renormalize"],
                                      eps=node.attrs["eps"])
        net.replace_all_uses(node.outputs[0], normed)
        net.replace_all_uses(node.outputs[1], summed)
        net.remove_nodes([node, moe])
        return 1
