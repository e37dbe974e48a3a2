"""The op registry and every op definition (importing this package registers them all)."""
from tgraph.ir.ops import attention, collective, linalg, norms, pointwise, reduction, shape_ops  # noqa: F401
from tgraph.ir.ops import fused  # noqa: F401,E402  (fused ops build on the primitives)
from tgraph.ir.ops import fused_pointwise  # noqa: F401,E402
from tgraph.ir.ops import lora  # noqa: F401,E402
from tgraph.ir.ops import hints, sdpa, transfer  # noqa: F401,E402
from tgraph.ir.ops.registry import Meta, OpCategory, OpDef, all_ops, get_op, register_op

__all__ = ["Meta", "OpCategory", "OpDef", "all_ops", "get_op", "register_op"]
