"""The op registry and every op definition (importing this package registers them all)."""
from tgraph.ir.ops import (  # noqa: F401  # noqa: F401,E402
    attention,
    collective,
    fused,
    fused_pointwise,
    hints,
    linalg,
    lora,
    moe,
    norms,
    pointwise,
    reduction,
    sdpa,
    shape_ops,
    transfer,
)
from tgraph.ir.ops.registry import Meta, OpCategory, OpDef, all_ops, get_op, register_op

__all__ = ["Meta", "OpCategory", "OpDef", "all_ops", "get_op", "register_op"]
