"""Nodes: one recorded op application."""
from __future__ import annotations

import itertools
from typing import Any

from tgraph.ir.value import Value

_ids = itertools.count()


class Node:
    """An op applied to input values, producing output values.

    Args:
        op: the registered op name.
        inputs: input values; ``None`` stands for an absent optional input (e.g. no bias).
        attrs: static attributes (dims, eps, dtypes...), part of the node's identity for CSE.
        source: ``file:line`` of the user code that recorded the node (for errors and printing).
    """

    __slots__ = ("id", "op", "inputs", "attrs", "outputs", "source", "__weakref__")

    def __init__(self, op: str, inputs: list[Value | None], attrs: dict[str, Any],
                 source: str = "") -> None:
        self.id = next(_ids)
        self.op = op
        self.inputs = list(inputs)
        self.attrs = dict(attrs)
        self.outputs: list[Value] = []
        self.source = source

    @property
    def output(self) -> Value:
        """The single output of a one-output node."""
        if len(self.outputs) != 1:
            raise ValueError(f"node {self.op} has {len(self.outputs)} outputs, not one")
        return self.outputs[0]

    def format_attrs(self) -> str:
        parts = []
        for k, v in self.attrs.items():
            text = str(v).replace("torch.", "") if v is not None else "None"
            parts.append(f"{k}={text}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        ins = ", ".join("None" if v is None else v.label() for v in self.inputs)
        return f"<Node {self.op}({ins})>"
