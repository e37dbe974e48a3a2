"""The pass pipeline, in order. This is the one place the order is written."""
from __future__ import annotations

from tgraph.passes.canonicalize import RmsNormFusion, SiluFusion
from tgraph.passes.cleanup import CommonSubexpressionElimination, DeadCodeElimination, NoOpRemoval
from tgraph.passes.manager import Pass


def default_pipeline() -> list[Pass]:
    """Clean up, recognise primitives spelled in plain ops, then clean up again."""
    return [
        NoOpRemoval(),
        CommonSubexpressionElimination(),
        SiluFusion(),
        RmsNormFusion(),
        DeadCodeElimination(),
    ]


def pass_names() -> list[str]:
    return [p.name for p in default_pipeline()]
