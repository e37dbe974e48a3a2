"""LoRA fusions.

- ``LoraPrologue``: the RMSNorm that produces a LoRA linear's input and nothing else (before
  q/k/v and gate/up, with or without the residual add) folds into the ``lora_shrink_concat`` that
  reads it (``rms_norm_lora_concat``, ``add_rms_norm_lora_concat``; see ``tgraph.ir.ops.lora``).
  At decode the norm and the shrink are one launch. A stacked shrink (single + multi LoRA: two
  adapter sets, one op) folds the same way: its second set's inputs and layout carry over.

NOTE: the SwiGLU before down_proj is left alone: folded in the same way, every program of the
shrink recomputes the activation over the whole 8192-wide row, and it measured slower than the
two launches it replaces (docs/performance.md).
"""
from __future__ import annotations

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.value import Value
from tgraph.nn import functional as F
from tgraph.nn.network_manager import recording
from tgraph.passes.manager import Pass, rewrite_each

# producer op -> the fused op (which takes the producer's inputs, then the shrink's LoRA inputs)
_FUSED = {"rms_norm": "rms_norm_lora_concat", "add_rms_norm": "add_rms_norm_lora_concat"}


class LoraPrologue(Pass):
    """``lora_shrink_concat(p(...))`` -> one fused op, where ``p`` is an RMSNorm or an add +
    RMSNorm with its weight in the activations' dtype, and the shrink is the only reader of the
    normed output. The add + RMSNorm's sum keeps its other readers: the fused op returns it as
    its second output."""

    name = "LoraPrologue"

    def run(self, net: Network) -> int:
        return rewrite_each(net, "lora_shrink_concat", self._fuse)

    @staticmethod
    def _fusable(net: Network, x: Value) -> Node | None:
        producer = x.producer
        if producer is None or producer.op not in _FUSED or producer.outputs[0] is not x:
            return None
        if len(net.users(x)) != 1 or net.is_output(x) or x.dtype is None:
            return None
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
        attrs = dict(shrink.attrs, eps=producer.attrs["eps"])
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
