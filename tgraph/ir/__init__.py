"""The intermediate representation: values, nodes, networks, symbolic shapes and the op registry."""
from tgraph.ir.network import Network, meta_of
from tgraph.ir.node import Node
from tgraph.ir.ops import Meta, OpCategory, OpDef, all_ops, get_op, register_op
from tgraph.ir.shape import Dim, Shape, ShapeRuleError
from tgraph.ir.value import Value, ValueKind

__all__ = [
    "Dim", "Meta", "Network", "Node", "OpCategory", "OpDef", "Shape", "ShapeRuleError", "Value",
    "ValueKind", "all_ops", "get_op", "meta_of", "register_op",
]
