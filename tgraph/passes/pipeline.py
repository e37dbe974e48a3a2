"""The pass pipeline, in order. This is the one place the order is written."""
from __future__ import annotations

from tgraph.passes.activation_fusion import SwiGLU
from tgraph.passes.attention_fusion import QkNormAttention, RopeAttention, RopeCache
from tgraph.passes.canonicalize import RmsNormFusion, SiluFusion
from tgraph.passes.cleanup import CommonSubexpressionElimination, DeadCodeElimination, NoOpRemoval
from tgraph.passes.collective_fusion import AllReduceAddRmsNorm
from tgraph.passes.linear_fusion import HorizontalLinear, LinearEpilogue
from tgraph.passes.lora_fusion import LoraPrologue
from tgraph.passes.manager import Pass
from tgraph.passes.moe_fusion import MoeAddRmsNorm
from tgraph.passes.norm_fusion import AddRmsNorm, NormLinear
from tgraph.passes.pointwise_fusion import PointwiseFusion
from tgraph.passes.prefetch import L2Prefetch


def default_pipeline() -> list[Pass]:
    """Clean up; recognise primitives spelled in plain ops; merge linears that share an input
    (so that SwiGLU sees packed gate|up); hand-written fusions (the tensor-parallel
    all-reduce + add + RMSNorm right after AddRmsNorm, which it builds on, and before pointwise
    fusion could take the add; the experts' combine into the add + RMSNorm after them; the
    decode rope, and a q/k norm before it, into attention once rope_cache exists; norms and
    gates into the linears around them once the norm and gate ops exist, and into the LoRA
    shrinks that NormLinear leaves); generated pointwise kernels for what is left; once the
    linears are final, the L2 prefetch of each decode layer's weights; clean up."""
    return [
        NoOpRemoval(),
        CommonSubexpressionElimination(),
        SiluFusion(),
        RmsNormFusion(),
        HorizontalLinear(),
        AddRmsNorm(),
        AllReduceAddRmsNorm(),
        MoeAddRmsNorm(),
        SwiGLU(),
        RopeCache(),
        RopeAttention(),
        QkNormAttention(),
        NormLinear(),
        LoraPrologue(),
        LinearEpilogue(),
        PointwiseFusion(),
        L2Prefetch(),
        DeadCodeElimination(),
    ]


def pass_names() -> list[str]:
    return [p.name for p in default_pipeline()]
