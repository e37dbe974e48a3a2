"""Lowering a network to a launch plan: one step per node, with the kernel chosen, its arguments
as precomputed slot indices, and the slots to release after it (by liveness)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tgraph.ir.network import Network
from tgraph.ir.node import Node
from tgraph.ir.ops import get_op
from tgraph.ir.value import Value, ValueKind
from tgraph.quant import is_quantized

Kernel = Callable[..., Any]


@dataclass
class Step:
    """One kernel launch of the plan."""

    kernel: Kernel
    kernel_name: str
    node: Node
    in_slots: tuple[int | None, ...]
    out_slots: tuple[int, ...]
    attrs: dict[str, Any]
    release: tuple[int, ...] = ()
    symbolic_attrs: bool = False
    into: bool = False


@dataclass
class LaunchPlan:
    """Steps in execution order plus the slot layout of every value."""

    steps: list[Step] = field(default_factory=list)
    slot_of: dict[Value, int] = field(default_factory=dict)
    num_slots: int = 0
    constants: dict[int, Any] = field(default_factory=dict)
    uses_arena: bool = False  # kernels write into planned arena buffers (the Triton plan)

    def slot(self, v: Value) -> int:
        if v not in self.slot_of:
            self.slot_of[v] = self.num_slots
            self.num_slots += 1
        return self.slot_of[v]


def reference_kernel(node: Node) -> tuple[Kernel, str]:
    """The torch reference implementation of a node's op."""
    return get_op(node.op).reference, f"ref.{node.op}"


def _has_symbols(attrs: dict[str, Any]) -> bool:
    shape = attrs.get("shape")
    return isinstance(shape, tuple) and any(isinstance(d, str) for d in shape)


def _outputs_alias_inputs(node: Node) -> bool:
    op = get_op(node.op)
    return all(op.alias_input(i) is not None for i in range(len(node.outputs)))


def is_side_hint(node: Node) -> bool:
    """A view whose op may also launch work on a side stream (an L2 prefetch hint): it computes
    nothing of the step and the step's kernels never wait for it."""
    return get_op(node.op).launches and _outputs_alias_inputs(node)


def is_pure_view(node: Node) -> bool:
    """Every output of the node aliases an input and the op launches nothing on the side: it
    needs no buffer and no kernel."""
    return not get_op(node.op).launches and _outputs_alias_inputs(node)


def on_device(kernel: Kernel, device: torch.device) -> Kernel:
    """``kernel`` run with ``device`` current: Triton launches on the current CUDA device (and
    its current stream), whatever device its tensors are on."""
    index = device.index

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.cuda.device(index):
            return kernel(*args, **kwargs)

    run.__name__ = getattr(kernel, "__name__", "kernel")
    return run


def _quantized_weights(node: Node) -> str:
    """``[<scheme>]`` for a node reading a quantized weight (what ``str(engine)`` shows)."""
    schemes = [v.data.scheme.describe(v.data.shape) for v in node.inputs
               if v is not None and v.kind is ValueKind.WEIGHT and is_quantized(v.data)]
    return f"[{', '.join(schemes)}]" if schemes else ""


def lower(net: Network, select: Callable[[Node], tuple[Kernel, str]] | None = None,
          devices: Mapping[Node, torch.device] | None = None) -> LaunchPlan:
    """Build the launch plan of ``net``.

    Args:
        select: picks a kernel writing into planned buffers (``kernel(outs, *inputs, **attrs)``)
            for each node that is not a pure view; ``None`` uses the torch references, which
            return their results.
        devices: for a network spread over several CUDA devices, the device of each node; its
            kernel then runs with that device current (see :func:`on_device`).
    """
    plan = LaunchPlan(uses_arena=select is not None)
    for v in net.inputs + net.weights:
        plan.slot(v)
    last_use: dict[Value, int] = {}
    for i, node in enumerate(net.nodes):
        for v in node.inputs:
            if v is not None and v.kind is ValueKind.INTERMEDIATE:
                last_use[v] = i
    keep = set(net.outputs.values())
    for node in net.nodes:
        ins = []
        for v in node.inputs:
            if v is None:
                ins.append(None)
            else:
                ins.append(plan.slot(v))
        outs = tuple(plan.slot(v) for v in node.outputs)
        into = select is not None and not is_pure_view(node)
        kernel, name = select(node) if into else reference_kernel(node)
        name += _quantized_weights(node)
        device = devices.get(node) if devices is not None else None
        if device is not None and device.type == "cuda" and not is_pure_view(node):
            kernel = on_device(kernel, device)
        plan.steps.append(Step(kernel, name, node, tuple(ins), outs, dict(node.attrs),
                               symbolic_attrs=_has_symbols(node.attrs), into=into))
    for v, i in last_use.items():
        if v not in keep:
            step = plan.steps[i]
            step.release = step.release + (plan.slot_of[v],)
    # Outputs nobody reads (e.g. the second half of a split) are released where they are made.
    for step in plan.steps:
        for v, slot in zip(step.node.outputs, step.out_slots):
            if v not in last_use and v not in keep:
                step.release = step.release + (slot,)
    for v in net.outputs.values():
        plan.slot(v)
    plan.constants = {slot: v.data for v, slot in plan.slot_of.items()
                      if v.kind is ValueKind.CONST}
    return plan
