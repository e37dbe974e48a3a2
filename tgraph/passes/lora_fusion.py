"""LoRA fusions.

- ``LoraPrologue``: the op that produces a LoRA linear's input and nothing else (the RMSNorm
  before q/k/v and gate/up, with or without the residual add, and the SwiGLU before down) folds
  into the ``lora_shrink_concat`` that reads it (``rms_norm_lora_concat``,
  ``add_rms_norm_lora_concat``, ``swiglu_lora_concat``; see ``tgraph.ir.ops.lora``). At decode
  the producer and the shrink are one launch.
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.value import Value
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass

# producer op -> the fused op, and how many of the producer's leading inputs it takes
_FUSED = {"rms_norm": "rms_norm_lora_concat", "add_rms_norm": "add_rms_norm_lora_concat",
          "swiglu": "swiglu_lora_concat"}


class LoraPrologue(Pass):
    """``lora_shrink_concat(p(...))`` -> one fused op, where ``p`` is an RMSNorm (with its
    weight in the activations' dtype), an add + RMSNorm, or a SwiGLU, and the shrink is the only
    reader of ``p``'s (first) output. The add + RMSNorm's sum keeps its other readers: the fused
    op returns it as its second output."""

    name = "LoraPrologue"

    def run(self, net: Network) -> int:
        count = 0
        for node in list(net.nodes):
            if node.op == "lora_shrink_concat" and net.contains(node):
                count += self._fuse(net, node)
        return count

    @staticmethod
    def _fusable(net: Network, x: Value) -> Node | None:
        producer = x.producer
        if producer is None or producer.op not in _FUSED or producer.outputs[0] is not x:
            return None
        if len(net.users(x)) != 1 or net.is_output(x) or x.dtype is None:
            return None
        if producer.op != "swiglu":
            weight = producer.inputs[-1]
            if weight is None or weight.rank != 1 or weight.dtype != x.dtype:
                return None  # the kernels scale by a weight of the activations' dtype
        if any(v is not None and v.dtype != x.dtype for v in producer.inputs):
            return None
        return producer

    def _fuse(self, net: Network, shrink: Node) -> int:
        producer = self._fusable(net, shrink.inputs[0])
        if producer is None:
            return 0
        attrs = dict(shrink.attrs)
        if "eps" in producer.attrs:
            attrs["eps"] = producer.attrs["eps"]
        with recording(net), net.inserting_before(shrink):
            fused = F.record(_FUSED[producer.op], [*producer.inputs, *shrink.inputs[1:]], **attrs)
        if producer.op == "add_rms_norm":
            xcat, summed = fused
            net.replace_all_uses(producer.outputs[1], summed)
        else:
            xcat = fused
        net.replace_all_uses(shrink.outputs[0], xcat)
        net.remove_nodes([shrink, producer])
        return 1
