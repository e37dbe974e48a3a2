"""Checking what ``Engine.forward`` is given, and binding the dynamic dims.

The first ``forward`` fixes what the network left unknown (an input's dtype, or its rank: its dims
then become symbols ``name.0``, ``name.1``, ... so later calls may change them). Every call checks
names, types, dtypes, devices and shapes against the specs and says what was expected.

Inputs are on one device, except for a network spread over several devices: each input then has
the device its placement says (a KV cache on its layer's device, the batch inputs on the main
device), and the call's device is the main one.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tgraph.errors import EngineInputError
from tgraph.ir.network import Network
from tgraph.ir.ops import Meta, get_op
from tgraph.ir.shape import ShapeRuleError, format_shape, resolve_dim
from tgraph.ir.value import Value, ValueKind, scalar_dtype
from tgraph.passes.memory import MemoryPlan


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "?" if dtype is None else str(dtype).replace("torch.", "")


@dataclass
class InputSpec:
    """What one graph input must look like; unknown parts are filled in by the first call.

    ``device`` is set only for networks spread over several devices (``placement`` its label).
    """

    name: str
    value: Value
    dtype: torch.dtype | None
    shape: tuple | None
    host: bool
    device: torch.device | None = None
    placement: str | None = None

    def describe(self) -> str:
        where = " (host, in runtime_params)" if self.host else ""
        if self.placement is not None and not self.host:
            where = f" on {self.placement}"
        return f"{self.name}: {_dtype_name(self.dtype)}{format_shape(self.shape)}{where}"


def input_specs(inputs: Sequence[Value], placement: Mapping[Value, str] | None = None,
                main: str | None = None) -> dict[str, InputSpec]:
    """The specs of a network's inputs.

    Args:
        inputs: the graph inputs.
        placement: for a multi-device network, the label of each input (``main`` when absent).
        main: the main device's label.
    """
    specs = {v.name: InputSpec(v.name, v, v.dtype, v.shape, v.host) for v in inputs}
    if placement is not None:
        from tgraph.ir.ops.transfer import placement_device

        for spec in specs.values():
            if not spec.host:
                spec.placement = placement.get(spec.value, main)
                spec.device = placement_device(spec.placement)
    return specs


def _unknown_name(name: str, known: list[str], where: str) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {where} {name!r}{hint}"


def _as_host_tensor(name: str, value: Any, spec: InputSpec) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise EngineInputError(f"runtime param {name!r} must be on the CPU (a host value), "
                                   f"got a tensor on {value.device}")
        return value
    try:
        return torch.tensor(value, dtype=spec.dtype)
    except (TypeError, ValueError) as err:
        raise EngineInputError(f"runtime param {name!r}: expected a CPU tensor or a list of "
                               f"numbers for {spec.describe()}, "
                               f"got {type(value).__name__}") from err


def bind_inputs(specs: dict[str, InputSpec], inputs: Mapping[str, Any],
                runtime_params: Mapping[str, Any] | None,
                main: torch.device | None = None) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, int],
                                                           torch.device | None]:
    """Check inputs against the specs and bind symbol values.

    Args:
        specs: from :func:`input_specs`.
        inputs: device tensors by name.
        runtime_params: host values by name.
        main: for a multi-device network, its main device: every input must then be on its
            spec's device (instead of all on one), and ``main`` is the call's device.

    Returns:
        the tensors by name, the symbol bindings, and the device of the (non-host) inputs.
    Raises:
        EngineInputError: naming what is missing, unknown or wrong, and what was expected.
    """
    runtime_params = runtime_params or {}
    if not isinstance(inputs, Mapping):
        raise EngineInputError(f"inputs must be a dict of name -> tensor, got "
                               f"{type(inputs).__name__}")
    device_names = [n for n, s in specs.items() if not s.host]
    host_names = [n for n, s in specs.items() if s.host]
    problems = []
    for name in inputs:
        if name not in specs:
            problems.append(_unknown_name(name, device_names, "input"))
        elif specs[name].host:
            problems.append(f"{name!r} is a host value: pass it in runtime_params")
    for name in runtime_params:
        if name not in specs:
            problems.append(_unknown_name(name, host_names, "runtime param"))
        elif not specs[name].host:
            problems.append(f"{name!r} is a device input: pass it in inputs, not runtime_params")
    missing = [n for n in device_names if n not in inputs]
    missing += [n for n in host_names if n not in runtime_params]
    if missing:
        problems.append("missing " + ", ".join(specs[n].describe() for n in missing))
    if problems:
        expected = "; ".join(s.describe() for s in specs.values())
        raise EngineInputError("; ".join(problems) + f". The network expects: {expected}")

    tensors: dict[str, torch.Tensor] = {}
    env: dict[str, int] = {}
    origin: dict[str, str] = {}
    device: torch.device | None = None
    for name, spec in specs.items():
        if spec.host:
            t = _as_host_tensor(name, runtime_params[name], spec)
        else:
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                raise EngineInputError(f"input {name!r} must be a torch.Tensor, got "
                                       f"{type(t).__name__}; expected {spec.describe()}")
            if device is None:
                device = t.device
            elif t.device != device and main is None:
                raise EngineInputError(f"input {name!r} is on {t.device} but other inputs are on "
                                       f"{device}; all inputs must be on one device")
        if spec.dtype is not None and t.dtype != spec.dtype:
            raise EngineInputError(f"input {name!r} has dtype {_dtype_name(t.dtype)}, expected "
                                   f"{spec.describe()}")
        if spec.shape is not None:
            if t.dim() != len(spec.shape):
                raise EngineInputError(f"input {name!r} has shape {list(t.shape)} (rank {t.dim()}),"
                                       f" expected {spec.describe()}")
            for i, (want, got) in enumerate(zip(spec.shape, t.shape)):
                if isinstance(want, int) and want != got:
                    raise EngineInputError(f"input {name!r} has shape {list(t.shape)}: dim {i} is "
                                           f"{got}, expected {spec.describe()}")
                if isinstance(want, str):
                    bound = env.setdefault(want, int(got))
                    origin.setdefault(want, name)
                    if bound != got:
                        raise EngineInputError(
                            f"dim {want!r} is {bound} in input {origin[want]!r} but {got} in "
                            f"input {name!r} (shape {list(t.shape)}, expected {spec.describe()})")
        tensors[name] = t
    if main is not None:
        _check_placed(specs, tensors)
        device = main
    return tensors, env, device


def _check_placed(specs: dict[str, InputSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    for name, spec in specs.items():
        if spec.device is not None and tensors[name].device != spec.device:
            raise EngineInputError(f"input {name!r} is on {tensors[name].device}, expected "
                                   f"{spec.describe()}: this network is spread over several "
                                   f"devices and reads each input where it was placed")


def fix_unknowns(specs: dict[str, InputSpec], tensors: Mapping[str, torch.Tensor]) -> None:
    """After the first call: unknown dtypes become fixed, unknown ranks get symbolic dims."""
    for name, spec in specs.items():
        t = tensors[name]
        if spec.dtype is None:
            spec.dtype = t.dtype
        if spec.shape is None:
            spec.shape = tuple(f"{name}.{i}" for i in range(t.dim()))


def infer_concrete(net: Network, tensors: Mapping[str, torch.Tensor], env: Mapping[str, int]
                   ) -> dict[Value, tuple[tuple[int, ...], torch.dtype]]:
    """Run every shape rule on concrete input shapes: the shape and dtype of every value.

    Raises:
        EngineInputError: when the inputs satisfy their own specs but contradict an op (e.g. the
            inner dims of a matmul whose inputs both had unknown shapes).
    """
    metas: dict[Value, Meta] = {}
    for v in net.inputs:
        t = tensors[v.name]
        metas[v] = Meta(tuple(t.shape), t.dtype)
    for v in net.weights:
        metas[v] = Meta(tuple(v.shape), v.dtype)
    result: dict[Value, tuple[tuple[int, ...], torch.dtype]] = {}
    for node in net.nodes:
        ins = []
        for v in node.inputs:
            if v is None:
                ins.append(None)
            elif v.kind is ValueKind.CONST:
                ins.append(Meta((), scalar_dtype(v.data), scalar=True))
            else:
                ins.append(metas[v])
        attrs = _resolve_attrs(node.attrs, env)
        try:
            outs = get_op(node.op).infer_metas(ins, attrs)
        except ShapeRuleError as err:
            listed = ", ".join("None" if m is None else str(m) for m in ins)
            where = f" (recorded at {node.source})" if node.source else ""
            raise EngineInputError(f"the inputs' shapes do not fit op {node.op}{where}: {err}; "
                                   f"its operands are {listed}") from None
        for v, m in zip(node.outputs, outs):
            shape = tuple(resolve_dim(d, env) for d in m.shape)
            if not all(isinstance(d, int) for d in shape):
                raise EngineInputError(f"op {node.op} has unresolved dims {format_shape(shape)}; "
                                       "a symbol used in an attribute is bound by no input")
            metas[v] = Meta(shape, m.dtype)
            result[v] = (shape, m.dtype)
    return result


def _resolve_attrs(attrs: dict[str, Any], env: Mapping[str, int]) -> dict[str, Any]:
    if "shape" in attrs and isinstance(attrs["shape"], tuple):
        attrs = dict(attrs)
        attrs["shape"] = tuple(resolve_dim(d, env) for d in attrs["shape"])
    return attrs


@dataclass
class Binding:
    """What depends on the concrete dims of one call signature: the shapes of every value, the
    memory plan of each device label (``None``: the single device), the steps' attributes with
    their symbols resolved, the buffer views of the latest arena set they were built for and, on
    the CPU, the step program."""

    shapes: dict[Value, tuple[tuple[int, ...], torch.dtype]]
    memory: dict[str | None, MemoryPlan]
    attrs: dict[int, dict[str, Any]]
    views: tuple[Any, list[list[torch.Tensor | None]]] | None = None  # (arena set, views)
    # The CPU's step program of this signature (tgraph.engine.program), and what builds it: the
    # previous call's inputs, and whether a step of the plan cannot be bound.
    program: Any = None
    last_inputs: dict[str, torch.Tensor] | None = None
    unbindable: bool = False

    @property
    def arena_bytes(self) -> int:
        return sum(m.arena_bytes for m in self.memory.values())

    @property
    def naive_bytes(self) -> int:
        return sum(m.naive_bytes for m in self.memory.values())


# ---- the memory of given outputs ----------------------------------------------------------------

def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``t`` spans in its device's memory, ``[start, end)``: its storage's address plus
    its offset (``data_ptr()``) up to the end of its last element; ``None`` when it is empty.

    Distinct storages never share addresses on one device, so two tensors on one device share
    memory only if their spans intersect (views interleaved in one storage, e.g. two columns of a
    matrix, count as sharing: the check is by range, not element by element).
    """
    start = t.data_ptr()
    if t.is_contiguous():  # the common case, and the cheapest
        nbytes = t.nbytes
        return (start, start + nbytes) if nbytes else None
    if t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (a stride 0 from ``expand``, or strides that
    step into one another); layouts interleaved in ways this cannot tell apart are counted too."""
    if t.is_contiguous():
        return False
    reach = 0  # the farthest element offset the faster-moving dims reach
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


@dataclass(frozen=True)
class OutputReads:
    """What the engine reads from its inputs after it starts writing the given outputs, found once
    from the plan: every step runs before any output is written, then the outputs are written in
    the order they were marked, each copied from its value. So an output buffer may share memory
    with an input only if the network does not write that input in place (a KV cache) and no
    output written at or after it is a view of that input."""

    order: tuple[str, ...]  # the outputs, in the order they are written
    readers: dict[str, tuple[int, ...]]  # input name -> indices of the outputs that view it
    written: frozenset[str]  # inputs the network writes in place

    @cached_property
    def inputs(self) -> frozenset[str]:
        """Every input an output buffer is checked against."""
        return self.written | frozenset(self.readers)


def check_output_memory(outputs: Mapping[str, torch.Tensor],
                        inputs: Mapping[str, torch.Tensor], reads: OutputReads) -> None:
    """Refuse output buffers whose writes would change what the call computes or returns.

    Cost: one pass over the outputs and the inputs named in ``reads`` (those the outputs view and
    those written in place), never over every input.

    Raises:
        EngineInputError: an output whose elements share memory with one another, two outputs
            that share memory, or an output that shares memory with an input the network writes
            in place or an output written at or after it is read from; the message names both.
    """
    spans: list[tuple[int, int, int, str]] = []
    devices = set()
    for index, name in enumerate(reads.order):
        t = outputs[name]
        if overlaps_itself(t):
            raise EngineInputError(
                f"output {name!r} ({_dtype_name(t.dtype)}{list(t.shape)}, strides "
                f"{list(t.stride())}) has elements that share memory (e.g. from expand()); "
                f"pass a tensor whose elements are distinct, e.g. torch.empty({list(t.shape)})")
        span = byte_span(t)
        if span is not None:
            spans.append((span[0], span[1], index, name))
            devices.add(t.device)
    # Addresses are compared first; the devices only for a pair whose addresses meet (two
    # devices' address spaces may coincide).
    spans.sort()
    reach, widest = 0, -1  # of the outputs starting earlier: the farthest end, and whose
    for start, end, index, name in spans:
        if start < reach and _same_device(outputs, reads.order[widest], name, devices):
            raise EngineInputError(
                f"outputs {reads.order[widest]!r} and {name!r} share memory; each output needs "
                "a buffer of its own (one result would overwrite the other)")
        if end > reach:
            reach, widest = end, index
    if not spans:
        return
    for in_name in reads.inputs:
        t = inputs[in_name]
        span = byte_span(t)
        for start, end, index, name in spans if span is not None else ():
            if start >= span[1] or span[0] >= end or outputs[name].device != t.device:
                continue
            if in_name in reads.written:
                why = "which the network writes in place (a cache)"
            else:
                later = [i for i in reads.readers[in_name] if i >= index]
                if not later:
                    continue  # read in full before this output is written
                reader = reads.order[later[0]]
                why = (f"which output {name!r} is a view of" if reader == name else
                       f"which output {reader!r} is a view of, copied after {name!r} is written")
            raise EngineInputError(
                f"output {name!r} shares memory with input {in_name!r}, {why}; pass an output "
                f"buffer that shares no memory with {in_name!r}")


def _same_device(outputs: Mapping[str, torch.Tensor], a: str, b: str,
                 devices: set[torch.device]) -> bool:
    return len(devices) == 1 or outputs[a].device == outputs[b].device
